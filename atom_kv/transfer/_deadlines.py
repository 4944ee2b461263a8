"""A named thread that fails read handles whose deadline passed, so a handle
never outlives its ``timeout_s`` whatever its worker is stuck on."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time

from atom_kv.transfer.base import ReadHandle

log = logging.getLogger(__name__)


class DeadlineWatch:
    """Owns one thread; ``watch(handle, timeout_s, what)`` arms a deadline."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, ReadHandle, str]] = []
        self._seq = itertools.count()
        self._stop = False
        self._prune_at = 1024
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, handle: ReadHandle, timeout_s: float, what: str) -> None:
        with self._cond:
            if len(self._heap) >= self._prune_at:
                # finished handles linger until their deadline; drop them in bulk
                self._heap = [e for e in self._heap if not e[2].done()]
                heapq.heapify(self._heap)
                self._prune_at = max(1024, 2 * len(self._heap))
            heapq.heappush(self._heap, (time.monotonic() + timeout_s, next(self._seq), handle, what))
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._stop:
                now = time.monotonic()
                while self._heap and (self._heap[0][2].done() or self._heap[0][0] <= now):
                    deadline, _, handle, what = heapq.heappop(self._heap)
                    if not handle.done() and handle._finish(f"{what}: timed out after {handle.duration:.2f}s"):
                        log.warning("%s: timed out", what)
                wait = (self._heap[0][0] - now) if self._heap else None
                self._cond.wait(wait)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            pending = self._heap
            self._heap = []
            self._cond.notify()
        for _, _, handle, what in pending:
            handle._finish(f"{what}: backend closed")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
