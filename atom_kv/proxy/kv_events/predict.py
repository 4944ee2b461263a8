"""Predict-on-route: the proxy's own recent routing decisions, as if their blocks were already stored.

A burst of sibling requests arrives faster than the first one's ``BlockStored`` comes back; recording each
decision (:meth:`PredictedBlocks.record`) for ``ttl_s`` lets the next sibling find the prefix where the first
went. Bounded: at most ``max_blocks`` (block, worker) predictions; past it the oldest records go early.
Loop-only (the routing policies record and query on the event loop): no locks.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Generic, Hashable, Sequence, TypeVar

__all__ = ["PredictedBlocks"]

W = TypeVar("W", bound=Hashable)  # what a worker is keyed by


class _Record(Generic[W]):
    __slots__ = ("expires", "worker", "keys")

    def __init__(self, expires: float, worker: W, keys: Sequence[int]) -> None:
        self.expires = expires
        self.worker = worker
        self.keys = keys


class PredictedBlocks(Generic[W]):
    """Owns the unexpired predictions: chain key -> {worker: expiry}, and the records in arrival order."""

    def __init__(self, ttl_s: float, max_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s!r}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks: must be >= 1, got {max_blocks!r}")
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._clock = clock
        self._by_key: dict[int, dict[W, float]] = {}
        self._records: deque[_Record[W]] = deque()
        self._size = 0  # keys over all records

    def __len__(self) -> int:
        return self._size

    def record(self, worker: W, keys: Sequence[int]) -> None:
        """``worker`` was sent a prompt whose full blocks have ``keys``."""
        if not keys:
            return
        now = self._clock()
        self._expire(now)
        keys = keys[:self.max_blocks]
        while self._records and self._size + len(keys) > self.max_blocks:
            self._drop(self._records.popleft())
        expires = now + self.ttl_s
        by_key = self._by_key
        for key in keys:
            holders = by_key.get(key)
            if holders is None:
                by_key[key] = {worker: expires}
            else:
                holders[worker] = expires
        self._records.append(_Record(expires, worker, keys))
        self._size += len(keys)

    def match(self, keys: Sequence[int]) -> dict[W, int]:
        """Each worker predicted to hold a prefix of ``keys``: how many leading blocks."""
        now = self._clock()
        self._expire(now)
        found: dict[W, int] = {}
        alive: set[W] | None = None
        by_key = self._by_key
        for i, key in enumerate(keys):
            holders = by_key.get(key)
            here = {w for w, exp in holders.items() if exp > now} if holders else set()
            alive = here if alive is None else alive & here
            if not alive:
                break
            for w in alive:
                found[w] = i + 1
        return found

    def forget(self, match: Callable[[W], bool]) -> None:
        """Drop every prediction of the workers ``match`` accepts (an instance left or restarted)."""
        kept: deque[_Record[W]] = deque()
        for rec in self._records:
            if match(rec.worker):
                self._drop(rec)
            else:
                kept.append(rec)
        self._records = kept

    def _expire(self, now: float) -> None:
        records = self._records
        while records and records[0].expires <= now:
            self._drop(records.popleft())

    def _drop(self, rec: _Record) -> None:
        """Remove ``rec``'s keys, except those a newer record of the same worker renewed (a later expiry)."""
        self._size -= len(rec.keys)
        by_key = self._by_key
        for key in rec.keys:
            holders = by_key.get(key)
            if holders is not None and holders.get(rec.worker) == rec.expires:
                del holders[rec.worker]
                if not holders:
                    del by_key[key]
