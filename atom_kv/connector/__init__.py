"""The KV connector: scheduler side, worker side (one per TP rank) and the
aggregator that combines the ranks' finished sets."""

from atom_kv.connector.aggregator import KVOutputAggregator
from atom_kv.connector.scheduler import ConnectorScheduler
from atom_kv.connector.worker import ConnectorWorker

__all__ = ["ConnectorScheduler", "ConnectorWorker", "KVOutputAggregator"]
