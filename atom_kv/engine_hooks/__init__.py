"""The small interface an engine calls to use atom-kv.

An engine builds one :class:`SchedulerHooks` (``build_scheduler_hooks``) and one
:class:`WorkerHooks` per TP rank (``build_worker_hooks``), and combines the
workers' outputs with :class:`KVOutputAggregator`. See ``docs/integrating.md``.
"""

from atom_kv.engine_hooks.interface import KVCacheLayer, SchedulerHooks, WorkerHooks
from atom_kv.engine_hooks.types import (
    ConnectorMetadata,
    KVConnectorOutput,
    LoadSpec,
    SchedulerEvents,
    SendSpec,
)

__all__ = [
    "ConnectorMetadata",
    "KVCacheLayer",
    "KVConnectorOutput",
    "LoadSpec",
    "SchedulerEvents",
    "SchedulerHooks",
    "SendSpec",
    "WorkerHooks",
]
