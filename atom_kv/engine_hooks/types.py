"""The values that cross the engine/connector seam, under their older import
path; they are defined in :mod:`atom_kv.connector.types` and exported by
:mod:`atom_kv.engine_hooks`, where new code imports them from."""

from atom_kv.connector.types import ConnectorMetadata, KVConnectorOutput, LoadSpec, SchedulerEvents, SendSpec

__all__ = ["ConnectorMetadata", "KVConnectorOutput", "LoadSpec", "SchedulerEvents", "SendSpec"]
