"""FAKE ``mori.io`` for tests: host-memory stand-in, no RDMA.

Implements the documented MORI-IO Python surface over host memory. Reads
between processes on one host use ``process_vm_readv``; within one process,
``memmove``. Failures can be injected per engine (``engine.fake_fail_next``,
``engine.fake_hang_next``, ``engine.fake_set_delay``) or for every engine a
process creates (``FAKE_MORI_IO_FAIL_NEXT``, ``FAKE_MORI_IO_HANG_NEXT``,
``FAKE_MORI_IO_DELAY_MS``).
"""

from .engine import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    IOEngineSession,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
    TransferStatus,
    XgmiBackendConfig,
)

__fake__ = True

__all__ = [
    "BackendType",
    "EngineDesc",
    "IOEngine",
    "IOEngineConfig",
    "IOEngineSession",
    "MemoryDesc",
    "MemoryLocationType",
    "PollCqMode",
    "RdmaBackendConfig",
    "StatusCode",
    "TransferStatus",
    "XgmiBackendConfig",
]
