"""Completion tracking for MORI-IO transfers without spinning a CPU core:
MORI-IO's side of the shared completion thread (:mod:`atom_kv.transfer._rdma`).

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

from dataclasses import dataclass, field
from typing import Any

from atom_kv.transfer._rdma import CompletionThread, PendingRead
from atom_kv.transfer.moriio.plan import Batch, status_error

__all__ = ["Pending", "CompletionTracker"]


@dataclass
class Pending(PendingRead):
    """One ``read()`` in flight: its handle and one status per batch."""

    entries: list[tuple[Any, Batch]] = field(default_factory=list)


class CompletionTracker(CompletionThread[Pending]):
    """Owns the completion thread and every in-flight status of one backend
    (:class:`~atom_kv.transfer._rdma.CompletionThread`: MORI-IO's polling)."""

    label = "MORI-IO"

    def __init__(
        self, name: str, *, min_sleep_s: float = 50e-6, max_sleep_s: float = 0.002, idle_sleep_s: float = 0.1
    ) -> None:
        super().__init__(name, min_sleep_s=min_sleep_s, max_sleep_s=max_sleep_s, idle_sleep_s=idle_sleep_s)

    # -- called by the backend ------------------------------------------------
    def add(self, pending: Pending) -> None:
        """Poll ``pending``'s statuses (already posted) on the tracker's thread."""
        pending.handle._track_io()
        with self._cond:
            if self._refuse_when_stopped(pending):  # the engine is being torn down with its memory
                return
            self._pending.append(pending)
            self._cond.notify_all()

    def in_flight(self) -> int:
        with self._cond:
            return len(self._pending)

    def abandoned(self) -> int:
        """Statuses still in progress for reads that were already given up on."""
        with self._cond:
            return sum(1 for p in self._abandoned for s, _ in p.entries if _in_progress(s))

    # -- the thread -------------------------------------------------------------
    def _let_go(self, p: Pending) -> bool:
        """MORI-IO writes each status's final state itself: nothing to release, only to wait for."""
        return any(_in_progress(s) for s, _ in p.entries)

    def _next_delay(self, delay: float, progressed: bool, now: float) -> float:
        delay = super()._next_delay(delay, progressed, now)
        if not self._pending:
            delay = max(delay, self._idle if self._abandoned else self._min)
        return delay

    def _poll(self, p: Pending, now: float) -> bool:
        waiting = 0
        for status, batch in p.entries:
            if status.Failed():
                with self._cond:
                    self._give_up(p, status_error(status.Code(), status.Message(), peer=p.peer, batch=batch))
                return True
            if not status.Succeeded():
                waiting += 1
        return self._succeeded_or_late(p, now, waiting, f"{waiting} of {len(p.entries)} batches still in progress")


def _in_progress(status: Any) -> bool:
    try:
        return bool(status.InProgress())
    except Exception:
        return False
