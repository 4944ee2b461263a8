"""KV event publisher addresses: ``tcp://HOST:PORT``, checked, and the per-DP-rank rule (port + rank).

vLLM's publisher of DP rank N listens on the endpoint's port + N, its replay endpoint too; ATOM's one
publisher has no offset, and its batches name their rank (the proxy connects to every rank's port
either way: a port nobody binds costs one idle connect). Only ``tcp://`` is accepted: an announced
``ipc://`` path would have the proxy open local sockets an engine chose.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from atom_kv._netaddr import is_unspecified
from atom_kv.config import is_port

__all__ = ["events_endpoint", "rank_endpoint"]


def events_endpoint(text: str, what: str, *, host_for_any: str | None = None) -> str:
    """``text`` as a ``tcp://HOST:PORT`` to connect to, else ValueError naming ``what``. A publisher's bind
    address (``tcp://*:PORT``, ``0.0.0.0``, ``::``) becomes ``host_for_any`` where one is given (the engine's
    own host, for an announced endpoint), and is refused otherwise."""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{what}: not a tcp://HOST:PORT address ({exc}): {text!r}") from None
    netloc_host = parts.netloc.rpartition(":")[0]
    if parts.scheme != "tcp" or port is None or not netloc_host or parts.path not in ("", "/"):
        raise ValueError(f"{what}: expected tcp://HOST:PORT (e.g. tcp://10.0.0.5:5557), got {text!r}")
    if not is_port(port, allow_zero=False):
        raise ValueError(f"{what}: port must be 1..65535, got {port}")
    host = parts.hostname if netloc_host != "*" else "*"
    if host is None or is_unspecified(host):
        if host_for_any is None:
            raise ValueError(f"{what}: {text!r} is a bind address; name the host the proxy connects to, "
                             "e.g. tcp://10.0.0.5:5557")
        host = host_for_any
    return f"tcp://{_bracket(host)}:{port}"


def rank_endpoint(endpoint: str, dp_rank: int) -> str:
    """``endpoint`` (a checked ``tcp://HOST:PORT``) of DP rank ``dp_rank``: its port + the rank (vLLM's rule)."""
    host, _, port = endpoint.rpartition(":")
    shifted = int(port) + dp_rank
    if not is_port(shifted, allow_zero=False):
        raise ValueError(f"{endpoint}: DP rank {dp_rank} would publish on port {shifted}, past 65535")
    return f"{host}:{shifted}"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
