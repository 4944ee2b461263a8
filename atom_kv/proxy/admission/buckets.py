"""``--rate-limit RPS[,BURST]``: one token bucket per client, in a table of bounded size.

A client is its bearer token (``Authorization: Bearer ...``), else its address. The token itself is
never kept nor logged: its SHA-256 digest (cut to 16 bytes) is the key. A bucket holds up to ``burst``
tokens and gains ``rps`` a second; a request takes one, or is refused with the seconds until one is
there (the ``Retry-After`` of its 429).

The table holds at most ``max_clients`` buckets, least recently used first out: a client pushed out
comes back with a full bucket, which is what it would have after ``burst / rps`` idle seconds anyway.
Its memory is bounded whatever number of tokens or addresses a client cycles through.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Callable

from atom_kv._lru import BoundedDict

__all__ = ["ClientBuckets", "client_key", "parse_rate_limit"]


def parse_rate_limit(text: str) -> tuple[float, int]:
    """``RPS[,BURST]`` (BURST defaults to ``max(1, ceil(RPS))``); ValueError in our words otherwise."""
    rps_text, _, burst_text = text.partition(",")
    usage = (f"expected RPS[,BURST] (requests a second per client, then the burst it may send at once), "
             f"e.g. 10,20; got {text!r}")
    try:
        rps = float(rps_text)
        burst = int(burst_text) if burst_text.strip() else None
    except ValueError:
        raise ValueError(usage) from None
    if not (math.isfinite(rps) and rps > 0):
        raise ValueError(f"RPS must be a finite number > 0, got {rps_text!r}")
    if burst is None:
        burst = max(1, math.ceil(rps))
    if burst < 1:
        raise ValueError(f"BURST must be >= 1, got {burst_text!r}")
    return rps, burst


def client_key(authorization: str | None, address: str | None) -> str:
    """Who a request is for the buckets: a digest of its bearer token, else its address."""
    if authorization:
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() == "bearer" and token:
            return "token:" + hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return "addr:" + (address or "unknown")


class ClientBuckets:
    """Owns the per-client token buckets (``[tokens, last refill]`` each, LRU-bounded); loop-only."""

    def __init__(self, rps: float, burst: int, *, max_clients: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rps = rps
        self.burst = burst
        self._clock = clock
        self._buckets: BoundedDict[str, list[float]] = BoundedDict(max_clients)

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str) -> float:
        """Take one token for ``key``: 0.0 when it had one, else the seconds until it will."""
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            self._buckets[key] = [self.burst - 1.0, now]
            return 0.0
        self._buckets.touch(key)
        tokens = min(float(self.burst), bucket[0] + (now - bucket[1]) * self.rps)
        bucket[1] = now
        if tokens >= 1.0:
            bucket[0] = tokens - 1.0
            return 0.0
        bucket[0] = tokens
        return (1.0 - tokens) / self.rps
