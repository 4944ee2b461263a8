"""Which transfer backend a consumer rank reads each producer peer with, and
why some peers are not read the best way, for an engine's ``/metrics`` and
``/health``.

A :class:`RouteView` keeps one entry per producer rank this rank completed a
handshake with: the peer's engine id, DP rank and TP rank, the memory kinds
of its KV cache, and the backend chosen for it (``auto``'s inner backend, or
the configured one). At most :data:`MAX_ROUTES_SHOWN` entries are kept (the
most recent handshakes); the rest are counted as ``hidden``, so a decode
engine talking to many prefill engines never grows its label sets without
bound. Fallbacks are the backend's own counts by (backend, reason), read when
a :class:`RouteReport` is taken.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from atom_kv._lru import BoundedDict, BoundedSet

__all__ = ["MAX_ROUTES_SHOWN", "PeerRoute", "RouteReport", "RouteView", "backend_for_peer"]

#: routes one rank reports; older handshakes beyond this are counted, not shown
MAX_ROUTES_SHOWN = 16
#: peers counted as hidden at most (the count saturates there)
MAX_HIDDEN_COUNTED = 4096


@dataclass(frozen=True)
class PeerRoute:
    """One producer rank and the backend this rank reads it with."""

    peer: str  # the producer engine's id
    peer_dp_rank: int
    peer_rank: int  # pp_rank * tp_size + tp_rank of the producer
    memory: str  # the producer's KV memory kinds: "host", "gpu:0", joined by "+"
    backend: str  # "cma", "gpu_ipc", "nixl", "tcp", "moriio", ...


@dataclass(frozen=True)
class RouteReport:
    """A rank's routes (newest last), how many more it has than it shows, and
    its backend's fallbacks as (backend, reason, count)."""

    routes: tuple[PeerRoute, ...] = ()
    hidden: int = 0
    fallbacks: tuple[tuple[str, str, int], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The JSON form ``/health`` shows."""
        return {
            "routes": [{"peer": r.peer, "peer_dp_rank": r.peer_dp_rank, "peer_rank": r.peer_rank,
                        "memory": r.memory, "backend": r.backend} for r in self.routes],
            "hidden": self.hidden,
            "fallbacks": [{"backend": b, "reason": why, "count": n} for b, why, n in self.fallbacks],
        }


def backend_for_peer(backend: Any, peer_id: str) -> str:
    """The backend that serves ``peer_id``: ``auto``'s choice, else ``backend`` itself."""
    chooser = getattr(backend, "backend_for", None)
    if chooser is not None:
        try:
            return str(chooser(peer_id))
        except KeyError:  # removed meanwhile
            pass
    return str(getattr(backend, "name", "unknown"))


class RouteView:
    """Owns one rank's bounded table of peer routes (thread-safe)."""

    def __init__(self, capacity: int = MAX_ROUTES_SHOWN) -> None:
        self._lock = threading.Lock()
        self._routes: BoundedDict[Hashable, PeerRoute] = BoundedDict(capacity, on_evict=self._evicted)
        self._hidden: BoundedSet[Hashable] = BoundedSet(MAX_HIDDEN_COUNTED)

    def _evicted(self, key: Hashable, route: PeerRoute) -> None:
        self._hidden.add(key)

    def record(self, key: Hashable, *, peer: str, peer_dp_rank: int, peer_rank: int, memory: Sequence[str],
               backend: str) -> None:
        """Peer ``key`` (one producer rank) is read with ``backend`` from now on."""
        route = PeerRoute(peer, peer_dp_rank, peer_rank, "+".join(memory) or "host", backend)
        with self._lock:
            self._hidden.discard(key)
            self._routes[key] = route

    def forget(self, key: Hashable) -> None:
        """Peer ``key`` was dropped (its next use handshakes again)."""
        with self._lock:
            self._routes.pop(key, None)
            self._hidden.discard(key)

    def report(self, backend: Any = None) -> RouteReport:
        """The routes now, and ``backend``'s fallbacks (when it counts them)."""
        counts = getattr(backend, "route_fallbacks", None)
        fallbacks = tuple(sorted((b, why, int(n)) for (b, why), n in counts().items())) if counts else ()
        with self._lock:
            return RouteReport(tuple(route for _, route in self._routes.items()), len(self._hidden), fallbacks)
