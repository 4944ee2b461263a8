"""The producer rank's side of the rendezvous: answering which blocks hold a transfer.

A decode leg sent while its prefill computes asks a producer rank, with a
:class:`~atom_kv.wire.BlocksQuery`, which blocks hold its transfer. The rank
answers at once when it knows them, holds the question (bounded) until its
scheduler lends them, answers "still coming" when the wait ends while its
scheduler still has the request queued or computing, and says why not when the
transfer was released or never admitted here. A found answer carries a promise
(:class:`Promise`): the blocks stay for ``lease_ms`` whatever a third party's
release says (:meth:`RendezvousAnswers._pin_locked` says why a read inside it
needs no confirmation).

:class:`RendezvousAnswers` is a part of
:class:`~atom_kv.connector.producer.ProducerWorker`, split out by concern: it
works on the worker's lock and transfer tables (``_issued``, ``_released``,
``_first``, ``_learnt``, ``_coming``, ``_pins``, ``_queries``: the waiting
questions, bounded per asking address by
:class:`~atom_kv.connector.blocks_waits.WaitingQueries`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from atom_kv.connector.blocks_waits import WaitingQuery
from atom_kv.wire import BlocksAnswer, BlocksQuery, Release

__all__ = ["PIN_MARGIN_S", "Promise", "RendezvousAnswers", "WaitingQuery"]

logger = logging.getLogger("atom_kv.connector.producer")

#: questions waiting on one transfer, at most
MAX_QUERIES_PER_TRANSFER = 64

#: the part of the scheduler's lease a rendezvous promise never uses: the scheduler started the lease
#: up to a step before this rank learnt it, and frees on its own clock
PIN_MARGIN_S = 1.0


@dataclass
class Promise:
    """A rendezvous promise: the blocks stay until ``until`` whatever a third party's release says."""

    until: float
    consumer: str                       # the asking engine's id: its own notices end the promise early
    held: Optional[Release] = None      # a third party's release that waits for the promise to end


