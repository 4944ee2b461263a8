"""CPython's garbage collector and a serving process's start-up heap.

After start-up an engine process holds a large heap that never becomes
garbage: torch, the model, every imported module, the KV cache's bookkeeping.
A full (generation 2) collection walks all of it, which takes tens of
milliseconds on a small host, and it runs wherever allocations happen to cross
CPython's threshold. In the connector bench it landed inside the first-contact
handshake (73-80 ms instead of 8 ms at TP 1: a full collection, nothing of the
handshake's own). :func:`freeze_startup_heap` moves everything alive after
start-up into CPython's permanent generation, which collections skip; vLLM
does the same after its engine starts. :class:`FullCollections` measures how
much of a timed section was spent in full collections, so that a bench can
tell the two apart.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any, Optional

__all__ = ["FullCollections", "freeze_startup_heap"]


def freeze_startup_heap() -> None:
    """Collect once, then exempt every object alive now from later collections.

    Call it when a process has finished starting (model loaded, KV cache
    registered), before it serves. Objects made afterwards are collected as
    usual; the frozen ones are only freed when their references go."""
    gc.collect()
    gc.freeze()


class FullCollections:
    """Owns a ``gc.callbacks`` entry while active (a context manager) and
    counts the full (generation 2) collections that ran meanwhile, in any
    thread, and the seconds they took."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: Optional[float] = None
        self.count = 0
        self.seconds = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        now = time.perf_counter()
        with self._lock:
            if phase == "start":
                self._started = now
            elif self._started is not None:
                self.count += 1
                self.seconds += now - self._started
                self._started = None

    def __enter__(self) -> "FullCollections":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._callback)
