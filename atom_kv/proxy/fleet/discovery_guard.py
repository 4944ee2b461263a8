"""A fixed ceiling on what strangers can make the discovery port hold: connections per source and in all.

The policy is the handshake port's too (:mod:`atom_kv._connection_caps`, which says why the two ports
differ where they do). On this port a newcomer past a cap is refused, never an older connection pushed
out (the port learns which *address* registered an engine, not which of its connections did, and an
engine keeps its one connection open); a quarter of the total is kept for sources that registered an
engine before, so strangers that fill the rest cannot keep a known engine out.
"""

from __future__ import annotations

from atom_kv._connection_caps import CapNames, ConnectionCaps
from atom_kv._fairshare import ProvenSources

__all__ = ["ConnectionGuard"]

_NAMES = CapNames(what="discovery connections", total_key="--discovery-max-connections",
                  per_source_key="--discovery-max-connections-per-source", trusted="sources that registered before")


class ConnectionGuard(ConnectionCaps):
    """The discovery port's :class:`~atom_kv._connection_caps.ConnectionCaps`: owns the table of its open
    connections (descriptor -> source address) and the caps on it; :meth:`trust` an address once it
    registered an engine (at most ``max_trusted`` remembered, least recently registered forgotten first)."""

    def __init__(self, port: int, max_connections: int, per_source: int, max_trusted: int = 4096) -> None:
        # an engine's address stays trusted until max_trusted newer ones push it out (no time limit)
        trusted = ProvenSources(max_sources=max_trusted, ttl_s=float("inf"))
        super().__init__(port, max_connections=max_connections, per_source=per_source,
                         reserved=max_connections // 4, displace=False, names=_NAMES, trusted=trusted)
