"""Read jobs of the host-memory backends (tcp, cma) and the threads that run them.

One ``read()`` is split into jobs (batches of ranges) sharing a
:class:`ReadState`. :class:`JobWorkers` owns a job queue and the named
threads that drain it, and makes every job submitted report to its state
exactly once: it ran, was skipped because its handle already finished, was
refused because the workers are closing, crashed, or was still queued at
close. That is what lets every handle settle.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Optional

from atom_kv.transfer.base import ReadFailure, ReadHandle

__all__ = ["DEFERRED", "JobWorkers", "ReadState"]

#: what ``run`` returns when it will report the job itself, later (staged
#: receives whose last device copies are still in flight): through
#: ``job.state.job_done`` exactly once, at the latest from ``idle``
DEFERRED = "deferred"

log = logging.getLogger(__name__)


class ReadState:
    """One ``read()`` call split into jobs; finishes its handle when the last
    job is done or at the first failure."""

    __slots__ = ("handle", "rid", "_left", "_lock")

    def __init__(self, handle: ReadHandle, rid: int, jobs: int) -> None:
        self.handle = handle
        self.rid = rid
        self._left = jobs
        self._lock = threading.Lock()
        handle._track_io()

    def job_done(self, error: Optional[str] = None, reason: Optional[ReadFailure] = None) -> None:
        """Every job reports exactly once, whether it ran, failed (``error``, for ``reason``) or was
        skipped; the last report settles the handle (no more writes)."""
        if error is not None:
            self.handle._finish(error, reason)
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.handle._finish(None)  # no-op if already failed
            self.handle._settle()

    def job_skipped(self) -> None:
        """A queued job dropped because the handle already finished."""
        self.job_done(None)


class JobWorkers:
    """Owns a queue of jobs (anything with a ``.state`` :class:`ReadState`) and
    ``count`` named threads running ``run(index, job)``, which returns an
    error string, None, or :data:`DEFERRED`. ``what`` ("tcp read") and
    ``closed_reason`` word the errors of jobs refused at close;
    ``on_crash(index)`` runs when ``run`` raises (the job fails with the
    exception); ``idle(index)`` runs when worker ``index`` finds no job
    waiting, before it blocks, and when it stops (it reports the deferred
    jobs)."""

    def __init__(
        self,
        name: str,
        count: int,
        run: Callable[[int, Any], Optional[str]],
        *,
        what: str,
        closed_reason: str,
        on_crash: Optional[Callable[[int], None]] = None,
        idle: Optional[Callable[[int], None]] = None,
    ) -> None:
        self._run = run
        self._idle = idle
        self._what = what
        self._closed_reason = closed_reason
        self._on_crash = on_crash
        self._jobs: "queue.Queue[Any]" = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._drain, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(count)
        ]
        for t in self._threads:
            t.start()

    def __len__(self) -> int:
        return len(self._threads)

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, job: Any) -> None:
        """Queue ``job``; once closing, fail it at once instead."""
        with self._lock:
            if not self._closed:
                self._jobs.put(job)
                return
        self._refuse(job)

    def close(self, unblock: Optional[Callable[[], None]] = None) -> None:
        """Refuse new jobs, call ``unblock()`` (e.g. shut sockets the workers
        wait on), stop and join the threads, and fail what is still queued."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if unblock is not None:
            unblock()
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._refuse(job)

    def _refuse(self, job: Any) -> None:
        job.state.job_done(f"{self._what} {job.state.rid}: {self._closed_reason}", ReadFailure.CLOSED)

    def _next(self, index: int) -> Any:
        """The next job (None: stop); runs ``idle`` first when none is waiting."""
        idle = self._idle
        if idle is not None:
            try:
                return self._jobs.get_nowait()
            except queue.Empty:
                self._idle_safely(idle, index)
        return self._jobs.get()

    def _idle_safely(self, idle: Callable[[int], None], index: int) -> None:
        try:
            idle(index)
        except Exception:  # a bug must not stop the worker; its jobs were reported by idle's own guards
            log.exception("%s: worker %d: unexpected error while idle", self._what, index)

    def _drain(self, index: int) -> None:
        while True:
            job = self._next(index)
            if job is None:
                if self._idle is not None:
                    self._idle_safely(self._idle, index)
                return
            state = job.state
            if state.handle.done():
                state.job_skipped()
                continue
            if self._closed:
                self._refuse(job)
                continue
            try:
                error = self._run(index, job)
            except Exception as exc:  # a bug must fail the read, not the worker
                log.exception("%s %d: unexpected error", self._what, state.rid)
                if self._on_crash is not None:
                    self._on_crash(index)
                error = f"{self._what} {state.rid}: internal error: {exc!r}"
                state.job_done(error, ReadFailure.INTERNAL)
                continue
            if error is not DEFERRED:
                state.job_done(error)
