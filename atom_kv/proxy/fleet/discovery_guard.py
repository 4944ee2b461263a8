"""A fixed ceiling on what strangers can make the discovery port hold: connections per source and in all.

ZeroMQ bounds each connection (``ZMQ_MAXMSGSIZE``, ``ZMQ_RCVHWM``) but not how
many there are. :class:`ConnectionGuard` follows the ROUTER's monitor events
(accepted, disconnected) and shuts down, at the TCP level, any connection past
``per_source`` from one address or past the total. A quarter of the total is
kept for sources that have registered an engine before, so strangers that
fill the rest cannot keep a known engine out.

A file descriptor from a monitor event is acted on only while it is still a
connected socket on the discovery port (the event may be older than the
connection's end).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from typing import Optional

from atom_kv._sockfd import peer_of, shutdown

logger = logging.getLogger(__name__)

__all__ = ["ConnectionGuard"]

_PRUNE_EVERY_S = 1.0  # the whole table is re-checked at most this often


class ConnectionGuard:
    """Owns the table of open discovery connections (fd -> source address) and the caps on it."""

    def __init__(self, port: int, max_connections: int, per_source: int, max_trusted: int = 4096) -> None:
        self.port = port
        self.max_connections = max_connections
        self.per_source = per_source
        self.reserved = max_connections // 4  # only for sources that registered an engine before
        self._fds: dict[int, str] = {}
        self._per_source: Counter[str] = Counter()
        self._trusted: OrderedDict[str, None] = OrderedDict()  # bounded LRU of sources with a registration
        self._max_trusted = max_trusted
        self._pruned_at = float("-inf")

    def __len__(self) -> int:
        return len(self._fds)

    def trust(self, host: str) -> None:
        """``host`` registered an engine: it may use the reserved share."""
        self._trusted[host] = None
        self._trusted.move_to_end(host)
        if len(self._trusted) > self._max_trusted:
            self._trusted.popitem(last=False)

    def accepted(self, fd: int) -> Optional[str]:
        """A new connection on ``fd``: None if it may stay, else why it was shut down."""
        host = self._peer(fd)
        if host is None:
            return None  # already gone
        self.disconnected(fd)  # a missed disconnect of an earlier connection on the same fd
        problem = self._over(host)
        if problem is not None:  # drop entries whose connection ended without an event, then look again
            if self._per_source[host] >= self.per_source:
                self._prune(host)  # at most per_source entries
            elif time.monotonic() - self._pruned_at >= _PRUNE_EVERY_S:  # a flood must not make each refusal cost
                self._pruned_at = time.monotonic()                     # a walk over the whole table
                self._prune()
            problem = self._over(host)
        if problem is not None:
            self._shutdown(fd)
            return problem
        self._fds[fd] = host
        self._per_source[host] += 1
        return None

    def disconnected(self, fd: int) -> None:
        host = self._fds.pop(fd, None)
        if host is not None:
            self._per_source[host] -= 1
            if self._per_source[host] <= 0:
                del self._per_source[host]

    def _over(self, host: str) -> Optional[str]:
        if self._per_source[host] >= self.per_source:
            return (f"{self._per_source[host]} connections from {host} already open "
                    f"(--discovery-max-connections-per-source {self.per_source})")
        limit = self.max_connections if host in self._trusted else self.max_connections - self.reserved
        if len(self._fds) >= limit:
            return (f"{len(self._fds)} discovery connections open (--discovery-max-connections "
                    f"{self.max_connections}, {self.reserved} of them kept for sources that registered before)")
        return None

    def _prune(self, only: Optional[str] = None) -> None:
        for fd, host in list(self._fds.items()):
            if (only is None or host == only) and self._peer(fd) != host:
                self.disconnected(fd)

    def _peer(self, fd: int) -> Optional[str]:
        """The source address of ``fd`` if it is a connected socket on the discovery port, else None."""
        return peer_of(fd, self.port)

    def _shutdown(self, fd: int) -> None:
        shutdown(fd, self.port)  # ZeroMQ sees the end and closes its side
