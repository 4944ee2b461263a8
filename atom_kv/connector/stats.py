"""Cumulative transfer statistics of one worker, for metrics and logs."""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["TransferStats"]

logger = logging.getLogger(__name__)

_KEYS = (
    "transfers", "bytes", "seconds", "ranges", "retries", "failures",
    "bad_messages", "handshakes", "handshake_seconds", "handshake_failures",
    "peers_dropped", "peers_evicted", "done_sent", "done_received", "releases_received", "plan_cpu_seconds",
    "confirmations_skipped",
)


class TransferStats:
    """Owns one worker's counters; thread-safe; logs a summary at most every ``log_every_s``."""

    def __init__(self, name: str, log_every_s: float = 60.0) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(_KEYS, 0.0)
        self._log_every_s = log_every_s
        self._last_log = time.monotonic()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for key, delta in deltas.items():
                self._values[key] = self._values.get(key, 0.0) + delta

    def transfer(self, *, nbytes: int, seconds: float, ranges: int, retries: int, ok: bool, request_id: str) -> None:
        """Record one finished (or finally failed) read of one load from one remote rank."""
        with self._lock:
            v = self._values
            v["retries"] += retries
            if ok:
                v["transfers"] += 1
                v["bytes"] += nbytes
                v["seconds"] += seconds
                v["ranges"] += ranges
            else:
                v["failures"] += 1
        if ok:
            logger.debug("%s: request %s read %d bytes in %d ranges in %.4f s (%.2f GB/s, %d retries)",
                         self.name, request_id, nbytes, ranges, seconds,
                         nbytes / seconds / 1e9 if seconds > 0 else 0.0, retries)
        self.maybe_log()

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    def summary(self) -> str:
        v = self.snapshot()
        rate = v["bytes"] / v["seconds"] / 1e9 if v["seconds"] > 0 else 0.0
        return (f"{self.name}: {int(v['transfers'])} transfers, {v['bytes'] / 1e9:.3f} GB "
                f"({rate:.2f} GB/s), {int(v['ranges'])} ranges, {int(v['retries'])} retries, "
                f"{int(v['failures'])} failures, {int(v['handshakes'])} handshakes, "
                f"{int(v['bad_messages'])} bad messages")

    def maybe_log(self) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last_log < self._log_every_s:
                return
            self._last_log = now
        logger.info("%s", self.summary())
