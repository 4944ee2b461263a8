"""One worker's engine hash -> chain key map, compact: the newest entries in a dict, the rest in sorted arrays.

A dict entry costs a Python int (32 bytes) and 60 to 120 bytes of table; the arrays cost 24 bytes an entry
(hash, chain key, insertion number). Entries move from the dict to the arrays once the dict holds a
sixteenth of them (at least :data:`MERGE_MIN`), in one merge whose cost is spread over the inserts since
the last. Eviction goes oldest first (by insertion number). A removed array entry is marked by chain key 0
(chain keys are never 0) until the next merge compacts it away.

Not thread-safe: one writer (the index's); nothing here is read from another thread.
"""

from __future__ import annotations

from itertools import islice
from typing import Optional, Sequence

import numpy as np

__all__ = ["MERGE_MIN", "EngineHashes"]

#: the dict is merged into the arrays when it holds this many entries, or a sixteenth of the arrays'
MERGE_MIN = 1024
_DTYPE = np.int64  # hashes and chain keys are 60-bit: they fit, and compare with Python ints exactly


class EngineHashes:
    """Owns one worker's entries: ``put_many`` appends the newest, ``get``/``pop_many`` look up by engine hash,
    ``evict_oldest`` drops the oldest. Each call returns the chain keys it dropped, so the caller can update
    whatever is keyed on them."""

    __slots__ = ("_recent", "_h", "_k", "_s", "_seq", "_alive")

    def __init__(self) -> None:
        self._recent: dict[int, int] = {}
        self._h = np.empty(0, _DTYPE)  # sorted engine hashes
        self._k = np.empty(0, _DTYPE)  # their chain keys (0: removed)
        self._s = np.empty(0, _DTYPE)  # their insertion numbers
        self._seq = 0
        self._alive = 0  # array entries not removed

    def __len__(self) -> int:
        """Entries held (an entry stored again before its merge counts twice until then)."""
        return len(self._recent) + self._alive

    def get(self, engine_hash: int) -> Optional[int]:
        found = self._recent.get(engine_hash)
        if found is not None or not self._alive:
            return found
        h = self._h
        i = int(h.searchsorted(engine_hash))
        if i < len(h) and int(h[i]) == engine_hash:
            return int(self._k[i]) or None
        return None

    def put_many(self, hashes: Sequence[int], chain_keys: Sequence[int]) -> list[int]:
        """Store each ``hashes[i] -> chain_keys[i]`` as the newest entry; the other chain keys those hashes
        had in the dict before (an engine hash stored again with other content), usually none."""
        recent = self._recent
        pop = recent.pop
        replaced = []
        for engine_hash, chain_key in zip(hashes, chain_keys):
            old = pop(engine_hash, None)
            recent[engine_hash] = chain_key
            if old is not None and old != chain_key:
                replaced.append(old)
        if len(recent) >= MERGE_MIN and len(recent) * 16 >= self._alive:
            self._merge()
        return replaced

    def pop_many(self, hashes: Sequence[int]) -> list[int]:
        """Remove ``hashes``; the chain keys of those that were here."""
        pop = self._recent.pop
        out = [k for k in (pop(h, None) for h in hashes) if k is not None]
        if self._alive and hashes:  # the arrays too: an entry stored again has an older copy there
            idx = self._find(np.fromiter(hashes, _DTYPE, len(hashes)))
            if len(idx):
                out.extend(self._k[idx].tolist())
                self._kill(idx)
        return out

    def evict_oldest(self, count: int) -> list[int]:
        """Drop the ``count`` oldest entries; their chain keys. An array entry stored again since (its hash
        is in the dict too) is an old copy: it goes, counted in ``count``, without reporting its key."""
        out: list[int] = []
        if count <= 0:
            return out
        if self._alive:
            live = np.flatnonzero(self._k != 0)
            if len(live) > count:
                live = live[np.argpartition(self._s[live], count - 1)[:count]]
            recent = self._recent
            keys = self._k[live].tolist()
            out.extend(k for h, k in zip(self._h[live].tolist(), keys) if h not in recent)
            self._kill(live)
            count -= len(live)
        if count > 0:
            recent = self._recent
            for engine_hash in list(islice(recent, count)):
                out.append(recent.pop(engine_hash))
        return out

    # ------------------------------------------------------------------ internals
    def _find(self, hashes: np.ndarray) -> np.ndarray:
        """Array positions of the live entries among ``hashes`` (each once)."""
        h = self._h
        if not len(h):
            return np.empty(0, np.intp)
        pos = np.minimum(np.searchsorted(h, hashes), len(h) - 1)
        hit = (h[pos] == hashes) & (self._k[pos] != 0)
        return np.unique(pos[hit])

    def _kill(self, idx: np.ndarray) -> None:
        self._k[idx] = 0
        self._alive -= len(idx)
        if self._alive * 2 < len(self._k) and len(self._k) > MERGE_MIN:  # mostly dead: compact now
            self._compact()

    def _compact(self) -> None:
        live = self._k != 0
        self._h, self._k, self._s = self._h[live], self._k[live], self._s[live]
        self._alive = len(self._h)

    def _merge(self) -> None:
        recent, self._recent = self._recent, {}
        m = len(recent)
        rh = np.fromiter(recent.keys(), _DTYPE, m)
        rk = np.fromiter(recent.values(), _DTYPE, m)
        rs = np.arange(self._seq, self._seq + m, dtype=_DTYPE)
        self._seq += m
        if self._alive:
            dup = self._find(rh)  # entries stored again: the dict's copy is the newer one
            if len(dup):
                self._k[dup] = 0
        self._compact()
        order = np.argsort(rh, kind="stable")
        rh, rk, rs = rh[order], rk[order], rs[order]
        at = np.searchsorted(self._h, rh)
        self._h = np.insert(self._h, at, rh)
        self._k = np.insert(self._k, at, rk)
        self._s = np.insert(self._s, at, rs)
        self._alive = len(self._h)
