"""Starting and completing NIXL transfers off the caller's thread, without
spinning a CPU core: NIXL's side of the shared completion thread
(:mod:`atom_kv.transfer._rdma`).

``read()`` only plans; one named thread per backend makes and posts each
read's NIXL transfers (posting may itself move the bytes: UCX over ``cma``
copies inside the post) and then polls them. NIXL never calls back, so the
thread polls every transfer in flight with back-off (tens of microseconds right
after progress, growing while nothing finishes, up to a thirty-second of the
youngest read's age and at most a millisecond) and sleeps on a condition
variable when nothing is in flight. It finishes each :class:`ReadHandle` when
all its transfers are done, on the first error, or at the read's deadline.

A read given up on (deadline, peer removed, backend closed) has its transfers
released, which cancels them; one NIXL cannot cancel yet stays tracked until
NIXL reports it finished, and only then is the handle *settled*
(``ReadHandle.wait_settled``): the point after which nothing writes into the
destination any more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from atom_kv.transfer._rdma import CompletionThread, PendingRead
from atom_kv.transfer.base import ReadFailure
from atom_kv.transfer.nixl.agent import NixlAgent, nixl_error

__all__ = ["Launch", "Pending", "XferTracker"]

#: makes and posts one NIXL transfer; returns (transfer, "DONE" | "PROC" | "ERR")
Launch = Callable[[], tuple[Any, str]]


@dataclass
class Pending(PendingRead):
    """One ``read()``: its handle, the transfers still to start (one per
    memory-segment pair, one in practice) and those started."""

    launches: list[Launch] = field(default_factory=list)
    xfers: list[Any] = field(default_factory=list)
    #: transfers NIXL reported finished (and that were released)
    done: int = 0
    #: when the read was issued (time.monotonic)
    started: float = field(default_factory=time.monotonic)


class XferTracker(CompletionThread[Pending]):
    """Owns the completion thread and every NIXL transfer in flight of one
    backend (:class:`~atom_kv.transfer._rdma.CompletionThread`: NIXL's
    starting and polling)."""

    label = "NIXL"

    def __init__(self, name: str, agent: NixlAgent, *, min_sleep_s: float = 20e-6, max_sleep_s: float = 0.001,
                 idle_sleep_s: float = 0.5) -> None:
        self._agent = agent
        self._new: list[Pending] = []  # not started yet
        super().__init__(name, min_sleep_s=min_sleep_s, max_sleep_s=max_sleep_s, idle_sleep_s=idle_sleep_s)

    # -- called by the backend ------------------------------------------------------
    def add(self, pending: Pending) -> None:
        """Start ``pending``'s transfers on the tracker's thread."""
        with self._cond:
            if self._refuse_when_stopped(pending):
                return
            self._new.append(pending)
            self._cond.notify_all()

    def _take(self, which: Callable[[Pending], bool]) -> list[Pending]:
        hit = [p for p in self._new if which(p)] + super()._take(which)
        self._new = [p for p in self._new if not which(p)]
        return hit

    # -- the thread -------------------------------------------------------------------
    def _let_go(self, p: Pending) -> bool:
        """Release (cancel) ``p``'s transfers; True while NIXL still runs some."""
        p.launches = []
        p.xfers = [x for x in p.xfers if not self._agent.release(x)]
        return bool(p.xfers)

    def _quiet(self, p: Pending) -> bool:
        """Release an abandoned read's transfers that NIXL finished; True once none is left."""
        p.xfers = [x for x in p.xfers if self._agent.state(x) == "PROC" or not self._agent.release(x)]
        return not p.xfers

    def _has_new(self) -> bool:
        return bool(self._new)

    def _start_new(self) -> bool:
        """Start the transfers of every new read; True if there were any."""
        with self._launching:
            with self._cond:
                new, self._new = self._new, []
            for p in new:
                error = self._launch(p)
                with self._cond:
                    if error is not None:
                        self._give_up(p, error)
                    elif self._stopped:
                        self._give_up(p, "NIXL backend is closed", ReadFailure.CLOSED)
                    else:
                        self._pending.append(p)
        return bool(new)

    def _launch(self, p: Pending) -> str | None:
        """Make and post ``p``'s transfers; the error that stopped it, or None."""
        launches, p.launches = p.launches, []
        for launch in launches:
            try:
                xfer, state = launch()
            except Exception as exc:
                return f"NIXL read from peer {p.peer} did not start: {nixl_error(exc)}"
            p.xfers.append(xfer)
            if state == "ERR":
                return f"NIXL read from peer {p.peer} failed when posted (the peer went away or its memory is gone)"
        return None

    def _next_delay(self, delay: float, progressed: bool, now: float) -> float:
        """Back-off: doubles while nothing finishes, but never beyond a
        thirty-second of the youngest read's age, so a read is noticed at most
        about 3% after it finished (and at most ``max_sleep_s`` late)."""
        if progressed:
            return self._min
        youngest = min((now - p.started for p in self._pending), default=self._max * 32)
        return max(self._min, min(delay * 2, self._max, youngest / 32))

    def _poll(self, p: Pending, now: float) -> bool:
        """True once ``p`` is finished (its handle then is)."""
        still = []
        for i, xfer in enumerate(p.xfers):
            state = self._agent.state(xfer)
            if state == "PROC":
                still.append(xfer)
            elif state == "DONE":
                p.done += 1
                self._agent.release(xfer)
            else:
                detail = state[5:] if state.startswith("ERR: ") else "NIXL reported an error"
                p.xfers = still + p.xfers[i + 1:]
                with self._cond:
                    self._give_up(p, f"NIXL read from peer {p.peer} failed: {detail} "
                                     "(the peer went away or its memory is gone)")
                return True
        p.xfers = still
        return self._succeeded_or_late(p, now, len(still), f"{len(still)} of {len(still) + p.done} transfers still "
                                                           "running")
