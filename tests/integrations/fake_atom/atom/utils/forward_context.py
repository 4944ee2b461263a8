"""FAKE ``atom.utils.forward_context``: the scheduler-side connector comes from the factory."""

from __future__ import annotations

from typing import Any


def get_kvconnector(role: str = "worker", config: Any = None, **kwargs: Any) -> Any:
    if not getattr(config, "kv_transfer_config", None):
        return None
    from atom.kv_transfer.disaggregation import KVConnectorFactory

    return KVConnectorFactory.create_connector(config, role=role, **kwargs)
