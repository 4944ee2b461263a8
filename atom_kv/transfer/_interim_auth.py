"""Interim copies of the package's shared trust helpers, with the exact
signatures of ``atom_kv.auth`` (:func:`mac`, :func:`verify_mac`,
:func:`new_nonce`) and ``atom_kv._ratelimit`` (:class:`RateLimitedLog`).

Only :mod:`atom_kv.transfer._trust` imports this module; once those shared
modules are on this branch, its import line points at them and this file goes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from typing import Callable

__all__ = ["RateLimitedLog", "mac", "new_nonce", "verify_mac"]


def mac(token: str | bytes, purpose: str, payload: bytes) -> str:
    """Hex HMAC-SHA256 of ``purpose + b"\\0" + payload`` keyed with ``token``."""
    key = token.encode("utf-8") if isinstance(token, str) else token
    return hmac.new(key, purpose.encode("ascii") + b"\0" + payload, hashlib.sha256).hexdigest()


def verify_mac(token: str | bytes, purpose: str, payload: bytes, mac_hex: object) -> bool:
    """Constant-time check of a hex MAC; False for anything that is not a string."""
    if not isinstance(mac_hex, str):
        return False
    return hmac.compare_digest(mac(token, purpose, payload), mac_hex)


def new_nonce() -> str:
    """16 random bytes, hex (32 characters)."""
    return os.urandom(16).hex()


class RateLimitedLog:
    """Counts every event by ``key``; logs the first ``burst`` of a key per
    ``interval_s`` at once and folds the rest into one summary line."""

    def __init__(
        self, logger: logging.Logger, what: str, *, interval_s: float = 10.0, level: int = logging.WARNING,
        burst: int = 1, max_keys: int = 64, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.what = what
        self.interval_s = interval_s
        self.level = level
        self.burst = max(1, burst)
        self.max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        # key -> [window_start, logged, suppressed, last_message, total]
        self._buckets: dict[str, list] = {}

    def event(self, key: str, message: str) -> bool:
        """Count one event; True when it was logged, False when only counted."""
        now = self._clock()
        with self._lock:
            if key not in self._buckets and len(self._buckets) >= self.max_keys:
                key = "other"
            b = self._buckets.setdefault(key, [None, 0, 0, "", 0])
            b[4] += 1
            summary = None
            if b[0] is None or now - b[0] >= self.interval_s:
                if b[2] and b[0] is not None:
                    summary = f"{b[2]} more {self.what} ({key}) in the last {now - b[0]:.1f}s; last: {b[3]}"
                b[0], b[1], b[2] = now, 0, 0
            elif b[1] >= self.burst:
                b[2] += 1
                b[3] = message
                return False
            b[1] += 1
            b[3] = message
        if summary is not None:
            self.logger.log(self.level, "%s", summary, stacklevel=2)
        self.logger.log(self.level, "%s", message, stacklevel=2)
        return True

    def flush(self) -> None:
        """Log the summary of every key whose interval is over."""
        now = self._clock()
        lines = []
        with self._lock:
            for key, b in self._buckets.items():
                if b[2] and b[0] is not None and now - b[0] >= self.interval_s:
                    lines.append(f"{b[2]} more {self.what} ({key}) in the last {now - b[0]:.1f}s; last: {b[3]}")
                    b[0], b[1], b[2] = now, self.burst, 0
        for line in lines:
            self.logger.log(self.level, "%s", line)

    def counts(self) -> dict[str, int]:
        """Every event ever counted, by key."""
        with self._lock:
            return {key: b[4] for key, b in self._buckets.items()}
