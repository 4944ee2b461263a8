"""The small interface an engine calls to use atom-kv.

An engine builds one :class:`SchedulerHooks` (``build_scheduler_hooks``) and one
:class:`WorkerHooks` per TP rank (``build_worker_hooks``), and combines the
workers' outputs with :class:`KVOutputAggregator`. Rank 0 also runs a
registration pinger (``build_registration_pinger``). See ``docs/integrating.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Optional

from atom_kv.engine_hooks.interface import KVCacheLayer, SchedulerHooks, WorkerHooks
from atom_kv.engine_hooks.types import (
    ConnectorMetadata,
    KVConnectorOutput,
    LoadSpec,
    SchedulerEvents,
    SendSpec,
)

if TYPE_CHECKING:
    from atom_kv.config import KVTransferConfig
    from atom_kv.connector.aggregator import KVOutputAggregator
    from atom_kv.discovery import RegistrationPinger
    from atom_kv.wire import CompatInfo

__all__ = [
    "ConnectorMetadata",
    "KVCacheLayer",
    "KVConnectorOutput",
    "KVOutputAggregator",
    "LoadSpec",
    "SchedulerEvents",
    "SchedulerHooks",
    "SendSpec",
    "WorkerHooks",
    "build_registration_pinger",
    "build_scheduler_hooks",
    "build_worker_hooks",
]


def build_scheduler_hooks(
    config: "KVTransferConfig",
    *,
    engine_id: str,
    host: str,
    tp_size: int,
    dp_rank: int = 0,
    block_size: int,
) -> SchedulerHooks:
    """The scheduler-side connector of one engine (``host`` is what consumers dial)."""
    from atom_kv.connector.scheduler import ConnectorScheduler

    return ConnectorScheduler(
        config, engine_id=engine_id, host=host, tp_size=tp_size, dp_rank=dp_rank, block_size=block_size
    )


def build_worker_hooks(
    config: "KVTransferConfig",
    *,
    engine_id: str,
    host: str,
    tp_rank: int,
    tp_size: int,
    dp_rank: int = 0,
    compat: "CompatInfo",
) -> WorkerHooks:
    """The worker-side connector of one TP rank (producers start their handshake server here)."""
    from atom_kv.connector.worker import ConnectorWorker

    return ConnectorWorker(
        config, engine_id=engine_id, host=host, tp_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank, compat=compat
    )


def build_registration_pinger(
    config: "KVTransferConfig",
    *,
    role: Literal["P", "D"],
    index: str,
    http_host: str,
    http_port: int,
    tp_size: int,
    dp_size: int = 1,
    engine_id: str,
    model: Optional[str] = None,
) -> "RegistrationPinger":
    """Rank 0's registration pinger for every proxy in ``config.proxy_ip``; call ``.start()`` and ``.close()``."""
    from atom_kv.discovery import build_registration_pinger as build

    return build(
        config, role=role, index=index, http_host=http_host, http_port=http_port,
        tp_size=tp_size, dp_size=dp_size, engine_id=engine_id, model=model,
    )


def __getattr__(name: str) -> Any:
    # imported lazily: atom_kv.connector itself imports this package's types
    if name == "KVOutputAggregator":
        from atom_kv.connector.aggregator import KVOutputAggregator

        return KVOutputAggregator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
