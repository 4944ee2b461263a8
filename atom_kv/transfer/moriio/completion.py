"""Completion tracking for MORI-IO transfers without spinning a CPU core.

MORI-IO never calls back: a ``TransferStatus`` must be polled. One named
thread per backend polls every in-flight status with exponential backoff
(tens of microseconds right after progress, a few milliseconds when idle) and
sleeps on a condition variable when nothing is in flight. It finishes each
:class:`ReadHandle` on success, on the first failed status (with MORI's code
and message) or when the transfer passes its deadline.

Reads that were given up on (timeout, peer removed) stay tracked until
MORI-IO is done with every one of their statuses: the library writes the
final state into the status object, and the NIC may still be writing the
destination. Only then is the handle *settled* (``ReadHandle.wait_settled``),
the point after which the caller may reuse the destination blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from atom_kv.transfer.base import ReadHandle
from atom_kv.transfer.moriio.plan import Batch, status_error

__all__ = ["Pending", "CompletionTracker"]

logger = logging.getLogger(__name__)


@dataclass
class Pending:
    """One ``read()`` in flight: its handle and one status per batch."""

    handle: ReadHandle
    peer: str
    timeout_s: float
    deadline: float
    entries: list[tuple[Any, Batch]] = field(default_factory=list)


class CompletionTracker:
    """Owns the completion thread and every in-flight status of one backend."""

    def __init__(
        self, name: str, *, min_sleep_s: float = 50e-6, max_sleep_s: float = 0.002, idle_sleep_s: float = 0.1
    ) -> None:
        self._cond = threading.Condition()
        self._pending: list[Pending] = []
        self._abandoned: list[Pending] = []  # finished, but MORI may still be writing
        self._stopped = False
        self._min = min_sleep_s
        self._max = max_sleep_s
        self._idle = idle_sleep_s
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- called by the backend ------------------------------------------------
    def add(self, pending: Pending) -> None:
        pending.handle._track_io()
        with self._cond:
            if self._stopped:
                pending.handle._finish("MORI-IO backend is closed")
                pending.handle._settle()  # the engine is being torn down with its memory
                return
            self._pending.append(pending)
            self._cond.notify_all()

    def fail_peer(self, peer: str, reason: str) -> int:
        """Fail every in-flight read from ``peer``; returns how many."""
        with self._cond:
            hit = [p for p in self._pending if p.peer == peer]
            self._pending = [p for p in self._pending if p.peer != peer]
            for p in hit:
                self._abandon(p, reason)
            self._cond.notify_all()
        return len(hit)

    def in_flight(self) -> int:
        with self._cond:
            return len(self._pending)

    def abandoned(self) -> int:
        """Statuses still in progress for reads that were already given up on."""
        with self._cond:
            return sum(1 for p in self._abandoned for s, _ in p.entries if _in_progress(s))

    def close(self, reason: str = "MORI-IO backend closed", join_timeout_s: float = 5.0) -> None:
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            for p in self._pending:
                self._abandon(p, reason)
            self._pending.clear()
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(join_timeout_s)
        with self._cond:
            # the caller deregisters the memory right after this; nothing
            # can be written into it any more
            for p in self._abandoned:
                p.handle._settle()
            self._abandoned.clear()

    # -- the thread -------------------------------------------------------------
    def _abandon(self, p: Pending, reason: str) -> None:
        if p.handle._finish(reason):
            logger.warning("MORI-IO read from peer %s: %s", p.peer, reason)
        self._abandoned.append(p)

    def _run(self) -> None:
        delay = self._min
        while True:
            with self._cond:
                if self._stopped:
                    return
                if not self._pending and not self._abandoned:
                    self._cond.wait(self._idle)
                    delay = self._min
                    continue
                pending = list(self._pending)
            progressed = False
            finished: list[Pending] = []
            orphans: list[Pending] = []
            now = time.monotonic()
            for p in pending:
                try:
                    done = self._poll(p, now, orphans)
                except Exception as exc:  # a broken status object must not kill the thread
                    logger.exception("MORI-IO status poll failed for peer %s", p.peer)
                    p.handle._finish(f"MORI-IO status poll failed: {type(exc).__name__}: {exc}")
                    orphans.append(p)
                    done = True
                if done:
                    finished.append(p)
            with self._cond:
                self._abandoned.extend(orphans)
                if finished:
                    progressed = True
                    gone = {id(p) for p in finished}
                    self._pending = [p for p in self._pending if id(p) not in gone]
                before = len(self._abandoned)
                self._abandoned = [p for p in self._abandoned if not _settle_if_quiet(p)]
                progressed = progressed or len(self._abandoned) != before
                delay = self._min if progressed else min(delay * 2, self._max)
                if not self._pending:
                    delay = max(delay, self._idle if self._abandoned else self._min)
                if self._stopped:
                    return
                self._cond.wait(delay)

    def _poll(self, p: Pending, now: float, orphans: list[Pending]) -> bool:
        """True when ``p`` is finished (its handle has been finished); a
        finished read that may still have statuses in flight goes to ``orphans``
        until it settles."""
        if p.handle.done():  # finished elsewhere (peer removed, closed, start failed)
            orphans.append(p)
            return True
        waiting = 0
        for status, batch in p.entries:
            if status.Failed():
                error = status_error(status.Code(), status.Message(), peer=p.peer, batch=batch)
                if p.handle._finish(error):
                    logger.warning("MORI-IO read from peer %s failed: %s", p.peer, error)
                orphans.append(p)
                return True
            if not status.Succeeded():
                waiting += 1
        if waiting == 0:
            p.handle._finish(None)
            p.handle._settle()
            return True
        if now > p.deadline:
            reason = (
                f"MORI-IO read from peer {p.peer} timed out after {p.timeout_s:g}s "
                f"({waiting} of {len(p.entries)} batches still in progress)"
            )
            if p.handle._finish(reason):
                logger.warning(reason)
            orphans.append(p)
            return True
        return False


def _settle_if_quiet(p: Pending) -> bool:
    """Settle ``p``'s handle once none of its statuses is in progress."""
    if any(_in_progress(s) for s, _ in p.entries):
        return False
    p.handle._settle()
    return True


def _in_progress(status: Any) -> bool:
    try:
        return bool(status.InProgress())
    except Exception:
        return False
