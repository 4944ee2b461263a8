"""Counters and rate-limited warnings of one transfer endpoint."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from atom_kv.transfer._trust import RateLimitedLog

__all__ = ["EndpointEvents", "endpoint_stats"]


class EndpointEvents:
    """Owns one endpoint's event counts (exact, by key: "auth", "decode",
    "timeout", ...) and its rate-limited warning log, so that a flood of bad
    connections becomes a count and a few summary lines, never a log flood."""

    def __init__(self, logger: logging.Logger, what: str, *, interval_s: float = 10.0) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._log = RateLimitedLog(logger, what, interval_s=interval_s)

    def count(self, key: str, n: int = 1) -> None:
        """Count an event that is not worth a warning (an idle connection closed)."""
        with self._lock:
            self._counts[key] += n

    def warn(self, key: str, message: str) -> None:
        """Count an event and log it as a warning, rate-limited per key."""
        self.count(key)
        self._log.event(key, message)

    def __getitem__(self, key: str) -> int:
        with self._lock:
            return self._counts[key]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def flush(self) -> None:
        """Log the pending summaries (at close)."""
        self._log.flush()


def endpoint_stats(serving: Any, reader: "EndpointEvents") -> dict[str, int]:
    """A backend's ``stats()``: its serving endpoint's counts (``serving`` may be
    None before anything registered) and, prefixed "reader_", its reading side's."""
    out = dict(serving.stats()) if serving is not None else {}
    out.update({f"reader_{k}": v for k, v in reader.snapshot().items()})
    return out
