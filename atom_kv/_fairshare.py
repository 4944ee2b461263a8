"""Fair shares of what strangers may make a listener keep before they prove the token.

Every pre-authentication table (pending handshake challenges, connections
waiting for their hello, rendezvous queries waiting for their prefill) is
bounded the same way, by :class:`FairShares`:

- **per source**: one peer address holds at most ``per_source`` entries. One
  more from it replaces that source's own oldest entry (the caller picks which
  of its entries: the oldest of the connection holding the most), so a source
  at its cap slows only itself, including a stranger that shares a legitimate
  peer's address: the legitimate peer's entry is the newest one there, and it
  lives one round trip.
- **in all**: at most ``capacity`` entries. Sources that have not proven the
  token (:class:`ProvenSources`) share ``capacity - reserved``; the last
  ``reserved`` entries are for sources that proved it before. When the shared
  pool is full, a newcomer takes the oldest entry of the source holding the
  most (max-min fairness), as long as that source holds at least two more than
  the newcomer; otherwise the newcomer is refused. So 64 strangers cannot fill
  the table against a peer that holds one entry.

Single-threaded (its owner's lock or thread).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from atom_kv._lru import BoundedDict

__all__ = ["Admission", "FairShares", "ProvenSources"]


class ProvenSources:
    """Owns the peer addresses that proved the token recently: at most
    ``max_sources``, each remembered ``ttl_s`` after its last proof (least
    recently proven forgotten first)."""

    def __init__(self, max_sources: int = 4096, ttl_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._seen: BoundedDict[str, float] = BoundedDict(max_sources)

    def proved(self, source: str) -> None:
        if source:
            self._seen.pop(source, None)
            self._seen[source] = self._clock() + self.ttl_s

    def __contains__(self, source: object) -> bool:
        if not isinstance(source, str):
            return False
        until = self._seen.get(source)
        if until is None:
            return False
        if until < self._clock():
            self._seen.pop(source, None)
            return False
        return True

    def __len__(self) -> int:
        return len(self._seen)


class _Pool:
    """Counts per source, and the sources by count (to find the largest holder quickly)."""

    __slots__ = ("held", "by_count", "total")

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.by_count: dict[int, dict[str, None]] = {}
        self.total = 0

    def _move(self, source: str, old: int, new: int) -> None:
        if old:
            bucket = self.by_count[old]
            del bucket[source]
            if not bucket:
                del self.by_count[old]
        if new:
            self.by_count.setdefault(new, {})[source] = None
            self.held[source] = new
        else:
            self.held.pop(source, None)

    def add(self, source: str) -> None:
        n = self.held.get(source, 0)
        self._move(source, n, n + 1)
        self.total += 1

    def remove(self, source: str) -> None:
        n = self.held.get(source, 0)
        if n:
            self._move(source, n, n - 1)
            self.total -= 1

    def largest(self) -> tuple[str, int]:
        if not self.by_count:
            return "", 0
        n = max(self.by_count)
        return next(iter(self.by_count[n])), n


class Admission:
    """What :meth:`FairShares.admit` decided: ``ok`` (room, or room once ``evict``
    is evicted); ``evict`` the source whose oldest entry must go first (the
    newcomer's own source when it is at its cap); ``reserved`` whether the
    entry counts in the proven sources' reserve; ``reason`` why it was refused
    (``"source"`` never: a source at its cap evicts its own), ``"full"``."""

    __slots__ = ("ok", "evict", "reserved", "reason")

    def __init__(self, ok: bool, evict: Optional[str] = None, reserved: bool = False, reason: str = "") -> None:
        self.ok = ok
        self.evict = evict
        self.reserved = reserved
        self.reason = reason


class FairShares:
    """Owns the counts of one pre-authentication table (see the module doc).
    The caller stores the entries; it calls :meth:`admit` before storing one,
    evicts what the answer names (calling :meth:`remove` for it), then calls
    :meth:`add`; and :meth:`remove` whenever an entry goes."""

    def __init__(self, capacity: int, per_source: int, reserved: int = 0,
                 proven: Optional[ProvenSources] = None) -> None:
        if not 0 <= reserved < capacity:
            raise ValueError(f"reserved must be in 0..{capacity - 1}, got {reserved}")
        self.capacity = capacity
        self.per_source = max(1, per_source)
        self.reserved = reserved
        self.proven = proven if proven is not None else ProvenSources()
        self._open = _Pool()    # entries of sources that had not proven the token when they were added
        self._kept = _Pool()    # entries added for proven sources (may use the reserve)

    def __len__(self) -> int:
        return self._open.total + self._kept.total

    def held(self, source: str) -> int:
        return self._open.held.get(source, 0) + self._kept.held.get(source, 0)

    def admit(self, source: str) -> Admission:
        proven = source in self.proven
        if self.held(source) >= self.per_source:
            return Admission(True, evict=source, reserved=proven)
        if proven:
            if len(self) < self.capacity:
                return Admission(True, reserved=True)
            return self._displace(source, self._open, True) or self._displace(source, self._kept, True) or \
                self._own(source, True)
        if self._open.total < self.capacity - self.reserved and len(self) < self.capacity:
            return Admission(True)
        return self._displace(source, self._open, False) or self._own(source, False)

    def _displace(self, source: str, pool: _Pool, reserved: bool) -> Optional[Admission]:
        """Room from the source holding the most in ``pool``, when it holds more than ``source``."""
        victim, n = pool.largest()
        if victim and n > self.held(source):
            return Admission(True, evict=victim, reserved=reserved)
        return None

    def _own(self, source: str, reserved: bool) -> Admission:
        """Room from ``source``'s own oldest entry (it holds as many as anyone), or a refusal when it holds none."""
        if self.held(source):
            return Admission(True, evict=source, reserved=reserved)
        return Admission(False, reason="full")

    def add(self, source: str, reserved: bool) -> None:
        (self._kept if reserved else self._open).add(source)

    def remove(self, source: str, reserved: bool) -> None:
        (self._kept if reserved else self._open).remove(source)