class RendezvousAnswers:
    """Owns the producer rank's answers to blocks queries and its rendezvous promises."""

    # ------------------------------------------------------------------
    # the rendezvous: a decode rank asks which blocks hold a transfer
    # ------------------------------------------------------------------
    def _on_blocks_query(self, msg: BlocksQuery, respond: Callable[[BlocksAnswer], None], source: str = "") -> None:
        wait_s = min(msg.wait_ms / 1000.0, self.config.prefill_wait_timeout_s)
        with self._lock:
            answer = self._blocks_answer_locked(msg)
            if answer is None and wait_s <= 0 and msg.transfer_id in self._coming:
                answer = self._still_coming(msg)
            if answer is None and wait_s > 0:
                why = self._queries.add_locked(msg, respond, source, wait_s)  # None: it waits
                if why is not None:
                    answer = self._not_found(msg, why)
            elif answer is None:
                answer = self._unknown(msg)
            pushed_out = self._queries.pushed_out_locked()
        self._answer_queries([(q, self._unknown(q.msg)) for q in pushed_out])
        if answer is not None:
            self._answer_queries([(WaitingQuery(msg, respond, 0.0, source), answer)])

    def _blocks_answer_locked(self, msg: BlocksQuery) -> Optional[BlocksAnswer]:
        """The blocks of the queried transfer, why they are gone, or None while the rank has not learnt it."""
        tid = msg.transfer_id
        why = self._released.get(tid)
        if why is not None:
            return self._not_found(msg, f"producer released transfer {tid} ({why})")
        blocks = self._issued.get(tid)
        if blocks is None:
            return None
        return BlocksAnswer(transfer_id=tid, tp_rank=self.tp_rank, found=True, block_ids=list(blocks),
                            pp_size=self.pp_size, first_token_ids=self._first.get(tid, []),
                            lease_ms=self._pin_locked(tid, msg.engine_id))

    def _pin_locked(self, tid: str, consumer: str) -> int:
        """Promise ``consumer`` the blocks of ``tid`` for a while; the promise's length in ms (0: none).

        Why a consumer may trust a read that ended inside the promise without asking for a
        confirmation: the rank's blocks are freed only when (a) the scheduler's lease expires,
        (b) every consumer rank counted done, or (c) a release is taken. (a) cannot happen inside
        the promise: it ends :data:`PIN_MARGIN_S` before the lease as this rank reckons it, and the
        rank learnt the send no earlier than the scheduler started the lease. (b) needs this
        consumer's own done-reading notices, sent after its reads ended. (c): a release from this
        consumer's engine is taken at once (it comes only when that engine has ended or given up the
        load, and it discards what it read); any other (the proxy abandoning the pair) waits until
        the promise ends (:meth:`_on_release`). Since every rank of an engine must report a
        transfer finished before its scheduler frees the blocks, the promise of the one rank asked
        covers the whole engine's copy. The consumer counts the promise from before it sent its
        question, so clock rates aside (a margin covers them) its window ends no later than ours.
        """
        learnt = self._learnt.get(tid)
        if learnt is None:
            return 0
        now = time.monotonic()
        left = self.config.abort_timeout_s - (now - learnt) - PIN_MARGIN_S
        hold = min(left, self.config.transfer_timeout_s)
        if hold < 0.1:
            return 0
        pin = self._pins.get(tid)
        if pin is None:
            self._pins[tid] = Promise(now + hold, consumer)  # may evict the oldest promise: its release goes on
        else:
            pin.until = max(pin.until, now + hold)
        return int(hold * 1000)

    def _end_pins(self, now: float) -> None:
        """Take the releases that waited for a promise that has ended."""
        with self._lock:
            due = [tid for tid, pin in self._pins.items() if pin.until <= now]
            held = []
            for tid in due:
                pin = self._pins.pop(tid)
                if pin.held is not None:
                    held.append(pin.held)
            held += self._unpinned
            self._unpinned = []
        for msg in held:
            self._on_release(msg)

    def _pin_evicted(self, _tid: str, pin: Promise) -> None:
        if pin.held is not None:
            self._unpinned.append(pin.held)  # taken on the next tick

    def _still_coming(self, msg: BlocksQuery) -> BlocksAnswer:
        return BlocksAnswer(transfer_id=msg.transfer_id, tp_rank=self.tp_rank, found=False, coming=True,
                            reason=f"transfer {msg.transfer_id} is still queued or computing on producer "
                                   f"{self.engine_id} rank {self.tp_rank}")

    def _not_found(self, msg: BlocksQuery, reason: str) -> BlocksAnswer:
        return BlocksAnswer(transfer_id=msg.transfer_id, tp_rank=self.tp_rank, found=False, reason=reason)

    def _unknown(self, msg: BlocksQuery) -> BlocksAnswer:
        return self._not_found(msg, f"transfer {msg.transfer_id} was not issued by producer {self.engine_id} rank "
                                    f"{self.tp_rank} within the wait (the prefill failed, is slow, or is elsewhere)")

    def _resolve_queries_locked(self) -> list[tuple[WaitingQuery, BlocksAnswer]]:
        found = []
        for q in self._queries.known_locked(self._issued, self._released):
            answer = self._blocks_answer_locked(q.msg)
            found.append((q, answer if answer is not None else self._unknown(q.msg)))
        return found

    def _expire_queries(self, now: float) -> None:
        with self._lock:
            late = [(q, (self._still_coming if q.msg.transfer_id in self._coming else self._unknown)(q.msg))
                    for q in self._queries.late_locked(now)]
        self._answer_queries(late)

    def _answer_queries(self, answers: list[tuple[WaitingQuery, BlocksAnswer]]) -> None:
        self._queries.answer(answers)  # outside the lock; logged at a bounded rate
