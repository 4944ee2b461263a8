"""The skeleton the RDMA backends (nixl, moriio) share: per peer, what was
planned once is dropped with it (:class:`RdmaPeers`); one completion thread
per backend polls the library's transfers with back-off and settles each read
(:class:`CompletionThread`); and the teardown order (:func:`teardown`).

Neither library calls back, so a read's transfers are polled. A read given up
on (deadline, peer removed, backend closed) finishes at once, but is *settled*
(``ReadHandle.wait_settled``: nothing writes into the destination any more)
only once the library let go of every one of its transfers.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

from atom_kv.transfer.base import ReadFailure, ReadHandle

__all__ = ["CompletionThread", "PendingRead", "RdmaPeers", "teardown"]

logger = logging.getLogger(__name__)


@dataclass
class PendingRead:
    """One ``read()`` in flight: its handle, the peer it reads from and its deadline."""

    handle: ReadHandle
    peer: str
    timeout_s: float
    deadline: float


P = TypeVar("P", bound=PendingRead)


class CompletionThread(abc.ABC, Generic[P]):
    """Owns one backend's completion thread and every read in flight: pending
    (polled), and abandoned (finished, but the library may still write).

    A backend's tracker says how one read is polled (:meth:`_poll`), how it
    lets go of the library's transfers (:meth:`_let_go`, :meth:`_quiet`), and
    may start new reads on this thread (:meth:`_start_new`)."""

    #: the library's name in messages ("NIXL", "MORI-IO")
    label = "RDMA"

    def __init__(self, name: str, *, min_sleep_s: float, max_sleep_s: float, idle_sleep_s: float) -> None:
        self._cond = threading.Condition()
        # held while transfers are made from what a peer planned, so that
        # fail_peer never drops a peer's plan under a start
        self._launching = threading.Lock()
        self._pending: list[P] = []
        self._abandoned: list[P] = []
        self._stopped = False
        self._min, self._max, self._idle = min_sleep_s, max_sleep_s, idle_sleep_s
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- what a backend's tracker says ---------------------------------------
    @abc.abstractmethod
    def _poll(self, p: P, now: float) -> bool:
        """True once ``p`` is finished (its handle then is: settled, or given up
        on); a poll ends with :meth:`_succeeded_or_late`."""

    @abc.abstractmethod
    def _let_go(self, p: P) -> bool:
        """At give-up: release (cancel) what the library may release of ``p``'s
        transfers; True while some still run."""

    def _quiet(self, p: P) -> bool:
        """Whether an abandoned read's transfers are all over (polled until they are)."""
        return not self._let_go(p)

    def _has_new(self) -> bool:
        """Whether reads wait to be started on this thread (under the condition's lock)."""
        return False

    def _start_new(self) -> bool:
        """Start the reads waiting; True if there were any."""
        return False

    def _next_delay(self, delay: float, progressed: bool, now: float) -> float:
        """Back-off: back to the shortest sleep after progress, doubling while nothing finishes."""
        return self._min if progressed else min(delay * 2, self._max)

    # -- called by the backend -------------------------------------------------
    @abc.abstractmethod
    def add(self, p: P) -> None:
        """Take ``p``, a read just begun, to be started or polled on this thread (or, after
        :meth:`close`, finished and settled at once: :meth:`_refuse_when_stopped`)."""

    def _refuse_when_stopped(self, p: P) -> bool:
        """Under the condition's lock: a read added after close finishes and settles now
        (nothing of it was started)."""
        if self._stopped:
            p.handle._finish(f"{self.label} backend is closed", ReadFailure.CLOSED)
            p.handle._settle()
        return self._stopped

    def fail_peer(self, peer: str, reason: str) -> int:
        """Fail every read from ``peer`` not finished yet; returns how many.
        When it returns, no transfer from ``peer``'s plan is being started."""
        with self._launching, self._cond:
            hit = self._take(lambda p: p.peer == peer)
            for p in hit:
                self._give_up(p, reason, ReadFailure.PEER_GONE)
            self._cond.notify_all()
        return len(hit)

    def close(self, reason: str, join_timeout_s: float = 5.0) -> None:
        """Fail what is in flight and stop the thread. The backend releases the
        library's objects next (which cancels whatever still runs), so every
        handle is settled here."""
        with self._launching, self._cond:
            if self._stopped:
                return
            self._stopped = True
            for p in self._take(lambda p: True):
                self._give_up(p, reason, ReadFailure.CLOSED)
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(join_timeout_s)
        with self._cond:
            for p in self._abandoned:
                p.handle._settle()
            self._abandoned.clear()

    def _take(self, which: Callable[[P], bool]) -> list[P]:
        """Remove and return the reads not finished yet that ``which`` picks (under the lock)."""
        hit = [p for p in self._pending if which(p)]
        self._pending = [p for p in self._pending if not which(p)]
        return hit

    # -- the thread --------------------------------------------------------------
    def _succeeded_or_late(self, p: P, now: float, running: int, what: str) -> bool:
        """The end of a poll that found no failure: with nothing ``running`` the
        read succeeded (finished and settled); past its deadline it is given up
        on (``what`` says what still runs); else it is still polled (False)."""
        if not running:
            p.handle._finish(None)
            p.handle._settle()
            return True
        if now > p.deadline:
            with self._cond:
                self._give_up(p, f"{self.label} read from peer {p.peer} timed out after {p.timeout_s:g}s ({what})",
                              ReadFailure.TIMEOUT)
            return True
        return False

    def _give_up(self, p: P, reason: str, failure: ReadFailure = ReadFailure.TRANSPORT) -> None:
        """Finish ``p`` with ``reason`` (for ``failure``); settled now if the library let go of
        all its transfers, else once it does. Under the condition's lock."""
        if p.handle._finish(reason, failure):
            logger.warning("%s read from peer %s: %s", self.label, p.peer, reason)
        if self._let_go(p):
            self._abandoned.append(p)
        else:
            p.handle._settle()

    def _run(self) -> None:
        delay = self._min
        while True:
            with self._cond:
                if self._stopped:
                    return
                if not self._has_new() and not self._pending and not self._abandoned:
                    self._cond.wait(self._idle)
                    delay = self._min
                    continue
                has_new = self._has_new()
            if has_new:
                self._start_new()
            with self._cond:
                pending = list(self._pending)
                abandoned = list(self._abandoned)
            now = time.monotonic()
            finished = []
            for p in pending:
                try:
                    if p.handle.done():  # finished elsewhere (peer removed, closed, start failed)
                        with self._cond:
                            self._give_up(p, p.handle.error or "finished")
                        finished.append(p)
                    elif self._poll(p, now):
                        finished.append(p)
                except Exception as exc:  # a broken transfer object must not kill the thread
                    logger.exception("%s state poll failed for peer %s", self.label, p.peer)
                    with self._cond:
                        self._give_up(p, f"{self.label} state poll failed: {type(exc).__name__}: {exc}")
                    finished.append(p)
            quiet = [p for p in abandoned if self._quiet(p)]
            for p in quiet:
                p.handle._settle()
            with self._cond:
                gone = {id(p) for p in finished}
                self._pending = [p for p in self._pending if id(p) not in gone]
                gone = {id(p) for p in quiet}
                self._abandoned = [p for p in self._abandoned if id(p) not in gone]
                delay = self._next_delay(delay, bool(finished or quiet), now)
                if self._stopped:
                    return
                if not self._has_new():
                    self._cond.wait(delay)


