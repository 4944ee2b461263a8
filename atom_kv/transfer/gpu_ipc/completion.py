"""Completion of ``gpu_ipc`` reads by polling their fences.

- :class:`EventPool`: the fence events of one device, made once and reused
  (timing-disabled, blocking-sync events: a read makes none in steady state).
- :class:`GpuReadHandle`: a :class:`ReadHandle` whose ``done()`` is a query
  of its fences, and whose ``wait()`` queries them for a bounded spin
  (``gpu_ipc.wait_spin_us``) and then blocks on the settling thread. A read
  that completes while its caller polls or spins never goes through another
  thread.
- :class:`Completions`: the reads in flight and the one named thread that
  settles those somebody blocks on, those failed by their deadline while
  their copies were still queued (the reaper), and, at close, all the rest.
  A read finishes *and settles* once its copies are complete on the device,
  so ``wait_settled`` keeps its meaning for a read failed by its deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

from atom_kv.transfer.base import ReadFailure, ReadHandle

__all__ = ["Completions", "EventPool", "GpuReadHandle"]

log = logging.getLogger(__name__)


class EventPool:
    """Owns the fence events of one device: ``take()`` hands out a free one
    (making one only when none is free), ``give()`` takes it back once the
    read it fenced is settled. ``created`` counts the events ever made."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._free: list[Any] = []
        self._lock = threading.Lock()
        self.created = 0

    def take(self) -> Any:
        with self._lock:
            if self._free:
                return self._free.pop()
            self.created += 1
        return self._make()

    def give(self, events: list[Any]) -> None:
        with self._lock:
            self._free.extend(events)


class _Latch:
    """A one-way flag a thread can wait on, as ``threading.Event`` is, made of
    one held lock (released when set) instead of a condition: a read makes
    two, and an Event costs a condition and a lock each. ``guard``, shared,
    makes ``set`` happen once however many threads race to it."""

    __slots__ = ("_held", "_set", "_guard")

    def __init__(self, guard: threading.Lock) -> None:
        self._held = threading.Lock()
        self._held.acquire()
        self._set = False
        self._guard = guard

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._guard:
            if self._set:
                return
            self._set = True
        self._held.release()

    def wait(self, timeout: Optional[float] = None) -> bool:
        if self._set:
            return True
        if self._held.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._held.release()  # the next waiter wakes in turn
            return True
        return self._set


class GpuReadHandle(ReadHandle):
    """A read whose copies are queued on the device: complete when every
    fence is (one per stream the read used). See the module's docstring."""

    __slots__ = ("_fences", "_owner", "_keep")

    def __init__(self, nbytes: int, num_ranges: int, owner: "Completions") -> None:
        # ReadHandle's fields, with latches for its two events (see _Latch)
        self._event = _Latch(owner.guard)
        self._settled = _Latch(owner.guard)
        self._tracked = False
        self._lock = threading.Lock()
        self.error: Optional[str] = None
        self.nbytes = nbytes
        self.num_ranges = num_ranges
        self.started = time.monotonic()
        self.finished: Optional[float] = None
        self._fences: Optional[list[tuple[EventPool, Any]]] = None
        self._owner = owner
        self._keep: Any = None

    def done(self) -> bool:
        if self._event.is_set():
            return True
        self._poll()
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        if self.done():
            return True
        owner = self._owner
        if owner.spin_s > 0:  # a bounded spin of event queries: a read of a few µs is not worth a thread switch
            start = time.perf_counter()
            end = start + min(owner.spin_s, timeout if timeout is not None else owner.spin_s)
            while time.perf_counter() < end:
                if self._poll():
                    return True
            if timeout is not None:
                timeout = max(0.0, timeout - (time.perf_counter() - start))
        owner.settle_soon(self)
        return self._event.wait(timeout)

    def wait_settled(self, timeout: Optional[float] = None) -> bool:
        if self._settled.is_set():
            return True
        if not self._poll():
            self._owner.settle_soon(self)
        return self._settled.wait(timeout)

    def wait_on(self, stream: Any) -> None:
        """Make work queued next on ``stream`` (the engine's) wait for this read's
        copies on the device, without the host waiting. The handle still
        finishes and settles as every read does (poll it, or wait)."""
        fences = self._fences
        if fences is not None:
            for _, event in fences:
                self._owner.seam.stream_wait(stream, event)

    def _finish(self, error: Optional[str] = None, reason: Optional[ReadFailure] = None) -> bool:
        first = super()._finish(error, reason)
        if first and error is not None and self._fences is not None:
            self._owner.settle_soon(self)  # failed (its deadline) while its copies are queued: reaped
        return first

    def _poll(self) -> bool:
        """Query the fences; complete the read when all are. True when settled."""
        fences = self._fences
        if fences is None:
            return self._settled.is_set()
        query = self._owner.seam.query
        for _, event in fences:
            if not query(event):
                return False
        self._complete(None)
        return True

    def _complete(self, error: Optional[str]) -> None:
        """The copies are complete (or failed): finish, settle, give the fences back (exactly once)."""
        with self._lock:
            fences, self._fences = self._fences, None
            self._keep = None  # the peer's mapped memory is not held past the copies
        if fences is None:
            return
        self._owner.done_with(self, fences)
        super()._finish(error)
        self._settle()


