"""The KV connector: the scheduler side, the worker side of each TP rank (a
producer or a consumer class, :func:`create_worker` picks) and the
aggregator that combines the ranks' finished sets.

Engines use it through :mod:`atom_kv.engine_hooks`.
"""

from __future__ import annotations

from typing import Any

from atom_kv.config import KVTransferConfig
from atom_kv.connector.aggregator import KVOutputAggregator
from atom_kv.connector.consumer import ConsumerWorker
from atom_kv.connector.producer import ProducerWorker
from atom_kv.connector.scheduler import ConnectorScheduler
from atom_kv.connector.worker import ConnectorWorker

__all__ = [
    "ConnectorScheduler",
    "ConnectorWorker",
    "ConsumerWorker",
    "KVOutputAggregator",
    "ProducerWorker",
    "create_worker",
]


def create_worker(config: KVTransferConfig, *, bind_host: str = "0.0.0.0", **identity: Any) -> ConnectorWorker:
    """The worker of one TP rank for ``config.kv_role``: a :class:`ProducerWorker`
    (its handshake server listens on ``bind_host``) or a :class:`ConsumerWorker`.
    ``identity``: the keyword arguments of :class:`ConnectorWorker` (engine_id,
    host, tp_rank, tp_size, dp_rank, compat, backend)."""
    if config.is_producer:
        return ProducerWorker(config, bind_host=bind_host, **identity)
    return ConsumerWorker(config, **identity)
