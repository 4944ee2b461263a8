"""The blocks queries (the rendezvous) a producer rank holds until it learns their transfer.

Without a token anyone may ask, so what waits is bounded like every other
pre-authentication table (:class:`~atom_kv._fairshare.FairShares`): at most
``per_source`` queries per peer address (one more is answered at once) and
``capacity`` in all (past it, the oldest query of the address holding the
most is answered early, never a query of an address holding fewer), each
for its wait at most. Answers without blocks are logged at a bounded rate.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

from atom_kv._fairshare import FairShares
from atom_kv._lru import BoundedDict
from atom_kv._ratelimit import RateLimitedLog
from atom_kv.connector.reasons import QueryRefusal
from atom_kv.wire import BlocksAnswer, BlocksQuery

__all__ = ["Answer", "WaitingQueries", "WaitingQuery"]

logger = logging.getLogger("atom_kv.connector.producer")  # its answers are the producer rank's


@dataclass(eq=False)
class WaitingQuery:
    """A blocks query asked before the rank learnt the transfer."""

    msg: BlocksQuery
    respond: Callable[[BlocksAnswer], None]
    deadline: float
    source: str = ""


class Answer(NamedTuple):
    """An answer to send to ``query`` (None until the caller names it), and why it has no blocks
    (None when it has them or says they are still coming)."""

    query: Optional[WaitingQuery]
    answer: BlocksAnswer
    refusal: Optional[QueryRefusal]


class WaitingQueries:
    """Owns the waiting queries of one producer rank, their fair shares by
    address and the rate-limited log of answers without blocks. The
    ``*_locked`` methods run under the rank's lock; :meth:`answer` outside it."""

    def __init__(self, name: str, *, capacity: int, per_source: int, per_transfer: int) -> None:
        self._name = name
        self.per_source = per_source
        self.per_transfer = per_transfer
        self._queries: BoundedDict[str, list[WaitingQuery]] = BoundedDict(capacity, on_evict=self._evicted_transfer)
        self._shares = FairShares(capacity, per_source)
        self._by_source: dict[str, dict[int, WaitingQuery]] = {}
        self._pushed_out: list[WaitingQuery] = []  # answered by the caller, outside the lock
        self._log = RateLimitedLog(logger, "rendezvous answers without blocks", level=logging.INFO)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._queries

    def waiting_from(self, source: str) -> int:
        return self._shares.held(source)

    def add_locked(self, msg: BlocksQuery, respond: Callable[[BlocksAnswer], None], source: str,
                   wait_s: float) -> Optional[tuple[QueryRefusal, str]]:
        """Hold ``msg`` for ``wait_s``; or say why it cannot wait (then answer it at once)."""
        waiting = self._queries.get(msg.transfer_id)
        verdict = self._shares.admit(source)
        if verdict.evict == source:
            return QueryRefusal.SOURCE_FULL, (f"{self._shares.held(source)} queries from {source or 'this address'} "
                                              f"already wait (limits.rendezvous_max_waiting_per_source is {self.per_source})")
        if not verdict.ok:
            return QueryRefusal.FULL, (f"{self._shares.capacity} queries wait, none from an address holding more "
                                       f"than {source or 'this one'}")
        if waiting is not None and len(waiting) >= self.per_transfer:
            return QueryRefusal.CROWDED, f"too many queries wait for transfer {msg.transfer_id}"
        if verdict.evict is not None:
            self._push_out_locked(verdict.evict)
        if waiting is None:
            waiting = self._queries[msg.transfer_id] = []  # may evict the oldest transfer's
        q = WaitingQuery(msg, respond, time.monotonic() + wait_s, source)
        waiting.append(q)
        self._shares.add(source, False)
        self._by_source.setdefault(source, {})[id(q)] = q
        return None

    def pop_locked(self, transfer_id: str) -> list[WaitingQuery]:
        """Every query waiting for ``transfer_id`` (no longer waiting)."""
        queries = self._queries.pop(transfer_id, None) or []
        self._unwait(queries)
        return queries

    def known_locked(self, known: Callable[[str], bool]) -> list[WaitingQuery]:
        """The queries whose transfer is now ``known`` (no longer waiting)."""
        out: list[WaitingQuery] = []
        for tid in [t for t in self._queries if known(t)]:
            out += self.pop_locked(tid)
        return out

    def late_locked(self, now: float) -> list[WaitingQuery]:
        """The queries whose wait is over (no longer waiting)."""
        late: list[WaitingQuery] = []
        for tid in list(self._queries):
            waiting = self._queries[tid]
            gone = [q for q in waiting if q.deadline <= now]
            if not gone:
                continue
            self._unwait(gone)
            late += gone
            waiting[:] = [q for q in waiting if q.deadline > now]
            if not waiting:
                del self._queries[tid]
        return late

    def pushed_out_locked(self) -> list[WaitingQuery]:
        """The queries that made room for others (to answer now)."""
        out, self._pushed_out = self._pushed_out, []
        return out

    def _unwait(self, queries: list[WaitingQuery]) -> None:
        for q in queries:
            mine = self._by_source.get(q.source)
            if mine is not None and mine.pop(id(q), None) is not None:
                self._shares.remove(q.source, False)
                if not mine:
                    del self._by_source[q.source]

    def _push_out_locked(self, source: str) -> None:
        q = next(iter(self._by_source.get(source, {}).values()), None)
        if q is None:
            return
        self._unwait([q])
        waiting = self._queries.get(q.msg.transfer_id)
        if waiting is not None:
            waiting[:] = [w for w in waiting if w is not q]
            if not waiting:
                del self._queries[q.msg.transfer_id]
        self._pushed_out.append(q)

    def _evicted_transfer(self, _tid: str, waiting: list[WaitingQuery]) -> None:
        self._unwait(waiting)
        self._pushed_out.extend(waiting)

    def answer(self, answers: list[Answer]) -> None:
        """Send each answer (outside the lock); one without blocks is logged, at a bounded rate."""
        for q, answer, refusal in answers:
            assert q is not None, "an answer is sent to the query it answers"
            if refusal is not None:  # strangers can ask: one line per reason a while at most
                self._log.event(refusal.value, f"{self._name}: no blocks for transfer {answer.transfer_id} "
                                f"to engine {q.msg.engine_id} rank {q.msg.tp_rank} "
                                f"({q.source or 'unknown address'}): {answer.reason}")
            try:
                q.respond(answer)
            except Exception:
                logger.exception("%s: answering a blocks query for transfer %s failed", self._name,
                                 answer.transfer_id)
