"""The hook interfaces, under their older import path; they are defined in
:mod:`atom_kv.connector.base` and exported by :mod:`atom_kv.engine_hooks`,
where new code imports them from."""

from atom_kv.connector.base import KVCacheLayer, SchedulerHooks, WorkerHooks

__all__ = ["KVCacheLayer", "SchedulerHooks", "WorkerHooks"]
