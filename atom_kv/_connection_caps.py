"""What a ZeroMQ listener keeps of connections whose peers have proven nothing yet: one policy, for the
handshake port (:mod:`atom_kv.connector.handshake_limits`) and the discovery port
(:mod:`atom_kv.proxy.fleet.discovery_guard`).

ZeroMQ bounds each connection (``ZMQ_MAXMSGSIZE``, ``ZMQ_RCVHWM``) but not how many there are.
:class:`ConnectionCaps` follows the socket's monitor events (accepted, disconnected, each naming the
connection's file descriptor) and shuts a connection down at the TCP level (:mod:`atom_kv._sockfd`;
ZeroMQ then closes its side) when it is past a cap:

- **per source**: at most ``per_source`` connections from one peer address that have not proven the
  token (:meth:`ConnectionCaps.proven`);
- **in all**: at most ``max_connections``, proven ones included; the last ``reserved`` of them only
  for addresses trusted before (:meth:`ConnectionCaps.trust`).

The ports differ in one thing, what goes when a newcomer is past a cap (``displace``), because they
know different things about their peers:

- The handshake port learns which *connection* proved the token (a message's source descriptor,
  ``ZMQ_SRCFD``). A connection that has not is a stranger's, or a peer's that has not spoken yet and
  proves itself within one round trip, so the newcomer stays (``displace=True``): past ``per_source``
  the source's own oldest unproven connection goes, and past ``max_connections`` the oldest unproven
  one of the source holding the most, when it holds more than the newcomer's source (max-min
  fairness, as :class:`~atom_kv._fairshare.FairShares` for every other table). It needs no reserve:
  a stranger can push out only connections that proved nothing, never a peer's.
- The discovery port learns only which *address* registered an engine (a ping's sender), never which
  of its connections it came on; an engine keeps its one connection open, so the oldest connections
  are the registered engines'. Pushing them out would let a flood cut engines off, so a newcomer past
  a cap is refused (``displace=False``), and a quarter of ``max_connections`` is reserved for
  addresses that registered before, which strangers filling the rest cannot take.

A descriptor from a monitor event is acted on only while it is still a connected socket on the
listening port (the event may be older than the connection's end). Before a newcomer is refused,
entries whose connection ended without an event are dropped and the caps looked at again (the
whole table at most once a second, so a flood does not make each refusal a walk over it).

Single-threaded (the socket's serving thread or event loop); :meth:`ConnectionCaps.sources` and
``len()`` may be read from any thread.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Callable, Optional

from atom_kv._fairshare import ProvenSources
from atom_kv._sockfd import peer_of, shutdown

__all__ = ["CapNames", "ConnectionCaps"]

_PRUNE_EVERY_S = 1.0  # the whole table is re-checked at most this often


@dataclass(frozen=True)
class CapNames:
    """The words a port's refusals use: what its connections are, the settings that set the caps, and who the
    reserve is for."""

    what: str  # "discovery connections"
    total_key: str  # the setting of max_connections: a flag ("--discovery-max-connections") or a config key
    per_source_key: str
    trusted: str = "addresses trusted before"

    @staticmethod
    def setting(key: str, value: int) -> str:
        return f"{key} {value}" if key.startswith("--") else f"{key}={value}"


class _State(enum.Enum):
    UNPROVEN = "unproven"
    PROVEN = "proven"
    CLOSING = "closing"  # shut down by us, until the monitor reports it disconnected


class _Conn:
    __slots__ = ("source", "state")

    def __init__(self, source: str) -> None:
        self.source = source
        self.state = _State.UNPROVEN


class ConnectionCaps:
    """Owns the table of one listener's connections (descriptor -> source and state) and the caps on it
    (see the module doc). ``on_refuse(reason, why)`` is told of every connection shut down
    (``connections_source``: past the per-source cap; ``connections_full``: past the total);
    :meth:`accepted` also returns why a newcomer was refused. ``port``: the listening port, once bound."""

    def __init__(self, port: Optional[int], *, max_connections: int, per_source: int, reserved: int = 0,
                 displace: bool, names: CapNames, on_refuse: Optional[Callable[[str, str], None]] = None,
                 trusted: Optional[ProvenSources] = None) -> None:
        if not 0 <= reserved < max_connections:
            raise ValueError(f"reserved must be in 0..{max_connections - 1}, got {reserved}")
        self.port = port
        self.max_connections = max_connections
        self.per_source = max(1, per_source)
        self.reserved = reserved
        self.displace = displace
        self.names = names
        self._on_refuse = on_refuse
        self._trusted = trusted if trusted is not None else ProvenSources()
        self._conns: dict[int, _Conn] = {}  # fd -> connection
        self._unproven: dict[str, dict[int, None]] = {}  # source -> its unproven connections' fds, oldest first
        self._closing = 0  # connections in state CLOSING
        self._pruned_at = float("-inf")

    def __len__(self) -> int:
        return len(self._conns) - self._closing

    def sources(self) -> dict[str, int]:
        """Open connections by peer address (tests, metrics; from any thread)."""
        out: dict[str, int] = {}
        for conn in list(self._conns.values()):  # one copy, atomic for a dict
            if conn.state is not _State.CLOSING:
                out[conn.source] = out.get(conn.source, 0) + 1
        return out

    def trust(self, source: str) -> None:
        """``source`` proved itself (registered an engine): it may use the reserve."""
        self._trusted.proved(source)

    def proven(self, fd: Optional[int]) -> None:
        """The connection on ``fd`` delivered a message that proved the token: no cap pushes it out."""
        if fd is None:
            return
        conn = self._conns.get(fd)
        if conn is None or conn.state is not _State.UNPROVEN:
            return
        conn.state = _State.PROVEN
        self._forget_unproven(conn.source, fd)

    # ------------------------------------------------------------------ monitor events
    def accepted(self, fd: int) -> Optional[str]:
        """A new connection on ``fd``: None if it may stay (or is no connection on the port any more),
        else why it was shut down."""
        source = peer_of(fd, self.port)
        if source is None:
            return None  # already gone, or not ours
        self.disconnected(fd)  # a reused descriptor whose disconnect we missed
        why = self._make_room(source)
        if why is not None:
            reason, text = why
            shutdown(fd, self.port)
            if self._on_refuse is not None:
                self._on_refuse(reason, text)
            return text
        self._conns[fd] = _Conn(source)
        self._unproven.setdefault(source, {})[fd] = None
        return None

    def disconnected(self, fd: int) -> None:
        conn = self._conns.pop(fd, None)
        if conn is None:
            return
        if conn.state is _State.CLOSING:
            self._closing -= 1
        elif conn.state is _State.UNPROVEN:
            self._forget_unproven(conn.source, fd)

    # ------------------------------------------------------------------ the policy
    def _make_room(self, source: str) -> Optional[tuple[str, str]]:
        """Make room for a newcomer from ``source`` (pushing older connections out when ``displace``), or say
        why it is refused: (reason, text)."""
        names = self.names
        mine = self._unproven.get(source, {})
        if len(mine) >= self.per_source:
            if self.displace:
                self._shut(next(iter(mine)), "connections_source",
                           f"closed the oldest of {len(mine)} connections from {source} that have not proven the "
                           f"token (a newer one came; {names.setting(names.per_source_key, self.per_source)})")
            else:
                self._prune(source)
                mine = self._unproven.get(source, {})
                if len(mine) >= self.per_source:
                    return "connections_source", (
                        f"{len(mine)} connections from {source} already open "
                        f"({names.setting(names.per_source_key, self.per_source)})")
        limit = self.max_connections if source in self._trusted else self.max_connections - self.reserved
        if len(self) < limit:
            return None
        if self.displace:
            victim, theirs = max(self._unproven.items(), key=lambda kv: len(kv[1]), default=("", {}))
            if len(theirs) > len(self._unproven.get(source, {})):
                self._shut(next(iter(theirs)), "connections_full",
                           f"closed the oldest unproven connection from {victim} (it holds the most of "
                           f"{self.max_connections} connections)")
                return None
        if time.monotonic() - self._pruned_at >= _PRUNE_EVERY_S:
            self._pruned_at = time.monotonic()
            self._prune()
            if len(self) < limit:
                return None
        kept = f", {self.reserved} of them kept for {names.trusted}" if self.reserved else ""
        return "connections_full", (f"refused a connection from {source}: {len(self)} {names.what} open "
                                    f"({names.setting(names.total_key, self.max_connections)}{kept})")

    def _shut(self, fd: int, reason: str, why: str) -> None:
        """Shut the connection on ``fd`` down (ZeroMQ then closes it and reports it disconnected)."""
        conn = self._conns.get(fd)
        if conn is not None and conn.state is not _State.CLOSING:
            if conn.state is _State.UNPROVEN:
                self._forget_unproven(conn.source, fd)
            conn.state = _State.CLOSING
            self._closing += 1
        shutdown(fd, self.port)
        if self._on_refuse is not None:
            self._on_refuse(reason, why)

    def _prune(self, only: Optional[str] = None) -> None:
        """Drop the entries (of ``only``, else all) whose connection ended without an event."""
        for fd, conn in list(self._conns.items()):
            if (only is None or conn.source == only) and peer_of(fd, self.port) != conn.source:
                self.disconnected(fd)

    def _forget_unproven(self, source: str, fd: int) -> None:
        mine = self._unproven.get(source)
        if mine is not None:
            mine.pop(fd, None)
            if not mine:
                del self._unproven[source]
