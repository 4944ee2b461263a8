"""The small interface an engine calls to use atom-kv.

An engine builds one :class:`SchedulerHooks` (``build_scheduler_hooks``) and one
:class:`WorkerHooks` per TP rank (``build_worker_hooks``, which takes the
rank's :class:`CompatInfo`), and combines the workers' outputs with
:class:`KVOutputAggregator`. Rank 0 also runs a registration pinger
(``build_registration_pinger``). See ``docs/integrating.md``.

Everything an engine needs is importable from here; the implementations live
in :mod:`atom_kv.connector` (which never imports this package).
"""

from __future__ import annotations

from typing import Optional

from atom_kv.config import KVTransferConfig
from atom_kv.connector import ConnectorScheduler, KVOutputAggregator, create_worker
from atom_kv.connector.base import KVCacheLayer, SchedulerHooks, WorkerHooks
from atom_kv.connector.routes_view import PeerRoute, RouteReport
from atom_kv.connector.types import (
    ConnectorMetadata,
    KVConnectorOutput,
    LoadSpec,
    SchedulerEvents,
    SendSpec,
)
from atom_kv.discovery import build_registration_pinger
from atom_kv.wire import CompatInfo

__all__ = [
    "CompatInfo",
    "ConnectorMetadata",
    "KVCacheLayer",
    "KVConnectorOutput",
    "KVOutputAggregator",
    "LoadSpec",
    "PeerRoute",
    "RouteReport",
    "SchedulerEvents",
    "SchedulerHooks",
    "SendSpec",
    "WorkerHooks",
    "build_registration_pinger",
    "build_scheduler_hooks",
    "build_worker_hooks",
]


def build_scheduler_hooks(
    config: KVTransferConfig,
    *,
    engine_id: str,
    host: str,
    tp_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    pp_size: int = 1,
    block_size: int,
    announce_sends: bool = False,
) -> SchedulerHooks:
    """The scheduler-side connector of one engine (``host`` is what consumers dial).

    ``announce_sends``: for an engine that hands ``build_connector_meta()`` to
    its ranks only with its next batch (so a rank could learn late that a
    transfer was issued, and a decode engine's read of it would not be
    confirmed in time): the producer tells its ranks directly as well.
    ``dp_size``/``pp_size``: the engine's DP ranks and prefill pipeline stages,
    announced in the prefill's ``kv_transfer_params`` (where its ranks listen)."""
    return ConnectorScheduler(
        config, engine_id=engine_id, host=host, tp_size=tp_size, dp_rank=dp_rank, dp_size=dp_size, pp_size=pp_size,
        block_size=block_size, announce_sends=announce_sends,
    )


def build_worker_hooks(
    config: KVTransferConfig,
    *,
    engine_id: str,
    host: str,
    tp_rank: int,
    tp_size: int,
    dp_rank: int = 0,
    dp_size: Optional[int] = None,
    pp_rank: int = 0,
    pp_size: int = 1,
    start_layer: int = 0,
    compat: CompatInfo,
    bind_host: Optional[str] = None,
) -> WorkerHooks:
    """The worker-side connector of one TP rank, for ``config.kv_role``, started
    (:meth:`~atom_kv.connector.worker.ConnectorWorker.start`: producers open their
    handshake server here, listening on ``bind_host``: by default ``host``, the
    address other engines dial; a port of the plan in use fails here, at the
    engine's start-up).

    A prefill pipeline stage passes ``pp_rank``/``pp_size``, ``dp_size`` (its
    port depends on it) and ``start_layer``, the model layer of its first cache."""
    return create_worker(
        config, engine_id=engine_id, host=host, tp_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank, dp_size=dp_size,
        pp_rank=pp_rank, pp_size=pp_size, start_layer=start_layer, compat=compat, bind_host=bind_host,
    ).start()
