"""FAKE ``atom.kv_transfer.disaggregation``: ATOM's connector contract."""

from atom.kv_transfer.disaggregation.aggregator import KVOutputAggregator
from atom.kv_transfer.disaggregation.base import KVConnectorBase, KVConnectorSchedulerBase
from atom.kv_transfer.disaggregation.factory import KVConnectorFactory
from atom.kv_transfer.disaggregation.types import ConnectorMetadata, KVConnectorOutput

__all__ = ["ConnectorMetadata", "KVConnectorBase", "KVConnectorFactory", "KVConnectorOutput",
           "KVConnectorSchedulerBase", "KVOutputAggregator"]
