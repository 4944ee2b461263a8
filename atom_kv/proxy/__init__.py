"""The P/D proxy: service discovery, static engines, prefill/decode pairing and the HTTP relay.

Build an app with :func:`create_app` (one per :class:`ProxySettings`; several
can live in one process) or run ``python -m atom_kv.proxy``.
"""

from atom_kv.proxy.app import create_app
from atom_kv.proxy.fleet.static import StaticEngine, parse_engine_spec
from atom_kv.proxy.settings import POLICIES, ProxySettings

__all__ = ["create_app", "ProxySettings", "POLICIES", "StaticEngine", "parse_engine_spec"]
