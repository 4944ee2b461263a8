"""The P/D proxy: service discovery, static engines, prefill/decode pairing and the HTTP relay.

One sub-package per concern: ``http/`` (HTTP/1.1 server and upstream client, no P/D), ``fleet/`` (the
engines it knows and their health), ``routing/`` (which instance and DP rank serves a leg), ``relay/``
(one request through a P/D pair), ``kv_events/`` (what the engines cache, from their KV cache events) and
``observability/`` (metrics, spans, traces); the app, its settings, its serving and the command line stay here.

Build an app with :func:`create_app` (one per :class:`ProxySettings`; several
can live in one process) or run ``python -m atom_kv.proxy``.
"""

from atom_kv.proxy.app import create_app
from atom_kv.proxy.fleet.static import StaticEngine, parse_engine_spec
from atom_kv.proxy.settings import POLICIES, ProxySettings

__all__ = ["create_app", "ProxySettings", "POLICIES", "StaticEngine", "parse_engine_spec"]
