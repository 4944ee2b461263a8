"""A named thread that fails read handles whose deadline passed, so a handle
never outlives its ``timeout_s`` whatever its worker is stuck on.

Arming a deadline wakes the thread only when it becomes the earliest one
(the thread sleeps until the earliest deadline; a later one changes
nothing it waits for), so a read costs a heap push, not a thread switch.
The lock is never held while a handle is asked anything but whether it is
already marked finished: a handle's ``done()`` may poll a device."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Optional

from atom_kv.transfer.base import ReadFailure, ReadHandle

log = logging.getLogger(__name__)


class DeadlineWatch:
    """Owns one thread; ``watch(handle, timeout_s, what)`` arms a deadline.
    ``cond``: the condition the thread sleeps on (tests pass one that counts its wake-ups)."""

    def __init__(self, name: str, cond: Optional[threading.Condition] = None) -> None:
        self._cond = cond or threading.Condition()
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
                self._heap = [e for e in self._heap if e[2].finished is None]
                heapq.heapify(self._heap)
                self._prune_at = max(1024, 2 * len(self._heap))
            entry = (time.monotonic() + timeout_s, next(self._seq), handle, what)
            heapq.heappush(self._heap, entry)
            if self._heap[0] is entry:  # the earliest deadline changed: the thread sleeps until it
                self._cond.notify()

    def _run(self) -> None:
        while True:
            expired = []
            with self._cond:
                if self._stop:
                    return
                now = time.monotonic()
                # finished handles (already marked: nothing is asked of them here) and expired ones leave the heap
                while self._heap and (self._heap[0][2].finished is not None or self._heap[0][0] <= now):
                    entry = heapq.heappop(self._heap)
                    if entry[2].finished is None:
                        expired.append(entry)
                if not expired:
                    self._cond.wait((self._heap[0][0] - now) if self._heap else None)
                    continue
            for _, _, handle, what in expired:  # outside the lock: done() may poll a device's fences
                if not handle.done() and handle._finish(f"{what}: timed out after {handle.duration:.2f}s",
                                                                ReadFailure.TIMEOUT):
                    log.warning("%s: timed out", what)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            pending = self._heap
            self._heap = []
            self._cond.notify()
        for _, _, handle, what in pending:
            handle._finish(f"{what}: backend closed", ReadFailure.CLOSED)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
