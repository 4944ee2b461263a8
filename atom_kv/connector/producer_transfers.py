"""What a producer rank knows of each transfer: one record per transfer id, in one bounded table.

A :class:`Transfer` moves through its :class:`Stage`: a scheduler may say it is
``COMING`` (admitted, not yet computed), then ``LENT`` (its blocks are known and
reads of them are confirmed), ``READ`` (every consumer rank counted done; the
blocks stay known until the scheduler frees them) and ``RELEASED`` (freed or
released: reads are no longer confirmed). ``DROPPED`` is a prefill that ended
without lending its blocks; ``NOTICED`` a transfer only named by a peer's
notice so far. Why a transfer ended is an :class:`Ending` plus the operator's
words.

:class:`TransferTable` holds at most :data:`MAX_REMEMBERED` records; past it the
least recently changed goes whole. Promises (:class:`Promise`) and waiting
confirmations (:class:`Deferred`) are parts of a record, each kept for at most
:data:`MAX_DEFERRED_TRANSFERS` transfers: past that, the oldest promise ends (a
release it held is taken on the next tick) and the oldest transfer's waiting
confirmations are refused (:meth:`TransferTable.take_dropped`). The table is not
thread-safe: its owner holds :attr:`TransferTable.lock` around every call.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from atom_kv._lru import BoundedDict
from atom_kv.wire import DoneAck, DoneReading, Release

__all__ = [
    "MAX_DEFERRED_TRANSFERS",
    "MAX_REMEMBERED",
    "Deferred",
    "Ending",
    "Promise",
    "Stage",
    "Transfer",
    "TransferTable",
]

#: transfers remembered (live, finished or released), at most
MAX_REMEMBERED = 65536
#: transfers with a rendezvous promise, and transfers with waiting confirmations, at most (each)
MAX_DEFERRED_TRANSFERS = 4096


class Stage(enum.Enum):
    """Where a transfer is on this producer rank."""

    NOTICED = "noticed"    # named by a peer's notice or question only
    COMING = "coming"      # the scheduler admitted it; its blocks are not lent yet
    LENT = "lent"          # its blocks are lent: reads of them are confirmed
    READ = "read"          # every consumer rank counted done; the blocks stay known until freed
    DROPPED = "dropped"    # the prefill ended without lending blocks: reads are refused
    RELEASED = "released"  # freed or released: reads are refused

    @property
    def ended(self) -> bool:
        """Counted or released: done-reading notices and releases no longer change it."""
        return self in (Stage.READ, Stage.RELEASED)

    @property
    def refused(self) -> bool:
        """Reads of it are no longer confirmed, and a blocks query hears why."""
        return self in (Stage.DROPPED, Stage.RELEASED)


class Ending(enum.Enum):
    """Why a transfer left ``LENT``; the value is the operator's words (a release adds who sent it)."""

    READ = "every consumer rank had finished reading"
    RELEASED = "released by a peer"
    LEASE_EXPIRED = "its lease expired after abort_timeout_s"
    DROPPED = "the prefill request ended without lending blocks for the decode"


@dataclass
class Promise:
    """A rendezvous promise: the blocks stay until ``until`` whatever a third party's release says."""

    until: float
    consumer: str                       # the asking engine's id: its own notices end the promise early
    held: Optional[Release] = None      # a third party's release that waits for the promise to end


@dataclass
class Deferred:
    """A confirmation asked for before the rank learnt the transfer."""

    msg: DoneReading
    respond: Callable[[DoneAck], None]
    deadline: float


@dataclass(eq=False)
class Transfer:
    """Everything a producer rank keeps for one transfer id.

    ``blocks`` is set while the blocks are lent (``LENT``, and ``READ`` until the scheduler frees
    them); ``ending``/``why`` once the transfer was counted, dropped or released. The promise and
    the waiting confirmations are changed through :class:`TransferTable` (it bounds them)."""

    tid: str
    stage: Stage = Stage.NOTICED
    blocks: Optional[list[int]] = None
    first_tokens: list[int] = field(default_factory=list)   # the prefill's sampled tokens
    learnt: Optional[float] = None                           # when the rank learnt the send
    done_ranks: set[int] = field(default_factory=set)        # consumer ranks that reported done
    done_size: int = 1                                       # how many consumer ranks will
    done_since: Optional[float] = None                       # the first done-reading notice
    ending: Optional[Ending] = None
    why: str = ""                                            # the ending in the operator's words
    pin: Optional[Promise] = None
    deferred: list[Deferred] = field(default_factory=list)



