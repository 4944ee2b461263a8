"""Waiting for a condition another process brings about, with a bound."""

from __future__ import annotations

import time
import urllib.error
from typing import Any, Callable

__all__ = ["wait_until"]


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.2, what: str = "condition") -> Any:
    """Call ``predicate`` every ``interval`` seconds until it returns a truthy value (returned)
    or ``timeout`` seconds pass (:class:`TimeoutError` naming ``what``).

    For state only another process can change and report over HTTP or the
    file system; a network error (the server is not up yet) counts as "not yet".
    Exceptions other than network errors propagate at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except (OSError, urllib.error.URLError):
            value = None
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