class Completions:
    """Owns a backend's reads in flight and its settling thread
    (``atomkv-gpu_ipc-settle-<key>``), started at construction and stopped
    by :meth:`close`, which first settles every read still in flight.
    ``spin_s``: how long ``wait()`` queries before it blocks."""

    def __init__(self, seam: Any, name: str, spin_s: float) -> None:
        self.seam = seam
        self.spin_s = spin_s
        self.guard = threading.Lock()  # the handles' latches are set under it (a few instructions)
        self._lock = threading.Lock()
        self._inflight: dict[int, GpuReadHandle] = {}
        self._queue: "queue.SimpleQueue[Optional[GpuReadHandle]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def handle(self, nbytes: int, num_ranges: int) -> GpuReadHandle:
        return GpuReadHandle(nbytes, num_ranges, self)

    def track(self, handle: GpuReadHandle, fences: list[tuple[EventPool, Any]], keep: Any,
              error: Optional[str]) -> None:
        """``handle``'s copies are queued behind ``fences``; ``keep`` (the peer's
        mapped memory) stays referenced until they are complete. ``error``: a
        copy that failed midway (the read fails once what was queued is complete)."""
        handle._track_io()
        handle._keep = keep
        handle._fences = fences
        with self._lock:
            self._inflight[id(handle)] = handle
        if error is not None:
            handle._finish(error)

    def settle_soon(self, handle: GpuReadHandle) -> None:
        """Have the settling thread wait for ``handle``'s fences (somebody blocks on it, or its deadline passed)."""
        self._queue.put(handle)

    def done_with(self, handle: GpuReadHandle, fences: list[tuple[EventPool, Any]]) -> None:
        with self._lock:
            self._inflight.pop(id(handle), None)
        for pool, event in fences:
            pool.give([event])

    def in_flight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def _settle(self, handle: GpuReadHandle) -> None:
        fences = handle._fences
        if fences is None:
            return
        error = None
        try:
            for _, event in fences:
                self.seam.synchronize(event)  # a blocking-sync event: this thread sleeps
        except Exception as exc:  # reported on the handle, never swallowed
            error = f"gpu_ipc: device copy failed: {exc}"
            log.warning("gpu_ipc: a read's copies failed on the device: %s", exc)
        handle._complete(error)

    def _run(self) -> None:
        while True:
            handle = self._queue.get()
            if handle is None:
                return
            self._settle(handle)
            del handle  # not held while waiting for the next one

    def close(self) -> None:
        """Settle every read in flight, then stop the thread."""
        with self._lock:
            left = list(self._inflight.values())
        for handle in left:
            self._queue.put(handle)
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