class TransferTable:
    """Owns the records of one producer rank's transfers (bounded, module docstring) and
    :attr:`lock`, which every caller holds."""

    def __init__(self, lock: Optional[threading.Lock] = None, *, capacity: int = MAX_REMEMBERED,
                 max_parts: int = MAX_DEFERRED_TRANSFERS) -> None:
        self.lock = lock if lock is not None else threading.Lock()
        self._records: BoundedDict[str, Transfer] = BoundedDict(capacity, on_evict=self._evicted)
        # which records carry a promise / waiting confirmations / partial counts, oldest first:
        # the bounds on those parts and the scans over them (never over every record)
        self._pinned: BoundedDict[str, None] = BoundedDict(max_parts, on_evict=self._unpin_oldest)
        self._deferring: BoundedDict[str, None] = BoundedDict(max_parts, on_evict=self._undefer_oldest)
        self._counting: dict[str, None] = {}
        self._held: list[Release] = []       # releases whose promise was pushed out or forgotten
        self._refused: list[Deferred] = []   # confirmations pushed out or forgotten

    # ------------------------------------------------------------------
    def get(self, tid: str) -> Optional[Transfer]:
        return self._records.get(tid)

    def __contains__(self, tid: object) -> bool:
        return tid in self._records

    def __len__(self) -> int:
        return len(self._records)

    def record(self, tid: str) -> Transfer:
        """The record of ``tid`` (made now if new), as the newest: it is the last to be forgotten."""
        rec = self._records.get(tid)
        if rec is None:
            rec = self._records[tid] = Transfer(tid)  # may forget the oldest record
        else:
            self._records.touch(tid)
        return rec

    def stage(self, tid: str) -> Optional[Stage]:
        rec = self._records.get(tid)
        return None if rec is None else rec.stage

    def end(self, rec: Transfer, stage: Stage, ending: Ending, why: str = "") -> None:
        """Move ``rec`` to an ended stage (``READ``, ``DROPPED``, ``RELEASED``): its tokens, counts and
        promise go (a release the promise held is moot); its blocks stay known only while ``READ``
        (a late confirmation still finds them); its waiting confirmations stay to be answered."""
        rec.stage, rec.ending, rec.why = stage, ending, why or ending.value
        if stage is not Stage.READ:
            rec.blocks = None
        rec.first_tokens, rec.learnt = [], None
        self._drop_counts(rec)
        self.unpin(rec)
        self._records.touch(rec.tid)

    # ------------------------------------------------------------------
    # promises
    # ------------------------------------------------------------------
    def pin(self, rec: Transfer, promise: Promise) -> None:
        rec.pin = promise
        self._pinned[rec.tid] = None  # may end the oldest promise: its held release is taken next tick

    def unpin(self, rec: Transfer) -> Optional[Promise]:
        pin, rec.pin = rec.pin, None
        self._pinned.pop(rec.tid, None)
        return pin

    def pinned(self) -> Iterator[Transfer]:
        for tid in list(self._pinned):
            yield self._records[tid]

    def take_held(self) -> list[Release]:
        """The releases whose promise was pushed out (to take now)."""
        held, self._held = self._held, []
        return held

    # ------------------------------------------------------------------
    # confirmations waiting for the rank to learn their transfer
    # ------------------------------------------------------------------
    def defer(self, rec: Transfer, d: Deferred) -> None:
        if not rec.deferred:
            self._deferring[rec.tid] = None  # may refuse the oldest transfer's (take_dropped)
        rec.deferred.append(d)

    def undefer(self, rec: Transfer) -> list[Deferred]:
        waiting, rec.deferred = rec.deferred, []
        self._deferring.pop(rec.tid, None)
        return waiting

    def keep_deferred(self, rec: Transfer, waiting: list[Deferred]) -> None:
        rec.deferred = waiting
        if not waiting:
            self._deferring.pop(rec.tid, None)

    def deferring(self) -> Iterator[Transfer]:
        for tid in list(self._deferring):
            yield self._records[tid]

    def has_deferred(self) -> bool:
        return bool(self._deferring)

    def take_dropped(self) -> list[Deferred]:
        """The confirmations pushed out, or whose record was forgotten (to refuse now)."""
        dropped, self._refused = self._refused, []
        return dropped

    # ------------------------------------------------------------------
    # done-reading counts
    # ------------------------------------------------------------------
    def count_done(self, rec: Transfer, rank: int, tp_size: int) -> bool:
        """Count ``rank`` done for ``rec``; True once every consumer rank is."""
        if rec.done_since is None:
            rec.done_since, rec.done_size = time.monotonic(), tp_size
            self._counting[rec.tid] = None
        rec.done_ranks.add(rank)
        if len(rec.done_ranks) < rec.done_size:
            return False
        self._drop_counts(rec)
        return True

    def expire_counts(self, older_than: float) -> None:
        """Forget partial counts begun before ``older_than`` (their notices never completed)."""
        for tid in [t for t in self._counting if (self._records[t].done_since or 0.0) < older_than]:
            self._drop_counts(self._records[tid])

    def _drop_counts(self, rec: Transfer) -> None:
        rec.done_ranks, rec.done_since = set(), None
        self._counting.pop(rec.tid, None)

    # ------------------------------------------------------------------
    def _evicted(self, tid: str, rec: Transfer) -> None:
        self._pinned.pop(tid, None)
        self._deferring.pop(tid, None)
        self._counting.pop(tid, None)
        if rec.pin is not None and rec.pin.held is not None:
            self._held.append(rec.pin.held)
        self._refused.extend(rec.deferred)

    def _unpin_oldest(self, tid: str, _: None) -> None:
        rec = self._records.get(tid)
        if rec is not None and rec.pin is not None:
            if rec.pin.held is not None:
                self._held.append(rec.pin.held)
            rec.pin = None

    def _undefer_oldest(self, tid: str, _: None) -> None:
        rec = self._records.get(tid)
        if rec is not None:
            self._refused.extend(rec.deferred)
            rec.deferred = []
