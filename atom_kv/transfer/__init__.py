"""Transfer: one-sided reads of a peer's registered memory; the shared top level, one sub-package per backend.

One sub-package per backend: ``tcp/``, ``cma/``, ``gpu_ipc/``, ``nixl/`` and
``moriio/``; each imports only the shared top level and its own modules.
The top level is what they share: the protocol (``base``), memory kinds,
routes and ``auto`` (the one module that knows every backend), regions,
jobs, lifecycle, trust, the frame server and socket I/O, staging, the
serving-plus-reader set-up of tcp, cma and gpu_ipc (``_served``), the grant
endpoint of cma and gpu_ipc (``_grant``) and the RDMA skeleton of nixl and
moriio (``_rdma``).

Backends are imported lazily by :func:`create_backend`, so ``import atom_kv``
never fails because an optional backend (MORI-IO, NIXL) cannot load here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Optional

from atom_kv.transfer.base import (
    MAX_REGION_BYTES,
    BackendUnavailable,
    ChunkedRegion,
    PeerUnreachable,
    ReadFailure,
    ReadHandle,
    ReadOp,
    TransferBackend,
    TransferError,
    UnsupportedMemory,
    chunk_sizes,
    merge_ops,
    split_pair,
)

from atom_kv.transfer.memory import HOST, MemoryKind, memory_of

if TYPE_CHECKING:
    from atom_kv.config import KVTransferConfig
    from atom_kv.ports import RankPorts

__all__ = [
    "BACKENDS",
    "MAX_REGION_BYTES",
    "BackendUnavailable",
    "ChunkedRegion",
    "PeerUnreachable",
    "ReadFailure",
    "ReadHandle",
    "ReadOp",
    "TransferBackend",
    "TransferError",
    "UnsupportedMemory",
    "chunk_sizes",
    "create_backend",
    "HOST",
    "MemoryKind",
    "memory_of",
    "merge_ops",
    "split_pair",
]

#: backend name -> "module:class"
BACKENDS = {
    "tcp": "atom_kv.transfer.tcp:TcpBackend",
    "cma": "atom_kv.transfer.cma:CmaBackend",
    "auto": "atom_kv.transfer.auto:AutoBackend",
    "moriio": "atom_kv.transfer.moriio:MoriIOBackend",
    "gpu_ipc": "atom_kv.transfer.gpu_ipc:GpuIpcBackend",
    "nixl": "atom_kv.transfer.nixl:NixlBackend",
}


def create_backend(
    name: str,
    config: Optional["KVTransferConfig"] = None,
    *,
    host: str = "127.0.0.1",
    bind_host: Optional[str] = None,
    key: Optional[str] = None,
    ports: Optional["RankPorts"] = None,
) -> TransferBackend:
    """Build the backend called ``name`` (see :data:`BACKENDS`).

    ``host`` is the address peers use to reach this process (written into
    its descriptor); ``bind_host`` the address its listeners bind (the
    engine's ``--host``; ``host`` when not given; all interfaces only when
    it says ``"0.0.0.0"``); ``key`` a process-unique name (engine id +
    ranks) used by backends that need one; ``ports`` the rank's port plan
    (:func:`atom_kv.ports.rank_ports`; without it every listener's port is
    OS-assigned).
    Raises :class:`BackendUnavailable` with a one-line reason when the backend
    cannot run here.
    """
    try:
        target = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown transfer backend {name!r}; allowed: {', '.join(sorted(BACKENDS))}") from None
    module_name, cls_name = target.split(":")
    module = importlib.import_module(module_name)
    cls = getattr(module, cls_name)
    extra = {} if ports is None else {"ports": ports}
    return cls(config, host=host, bind_host=bind_host, key=key, **extra)
