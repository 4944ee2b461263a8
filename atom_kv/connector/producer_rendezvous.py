"""The producer rank's side of the rendezvous: answering which blocks hold a transfer.

A decode leg sent while its prefill computes asks a producer rank, with a
:class:`~atom_kv.wire.BlocksQuery`, which blocks hold its transfer. The rank
answers at once when it knows them, holds the question (bounded) until its
scheduler lends them, answers "still coming" when the wait ends while its
scheduler still has the request queued or computing, and says why not when the
transfer was released or never admitted here. A found answer carries a promise
(:class:`~atom_kv.connector.producer_transfers.Promise`): the blocks stay for
``lease_ms`` whatever a third party's release says (:meth:`Rendezvous.pin_locked`
says why a read inside it needs no confirmation).

:class:`Rendezvous` is handed the rank's
:class:`~atom_kv.connector.producer_transfers.TransferTable` (and its lock) by
:class:`~atom_kv.connector.producer.ProducerWorker`, and owns the waiting
questions (bounded per asking address by
:class:`~atom_kv.connector.blocks_waits.WaitingQueries`).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from atom_kv.config import KVTransferConfig
from atom_kv.connector.blocks_waits import Answer, WaitingQueries, WaitingQuery
from atom_kv.connector.producer_transfers import MAX_DEFERRED_TRANSFERS, Promise, Stage, TransferTable
from atom_kv.connector.reasons import QueryRefusal
from atom_kv.wire import BlocksAnswer, BlocksQuery, Release

__all__ = ["MAX_QUERIES_PER_TRANSFER", "PIN_MARGIN_S", "Rendezvous"]

#: questions waiting on one transfer, at most
MAX_QUERIES_PER_TRANSFER = 64

#: the part of the scheduler's lease a rendezvous promise never uses: the scheduler started the lease
#: up to a step before this rank learnt it, and frees on its own clock
PIN_MARGIN_S = 1.0


class Rendezvous:
    """Owns a producer rank's answers to blocks queries, the questions that wait and the promises
    given (kept on the transfers' records in the table it is handed). ``*_locked`` methods run
    under ``table.lock``; the others take it."""

    def __init__(self, table: TransferTable, config: KVTransferConfig, *, name: str, tp_rank: int,
                 pp_size: int, engine_id: Callable[[], str]) -> None:
        self._table = table
        self._lock = table.lock
        self._config = config
        self._tp_rank = tp_rank
        self._pp_size = pp_size
        self._engine_id = engine_id
        self.queries = WaitingQueries(name, capacity=MAX_DEFERRED_TRANSFERS,
                                      per_source=config.limits.rendezvous_max_waiting_per_source,
                                      per_transfer=MAX_QUERIES_PER_TRANSFER)

    # ------------------------------------------------------------------
    def on_query(self, msg: BlocksQuery, respond: Callable[[BlocksAnswer], None], source: str = "") -> None:
        """A decode rank asks which blocks hold a transfer (the handshake server's thread)."""
        wait_s = min(msg.wait_ms / 1000.0, self._config.prefill_wait_timeout_s)
        with self._lock:
            answer = self._answer_locked(msg)
            if answer is None and wait_s <= 0 and self._table.stage(msg.transfer_id) is Stage.COMING:
                answer = self._still_coming(msg)
            if answer is None and wait_s > 0:
                why = self.queries.add_locked(msg, respond, source, wait_s)  # None: it waits
                if why is not None:
                    answer = self.not_found(msg, *why)
            elif answer is None:
                answer = self._unknown(msg)
            pushed_out = self.queries.pushed_out_locked()
        self.answer([self._unknown(q.msg, q) for q in pushed_out])
        if answer is not None:
            self.answer([answer._replace(query=WaitingQuery(msg, respond, 0.0, source))])

    def _answer_locked(self, msg: BlocksQuery) -> Optional[Answer]:
        """The blocks of the queried transfer, why they are gone, or None while the rank has not learnt it."""
        tid = msg.transfer_id
        rec = self._table.get(tid)
        if rec is None:
            return None
        if rec.stage.refused:
            return self.not_found(msg, QueryRefusal.RELEASED, f"producer released transfer {tid} ({rec.why})")
        if rec.blocks is None:
            return None
        return Answer(None, BlocksAnswer(transfer_id=tid, tp_rank=self._tp_rank, found=True,
                                         block_ids=list(rec.blocks), pp_size=self._pp_size,
                                         first_token_ids=list(rec.first_tokens),
                                         lease_ms=self.pin_locked(tid, msg.engine_id)), None)

    def pin_locked(self, tid: str, consumer: str) -> int:
        """Promise ``consumer`` the blocks of ``tid`` for a while; the promise's length in ms (0: none).

        Why a consumer may trust a read that ended inside the promise without asking for a
        confirmation: the rank's blocks are freed only when (a) the scheduler's lease expires,
        (b) every consumer rank counted done, or (c) a release is taken. (a) cannot happen inside
        the promise: it ends :data:`PIN_MARGIN_S` before the lease as this rank reckons it, and the
        rank learnt the send no earlier than the scheduler started the lease. (b) needs this
        consumer's own done-reading notices, sent after its reads ended. (c): a release from this
        consumer's engine is taken at once (it comes only when that engine has ended or given up the
        load, and it discards what it read); any other (the proxy abandoning the pair) waits until
        the promise ends (``ProducerWorker._on_release``). Since every rank of an engine must report a
        transfer finished before its scheduler frees the blocks, the promise of the one rank asked
        covers the whole engine's copy. The consumer counts the promise from before it sent its
        question, so clock rates aside (a margin covers them) its window ends no later than ours.
        """
        rec = self._table.get(tid)
        if rec is None or rec.learnt is None:
            return 0
        now = time.monotonic()
        left = self._config.abort_timeout_s - (now - rec.learnt) - PIN_MARGIN_S
        hold = min(left, self._config.transfer_timeout_s)
        if hold < 0.1:
            return 0
        if rec.pin is None:
            self._table.pin(rec, Promise(now + hold, consumer))  # may end the oldest promise: its release goes on
        else:
            rec.pin.until = max(rec.pin.until, now + hold)
        return int(hold * 1000)

    def due_releases(self, now: float) -> list[Release]:
        """The releases that waited for a promise that has ended (for the caller to take)."""
        with self._lock:
            held = []
            for rec in [r for r in self._table.pinned() if r.pin is not None and r.pin.until <= now]:
                pin = self._table.unpin(rec)
                if pin is not None and pin.held is not None:
                    held.append(pin.held)
            return held + self._table.take_held()

    # ------------------------------------------------------------------
    def resolve_locked(self) -> list[Answer]:
        """Answers to the questions whose transfer the rank now knows (lent or released)."""
        def known(tid: str) -> bool:
            rec = self._table.get(tid)
            return rec is not None and (rec.blocks is not None or rec.stage.refused)

        found = []
        for q in self.queries.known_locked(known):
            answer = self._answer_locked(q.msg)
            found.append(answer._replace(query=q) if answer is not None else self._unknown(q.msg, q))
        return found

    def pop_locked(self, tid: str, why: str) -> list[Answer]:
        """Answers to every question waiting for ``tid``, released now (``why``)."""
        return [self.not_found(q.msg, QueryRefusal.RELEASED, f"producer {why}", q)
                for q in self.queries.pop_locked(tid)]

    def expire(self, now: float) -> None:
        """Answer the questions whose wait is over: "still coming" while the scheduler has it queued."""
        with self._lock:
            late = [self._still_coming(q.msg, q) if self._table.stage(q.msg.transfer_id) is Stage.COMING
                    else self._unknown(q.msg, q) for q in self.queries.late_locked(now)]
        self.answer(late)

    def answer(self, answers: list[Answer]) -> None:
        self.queries.answer(answers)  # outside the lock; logged at a bounded rate

    # ------------------------------------------------------------------
    def _still_coming(self, msg: BlocksQuery, q: Optional[WaitingQuery] = None) -> Answer:
        return Answer(q, BlocksAnswer(transfer_id=msg.transfer_id, tp_rank=self._tp_rank, found=False, coming=True,
                                      reason=f"transfer {msg.transfer_id} is still queued or computing on producer "
                                             f"{self._engine_id()} rank {self._tp_rank}"), None)

    def not_found(self, msg: BlocksQuery, refusal: QueryRefusal, reason: str,
                  q: Optional[WaitingQuery] = None) -> Answer:
        return Answer(q, BlocksAnswer(transfer_id=msg.transfer_id, tp_rank=self._tp_rank, found=False,
                                      reason=reason), refusal)

    def _unknown(self, msg: BlocksQuery, q: Optional[WaitingQuery] = None) -> Answer:
        return self.not_found(msg, QueryRefusal.UNISSUED,
                              f"transfer {msg.transfer_id} was not issued by producer {self._engine_id()} rank "
                              f"{self._tp_rank} within the wait (the prefill failed, is slow, or is elsewhere)", q)
