"""Starting and completing NIXL transfers off the caller's thread, without
spinning a CPU core.

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

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from atom_kv.transfer.base import ReadHandle
from atom_kv.transfer.nixl.agent import NixlAgent, nixl_error

__all__ = ["Launch", "Pending", "XferTracker"]

logger = logging.getLogger(__name__)

#: makes and posts one NIXL transfer; returns (transfer, "DONE" | "PROC" | "ERR")
Launch = Callable[[], tuple[Any, str]]


@dataclass
class Pending:
    """One ``read()``: its handle, the transfers still to start (one per
    memory-segment pair, one in practice) and those started."""

    handle: ReadHandle
    peer: str
    timeout_s: float
    deadline: float
    launches: list[Launch] = field(default_factory=list)
    xfers: list[Any] = field(default_factory=list)
    #: transfers NIXL reported finished (and that were released)
    done: int = 0
    #: when the read was issued (time.monotonic)
    started: float = field(default_factory=time.monotonic)


class XferTracker:
    """Owns the completion thread and every NIXL transfer in flight of one backend."""

    def __init__(self, name: str, agent: NixlAgent, *, min_sleep_s: float = 20e-6, max_sleep_s: float = 0.001,
                 idle_sleep_s: float = 0.5) -> None:
        self._agent = agent
        self._cond = threading.Condition()
        # held while transfers are made from prepared lists, so a peer's lists
        # are never released under a launch (fail_peer takes it first)
        self._launching = threading.Lock()
        self._new: list[Pending] = []  # not started yet
        self._pending: list[Pending] = []
        self._abandoned: list[Pending] = []  # finished, but NIXL may still be writing
        self._stopped = False
        self._min, self._max, self._idle = min_sleep_s, max_sleep_s, idle_sleep_s
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- called by the backend ------------------------------------------------------
    def add(self, pending: Pending) -> None:
        """Start ``pending``'s transfers on the tracker's thread."""
        with self._cond:
            if self._stopped:
                self._give_up(pending, "NIXL backend is closed")
                return
            self._new.append(pending)
            self._cond.notify_all()

    def fail_peer(self, peer: str, reason: str) -> int:
        """Fail every read from ``peer`` not finished yet; returns how many.
        When it returns, no transfer from ``peer``'s prepared lists is being made."""
        with self._launching, self._cond:
            hit = [p for p in self._new + self._pending if p.peer == peer]
            self._new = [p for p in self._new if p.peer != peer]
            self._pending = [p for p in self._pending if p.peer != peer]
            for p in hit:
                self._give_up(p, reason)
            self._cond.notify_all()
        return len(hit)

    def close(self, reason: str = "NIXL backend closed", join_timeout_s: float = 5.0) -> None:
        """Fail what is in flight, stop the thread. The caller tears the agent
        down next (which cancels whatever NIXL still runs), so every handle is
        settled here."""
        with self._launching, self._cond:
            if self._stopped:
                return
            self._stopped = True
            for p in self._new + self._pending:
                self._give_up(p, reason)
            self._new.clear()
            self._pending.clear()
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(join_timeout_s)
        with self._cond:
            for p in self._abandoned:
                p.handle._settle()
            self._abandoned.clear()

    # -- the thread -------------------------------------------------------------------
    def _give_up(self, p: Pending, reason: str) -> None:
        """Finish ``p`` with ``reason`` and release (cancel) its transfers;
        settled now if NIXL let go of all of them, else once it does. Under
        the condition's lock."""
        if p.handle._finish(reason):
            logger.warning("NIXL read from peer %s: %s", p.peer, reason)
        p.launches = []
        p.xfers = [x for x in p.xfers if not self._agent.release(x)]
        if p.xfers:
            self._abandoned.append(p)
        else:
            p.handle._settle()

    def _launch_new(self) -> bool:
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
                        self._give_up(p, "NIXL backend is closed")
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

    def _run(self) -> None:
        delay = self._min
        while True:
            with self._cond:
                if self._stopped:
                    return
                if not self._new and not self._pending and not self._abandoned:
                    self._cond.wait(self._idle)
                    delay = self._min
                    continue
                has_new = bool(self._new)
            if has_new:
                self._launch_new()
            with self._cond:
                pending = list(self._pending)
                abandoned = list(self._abandoned)
            now = time.monotonic()
            finished = []
            for p in pending:
                try:
                    if self._poll(p, now):
                        finished.append(p)
                except Exception as exc:  # a broken handle must not kill the thread
                    logger.exception("NIXL state poll failed for peer %s", p.peer)
                    with self._cond:
                        self._give_up(p, f"NIXL state poll failed: {type(exc).__name__}: {exc}")
                    finished.append(p)
            quiet = [p for p in abandoned if self._settle_if_quiet(p)]
            with self._cond:
                gone = {id(p) for p in finished}
                self._pending = [p for p in self._pending if id(p) not in gone]
                gone = {id(p) for p in quiet}
                self._abandoned = [p for p in self._abandoned if id(p) not in gone]
                delay = self._next_delay(delay, bool(finished or quiet), now)
                if self._stopped:
                    return
                if not self._new:
                    self._cond.wait(delay)

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
        if p.handle.done():  # finished elsewhere
            with self._cond:
                self._give_up(p, p.handle.error or "finished")
            return True
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
        if not still:
            p.handle._finish(None)
            p.handle._settle()
            return True
        if now > p.deadline:
            with self._cond:
                self._give_up(p, f"NIXL read from peer {p.peer} timed out after {p.timeout_s:g}s "
                                 f"({len(still)} of {len(still) + p.done} transfers still running)")
            return True
        return False

    def _settle_if_quiet(self, p: Pending) -> bool:
        """Settle an abandoned read once NIXL finished or let go of all its transfers."""
        p.xfers = [x for x in p.xfers if self._agent.state(x) == "PROC" or not self._agent.release(x)]
        if p.xfers:
            return False
        p.handle._settle()
        return True
