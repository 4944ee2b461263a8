"""Rate-limited warnings: count every event, log the first at once and a summary per interval.

A flood of bad input (wrong-token pings, garbage on a port) must not become a
flood of log lines. :class:`RateLimitedLog` counts every event under a short
``key`` (a reason such as ``"auth"``); the first event of a key in an interval
is logged at once (the first ``burst`` of them), the rest are only counted,
and the next event after the interval (or an explicit :meth:`flush`) logs one
summary line::

    refused 2913 more registrations (auth) in the last 10.0s; last: missing or wrong mac from 10.0.0.9

Counts are exact (``counts()``); only the log lines are limited. Thread-safe,
so engine threads and an event loop can share one instance. Memory is bounded:
at most ``max_keys`` distinct keys are tracked, further keys share one
``"other"`` bucket.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

__all__ = ["RateLimitedLog"]

_OTHER = "other"


class _Bucket:
    __slots__ = ("window_start", "logged", "suppressed", "last_message", "total")

    def __init__(self) -> None:
        self.window_start: float | None = None  # when this key's current interval began
        self.logged = 0  # events logged in the current interval
        self.suppressed = 0
        self.last_message = ""
        self.total = 0


class RateLimitedLog:
    """Owns the per-key counters and decides which events become log lines.

    ``what`` names the events in summaries ("refused registrations",
    "bad handshakes"). ``clock`` is injectable for tests.
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        interval_s: float = 10.0,
        level: int = logging.WARNING,
        burst: int = 1,
        max_keys: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: must be > 0, got {interval_s!r}")
        self.logger = logger
        self.what = what
        self.interval_s = interval_s
        self.level = level
        self.burst = max(1, burst)
        self.max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}

    def _bucket(self, key: str) -> tuple[str, _Bucket]:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                key = _OTHER
                bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = _Bucket()
        return key, bucket

    def event(self, key: str, message: str) -> bool:
        """Count one event; returns True when it was logged, False when only counted."""
        now = self._clock()
        with self._lock:
            key, bucket = self._bucket(key)
            bucket.total += 1
            summary = None
            if bucket.window_start is None or now - bucket.window_start >= self.interval_s:
                summary = self._take_summary(key, bucket, now)
                bucket.window_start = now
                bucket.logged = 0
            elif bucket.logged >= self.burst:
                bucket.suppressed += 1
                bucket.last_message = message
                return False
            bucket.logged += 1
            bucket.last_message = message
        if summary is not None:
            self.logger.log(self.level, "%s", summary, stacklevel=2)
        self.logger.log(self.level, "%s", message, stacklevel=2)  # attributed to the caller
        return True

    def _take_summary(self, key: str, bucket: _Bucket, now: float) -> str | None:
        if not bucket.suppressed or bucket.window_start is None:
            return None
        text = (f"{bucket.suppressed} more {self.what} ({key}) in the last {now - bucket.window_start:.1f}s; "
                f"last: {bucket.last_message}")
        bucket.suppressed = 0
        return text

    def flush(self) -> None:
        """Log the summary of every key whose interval is over (call it periodically)."""
        now = self._clock()
        lines = []
        with self._lock:
            for key, bucket in self._buckets.items():
                if bucket.window_start is not None and now - bucket.window_start >= self.interval_s:
                    line = self._take_summary(key, bucket, now)
                    if line:
                        bucket.window_start = now
                        bucket.logged = self.burst  # a summary was just logged: the new interval starts quiet
                        lines.append(line)
        for line in lines:
            self.logger.log(self.level, "%s", line)

    def counts(self) -> dict[str, int]:
        """Every event ever counted, by key."""
        with self._lock:
            return {key: bucket.total for key, bucket in self._buckets.items()}
