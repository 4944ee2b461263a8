"""The KV connector: the scheduler side, the worker side of each TP rank (a
producer or a consumer class, :func:`create_worker` picks) and the
aggregator that combines the ranks' finished sets.

Engines use it through :mod:`atom_kv.engine_hooks`.
"""

from __future__ import annotations

from typing import Any, Optional

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


def create_worker(config: KVTransferConfig, *, bind_host: Optional[str] = None, **identity: Any) -> ConnectorWorker:
    """The worker of one TP rank for ``config.kv_role``: a :class:`ProducerWorker`
    or a :class:`ConsumerWorker`. Its listeners (handshake server, the backend's
    servers) bind ``bind_host``, by default the rank's ``host``: never every
    interface unless ``"0.0.0.0"`` is asked for, once it starts: it opens
    nothing until :meth:`~ConnectorWorker.start` (or the first
    ``register_kv_caches``), and ``close()`` is safe before.
    ``identity``: the keyword arguments of :class:`ConnectorWorker` (engine_id,
    host, tp_rank, tp_size, dp_rank, dp_size, pp_rank, pp_size, compat, backend)."""
    if config.is_producer:
        return ProducerWorker(config, bind_host=bind_host, **identity)
    return ConsumerWorker(config, bind_host=bind_host, **identity)
