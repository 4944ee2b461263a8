"""atom-kv as a vLLM v1 KV connector (``KVConnectorBase_V1``), loaded by name::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "AtomKVConnector",
        "kv_connector_module_path": "atom_kv.integrations.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"handshake_port": 6301}}'

``kv_role`` is vLLM's (``kv_producer`` for prefill, ``kv_consumer`` for decode;
``kv_both`` is refused). ``kv_connector_extra_config`` holds atom-kv's own
``--kv-transfer-config`` keys (see docs/configuration.md), validated with the
same one-line errors, plus ``host_ip``: the address other engines dial to read
this engine's KV (default: vLLM's ``VLLM_HOST_IP`` / detected address).

vLLM builds one connector in its scheduler process and one in each worker
process (one per TP rank). The scheduler side wraps atom-kv's
:class:`~atom_kv.engine_hooks.SchedulerHooks`, each worker side one
:class:`~atom_kv.engine_hooks.WorkerHooks`. vLLM request ids are used towards
vLLM; the prefill's ``transfer_id`` is what crosses the wire. How the two
contracts meet is in docs/vllm.md ("How it maps onto vLLM").

- :mod:`.connector`: :class:`AtomKVConnector`, what vLLM loads.
- :mod:`.scheduler`: its scheduler side; :mod:`.worker`: one TP rank's side.
- :mod:`.metadata`: what vLLM carries between those processes for us.
- :mod:`.settings`: our config from vLLM's; :mod:`.layout`: vLLM's KV cache as we register it.
- :mod:`.ledger`: the per-request reporting promises (no vLLM import).

This package is the only part of atom-kv that imports vLLM, and only its
modules other than ``ledger`` do: the names below load on first use, so
``atom_kv.integrations.vllm.ledger`` imports without vLLM.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "AtomKVConnector",
    "AtomKVConnectorMetadata",
    "AtomKVConnectorStats",
    "AtomKVWorkerMetadata",
    "UnsupportedKVCache",
]

_HOME = {
    "AtomKVConnector": "connector",
    "AtomKVConnectorMetadata": "metadata",
    "AtomKVConnectorStats": "metadata",
    "AtomKVWorkerMetadata": "metadata",
    "UnsupportedKVCache": "layout",
    "attention_spec": "layout",
    "hooks_layers": "layout",
    "kv_layout": "layout",
    "kv_shape": "layout",
    "parse_settings": "settings",
}


def __getattr__(name: str) -> Any:
    """``kv_connector_module_path`` names this package: vLLM's ``getattr(module, "AtomKVConnector")`` lands here."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