PeerT = TypeVar("PeerT")


class RdmaPeers(abc.ABC, Generic[PeerT]):
    """The peer side both RDMA backends share: a peer's plan (descriptor
    lists, sessions, its imported engine or agent) is made once and dropped
    with the peer, after its reads in flight were failed. A backend keeps
    ``_peers`` (peer id -> peer) under ``_lock`` and a ``_tracker``, and says
    how a peer's plan is released (:meth:`_release_peer`)."""

    label = "RDMA"
    key: str
    _lock: Any
    _peers: dict[str, PeerT]
    _tracker: CompletionThread[Any]

    @abc.abstractmethod
    def _release_peer(self, peer: PeerT) -> None:
        """Release what was planned for ``peer`` (its reads are failed already)."""

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is None:
                return
            self._forget(peer_id, peer, "peer removed")
        logger.info("%s %s removed peer %s", self.label, self.key, peer_id)

    def _forget(self, peer_id: str, peer: PeerT, reason: str) -> None:
        """Drop ``peer``: fail its reads in flight, then release its plan."""
        self._peers.pop(peer_id, None)
        self._tracker.fail_peer(peer_id, f"{self.label} read from peer {peer_id} aborted: {reason}")
        self._release_peer(peer)


def teardown(tracker: CompletionThread[Any], reason: str, *steps: Callable[[], Any]) -> None:
    """The order both RDMA backends close in: fail the reads in flight and
    stop the completion thread first (nothing is started or polled any more),
    then release the library's objects, one ``step`` after the other (each
    failure logged, the next step still run)."""
    tracker.close(reason)
    for step in steps:
        try:
            step()
        except Exception:
            name = getattr(getattr(step, "func", step), "__name__", repr(step))
            logger.warning("%s: teardown step %s failed", reason, name, exc_info=True)
