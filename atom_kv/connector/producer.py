"""The producer (prefill) side of the worker connector, one per TP rank.

The rank serves its handshake port: it answers handshakes with its backend
descriptor and registered regions, counts done-reading notices per transfer
until every consumer rank reported (then the transfer is in
``finished_sending``), takes releases (nobody will read the transfer: it is
in ``finished_sending`` at once), and answers confirmations.

A read is confirmed (``DoneAck(valid=True)``) only when all of these hold:

- the transfer is one this rank issued: learnt from ``ConnectorMetadata.sends``
  in ``start_load_kv`` (or from the engine's scheduler directly, an
  :class:`~atom_kv.wire.Issued` notice, for engines that send metadata only
  with a batch). A notice that arrives before the rank learnt it is not
  refused: its answer waits (bounded) for the rank to learn it;
- the consumer read that transfer's blocks (the notice's digest of the block
  ids it read matches);
- the blocks were not released before the notice arrived: by a release
  message, or by the scheduler (``ConnectorMetadata.released``, learnt in
  ``start_load_kv`` before the step's forward can overwrite them).

The rendezvous (blocks queries, "still coming", and the promise a found answer
carries) is answered by :mod:`atom_kv.connector.producer_rendezvous`; this
module takes its releases: one from anyone but the promised consumer's engine
waits until the promise ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from atom_kv._lru import BoundedDict
from atom_kv._ratelimit import RateLimitedLog
from atom_kv.connector.handshake import HandshakeError, HandshakeServer, compat_mismatch
from atom_kv.connector.blocks_waits import WaitingQueries
from atom_kv.connector.handshake_port import PortSettings
from atom_kv.connector.producer_port import ProducerPort
from atom_kv.connector.producer_rendezvous import MAX_QUERIES_PER_TRANSFER, Promise, RendezvousAnswers
from atom_kv.connector.release import engine_sender
from atom_kv.connector.types import ConnectorMetadata, KVConnectorOutput
from atom_kv.connector.worker import ConnectorWorker
from atom_kv.transfer.memory import pair_refusal
from atom_kv.wire import (
    DoneAck,
    DoneReading,
    HandshakeReply,
    HandshakeRequest,
    MAX_FIRST_TOKENS,
    Issued,
    Release,
    blocks_digest,
)

__all__ = ["ProducerWorker"]

logger = logging.getLogger(__name__)

#: transfers with some but not all done-reading notices, at most
MAX_PARTIAL_DONE = 65536
#: finished or released transfer ids remembered, at most
MAX_REMEMBERED = 65536
#: transfers whose confirmations wait for the rank to learn them, at most
MAX_DEFERRED_TRANSFERS = 4096
#: confirmations waiting on one transfer, at most
MAX_DEFERRED_PER_TRANSFER = 64
#: longest a confirmation waits for the rank to learn its transfer
MAX_DEFER_S = 5.0

_LEASE_EXPIRED = "its lease expired after abort_timeout_s"
_DROPPED = "the prefill request ended without lending blocks for the decode"
@dataclass
class _DoneState:
    ranks: set[int] = field(default_factory=set)
    tp_size: int = 1
    first_seen: float = field(default_factory=time.monotonic)


@dataclass
class _Deferred:
    """A confirmation asked for before the rank learnt the transfer."""

    msg: DoneReading
    respond: Callable[[DoneAck], None]
    deadline: float


class ProducerWorker(RendezvousAnswers, ConnectorWorker):
    """Owns a prefill rank's handshake server and the done-reading, release
    and confirmation bookkeeping of its transfers."""

    role = "kv_producer"

    _server: Optional[HandshakeServer] = None  # until _start() made it

    def _start(self) -> None:
        self._done: BoundedDict[str, _DoneState] = BoundedDict(MAX_PARTIAL_DONE)
        self._ended: BoundedDict[str, str] = BoundedDict(MAX_REMEMBERED)     # counted or released: tid -> how
        self._released: BoundedDict[str, str] = BoundedDict(MAX_REMEMBERED)  # reads no longer confirmed: tid -> why
        self._issued: BoundedDict[str, list[int]] = BoundedDict(MAX_REMEMBERED)  # live transfers' blocks
        self._first: BoundedDict[str, list[int]] = BoundedDict(MAX_REMEMBERED)  # their prefills' sampled tokens
        self._learnt: BoundedDict[str, float] = BoundedDict(MAX_REMEMBERED)  # when the rank learnt each send
        self._coming: BoundedDict[str, float] = BoundedDict(MAX_REMEMBERED)  # admitted, not yet sent
        self._pins: BoundedDict[str, Promise] = BoundedDict(MAX_DEFERRED_TRANSFERS, on_evict=self._pin_evicted)
        self._unpinned: list[Release] = []
        self._deferred: BoundedDict[str, list[_Deferred]] = BoundedDict(
            MAX_DEFERRED_TRANSFERS, on_evict=self._deferred_evicted)
        self._evicted: list[_Deferred] = []
        self._queries = WaitingQueries(self._name, capacity=MAX_DEFERRED_TRANSFERS,
                                       per_source=self.config.rendezvous_max_waiting_per_source,
                                       per_transfer=MAX_QUERIES_PER_TRANSFER)
        self._refusals = RateLimitedLog(logger, "refused confirmations")
        self._defer_s = min(MAX_DEFER_S, self.config.handshake_timeout_s / 2)
        try:
            self._server = self._handshake_server()
            self._server.start()
        except HandshakeError as exc:
            busy = self.ports.in_use("handshake", self.bind_host, exc)
            if busy is not None:
                raise busy from None
            raise

    def _handshake_server(self) -> HandshakeServer:
        return HandshakeServer(
            self._ctx, ProducerPort(self), bind_host=self.bind_host,
            port=self.ports.port("handshake"),  # the side-channel port: wire.handshake_port's layout
            auth_token=self.config.auth_token, stats=self.stats_, name=f"atom-kv-hs-server-tp{self.tp_rank}",
            settings=PortSettings.from_config(self.config),
        )

    @property
    def handshake_server(self) -> Optional[HandshakeServer]:
        return self._server

    def get_finished(self) -> KVConnectorOutput:
        """Also where this rank's KV counts as written: every engine calls it
        after each step's forward, from the thread (and current stream) that
        queued it, so the backend records its written event here and reads
        of these blocks wait for those writes on the device."""
        self.backend.kv_written()
        return super().get_finished()

    def _registered(self, memory: list[str]) -> None:
        # the backend's listeners (planned ports) open now, so a port in use fails at start, not at the
        # first handshake; a consumer's backend never exports, so it opens none
        self.backend.export_descriptor()

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        now = time.monotonic()
        with self._lock:
            for tid in metadata.coming:
                if tid not in self._issued and tid not in self._released:
                    self._coming[tid] = now
            for send in metadata.sends:
                self._coming.pop(send.transfer_id, None)
                if send.transfer_id not in self._released:
                    self._issued[send.transfer_id] = list(send.block_ids)
                    if send.transfer_id not in self._learnt:
                        self._learnt[send.transfer_id] = now
                    if send.first_token_ids:
                        self._first[send.transfer_id] = list(send.first_token_ids[:MAX_FIRST_TOKENS])
            for tid in metadata.dropped:
                if self._coming.pop(tid, None) is not None and tid not in self._issued and tid not in self._released:
                    self._released[tid] = _DROPPED
            for tid in metadata.released:
                self._forget_locked(tid)
                why = self._ended.get(tid) or _LEASE_EXPIRED
                self._ended[tid] = why
                if tid not in self._released:
                    self._released[tid] = why
            answers = self._resolve_deferred_locked()
            found = self._resolve_queries_locked()
        self._answer(answers)
        self._answer_queries(found)
        for spec in metadata.loads:  # only a consumer reads; a mis-wired engine hears so at once
            why = "this engine is not a kv_consumer"
            logger.warning("%s: request %s: cannot load remote KV: %s", self._name, spec.request_id, why)
            self._fail_load(spec.request_id, why)

    # ------------------------------------------------------------------
    # the handshake server's callbacks (its thread)
    # ------------------------------------------------------------------
    def _answer_handshake(self, req: HandshakeRequest) -> HandshakeReply:
        with self._lock:
            regions = list(self._kv.regions)
            memory = list(self._kv.memory)
        base = dict(engine_id=self.engine_id, tp_rank=self.tp_rank, tp_size=self.tp_size,
                    dp_rank=self.dp_rank, pp_rank=self.pp_rank, pp_size=self.pp_size, compat=self.compat,
                    backend=self.backend.name, host=self.host, memory=memory)
        error = compat_mismatch(self.compat, req.compat, "prefill", "decode")
        if error is None and not regions:
            error = "the producer has not registered its KV caches yet"
        if error is None and req.backend and req.backend != self.backend.name:
            error = f"transfer backend mismatch: {self.backend.name} (here) vs {req.backend} (peer)"
        if error is None:
            error = pair_refusal(self.backend.name, self.backend.memory_kinds, req.memory, "decode engine")
        if error is not None:
            logger.warning("%s: refused handshake from engine %s rank %d: %s",
                           self._name, req.engine_id, req.tp_rank, error)
            return HandshakeReply(ok=False, error=error, **base)
        return HandshakeReply(ok=True, descriptor=self.backend.export_descriptor(), regions=regions, **base)

    def _on_done_reading(self, msg: DoneReading, respond: Optional[Callable[[DoneAck], None]]) -> None:
        if respond is None or not msg.ok:
            self._count_done(msg)
            if respond is not None:
                respond(self._ack(msg, False, "the consumer reported that it did not read the blocks"))
            return
        with self._lock:
            verdict = self._verdict_locked(msg)
            if verdict is None:
                waiting = self._deferred.get(msg.transfer_id)
                if waiting is None:
                    waiting = self._deferred[msg.transfer_id] = []  # may evict the oldest transfer's
                if len(waiting) < MAX_DEFERRED_PER_TRANSFER:
                    waiting.append(_Deferred(msg, respond, time.monotonic() + self._defer_s))
                else:
                    verdict = self._ack(msg, False, f"too many confirmations wait for transfer {msg.transfer_id}")
            evicted, self._evicted = self._evicted, []
        self._answer([(d, self._unissued(d.msg)) for d in evicted])
        if verdict is not None:
            self._answer([(_Deferred(msg, respond, 0.0), verdict)])

    def _on_issued(self, msg: Issued) -> None:
        """The engine's scheduler lent these blocks (ahead of the metadata that says so)."""
        with self._lock:
            if msg.transfer_id in self._released or msg.transfer_id in self._ended:
                return
            self._issued[msg.transfer_id] = list(msg.block_ids)
            if msg.transfer_id not in self._learnt:
                self._learnt[msg.transfer_id] = time.monotonic()
            self._coming.pop(msg.transfer_id, None)
            answers = self._resolve_deferred_locked()
            found = self._resolve_queries_locked()
        self._answer(answers)
        self._answer_queries(found)

    def _on_release(self, msg: Release) -> None:
        tid = msg.transfer_id
        why = f"released by {msg.sender or 'a peer'}" + (f" ({msg.reason})" if msg.reason else "")
        with self._lock:
            if tid in self._released or tid in self._ended:
                return  # idempotent: already counted or released
            pin = self._pins.get(tid)
            if pin is not None and msg.sender != engine_sender("decode", pin.consumer):
                if time.monotonic() < pin.until:
                    pin.held = pin.held or msg  # applied when the promise ends, unless the reads end first
                    logger.info("%s: transfer %s %s; holding its blocks until the rendezvous lease given to "
                                "engine %s ends", self._name, tid, why, pin.consumer)
                    return
            self._forget_locked(tid)
            self._ended[tid] = why
            self._released[tid] = why
            self._finished_send.append(tid)
            waiting = self._deferred.pop(tid, None) or []
            queries = self._queries.pop_locked(tid)
        self._wake()
        logger.info("%s: transfer %s %s; freeing its blocks", self._name, tid, why)
        self._answer_queries([(q, self._not_found(q.msg, f"producer {why}")) for q in queries])
        self._answer([(d, self._ack(d.msg, False, f"producer {why} before the read was confirmed")) for d in waiting])

    # ------------------------------------------------------------------
    def _forget_locked(self, tid: str) -> None:
        """Drop what the rank keeps for a live transfer (it was counted, released or freed)."""
        self._done.pop(tid, None)
        self._issued.pop(tid, None)
        self._first.pop(tid, None)
        self._learnt.pop(tid, None)
        self._coming.pop(tid, None)
        self._pins.pop(tid, None)

    def _ack(self, msg: DoneReading, valid: bool, reason: str = "") -> DoneAck:
        return DoneAck(transfer_id=msg.transfer_id, tp_rank=self.tp_rank, valid=valid, reason=reason)

    def _unissued(self, msg: DoneReading) -> DoneAck:
        return self._ack(msg, False, f"transfer {msg.transfer_id} was not issued by producer {self.engine_id} "
                                     f"rank {self.tp_rank}")

    def _verdict_locked(self, msg: DoneReading) -> Optional[DoneAck]:
        """The answer to a confirmation, or None while the rank has not learnt the transfer."""
        tid = msg.transfer_id
        why = self._released.get(tid)
        if why is not None:
            return self._ack(msg, False, f"producer released transfer {tid} before the read was confirmed ({why})")
        blocks = self._issued.get(tid)
        if blocks is None:
            return None
        end = msg.block_offset + msg.num_blocks
        if (msg.num_blocks <= 0 or msg.block_offset < 0 or end > len(blocks)
                or blocks_digest(blocks[msg.block_offset:end]) != msg.blocks_digest):
            return self._ack(msg, False, f"the consumer read blocks that are not transfer {tid}'s (blocks "
                                         f"{msg.block_offset}..{end} of {len(blocks)}, digest mismatch)")
        return self._ack(msg, True)

    def _resolve_deferred_locked(self) -> list[tuple[_Deferred, DoneAck]]:
        answers = []
        for tid in [t for t in self._deferred if t in self._issued or t in self._released]:
            for d in self._deferred.pop(tid):
                verdict = self._verdict_locked(d.msg)
                answers.append((d, verdict if verdict is not None else self._unissued(d.msg)))
        return answers

    def _expire_deferred(self) -> None:
        """Answer the confirmations and blocks queries that waited too long (the handshake server calls
        it between polls)."""
        now = time.monotonic()
        self._expire_queries(now)
        self._end_pins(now)
        with self._lock:
            if not self._deferred:
                return
            answers = []
            for tid in list(self._deferred):
                waiting = self._deferred[tid]
                late = [d for d in waiting if d.deadline <= now]
                if not late:
                    continue
                waiting[:] = [d for d in waiting if d.deadline > now]
                if not waiting:
                    del self._deferred[tid]
                answers += [(d, self._unissued(d.msg)) for d in late]
        self._answer(answers)

    def _deferred_evicted(self, _tid: str, waiting: list[_Deferred]) -> None:
        self._evicted.extend(waiting)  # answered by the caller, outside the lock

    def _answer(self, answers: list[tuple[_Deferred, DoneAck]]) -> None:
        for d, ack in answers:
            if ack.valid:
                self._count_done(d.msg)
            else:
                self._refusals.event(_refusal_key(ack.reason), f"{self._name}: not confirming the read of transfer "
                                     f"{ack.transfer_id} by engine {d.msg.engine_id} rank {d.msg.tp_rank}: "
                                     f"{ack.reason}")
            try:
                d.respond(ack)
            except Exception:
                logger.exception("%s: answering a confirmation of transfer %s failed", self._name, ack.transfer_id)

    def _count_done(self, msg: DoneReading) -> None:
        with self._lock:
            if msg.transfer_id in self._ended:
                return
            st = self._done.get(msg.transfer_id)
            if st is None:  # bounded even if notices never complete
                st = _DoneState(tp_size=msg.tp_size)
                self._done[msg.transfer_id] = st
            st.ranks.add(msg.tp_rank)
            if len(st.ranks) < st.tp_size:
                return
            del self._done[msg.transfer_id]  # its blocks stay known: a late confirmation still finds them
            self._first.pop(msg.transfer_id, None)
            self._learnt.pop(msg.transfer_id, None)
            self._pins.pop(msg.transfer_id, None)  # a release held for the promise is moot now
            self._ended[msg.transfer_id] = "every consumer rank had finished reading"
            self._finished_send.append(msg.transfer_id)
        self._wake()
        logger.debug("%s: transfer %s read by all %d consumer ranks (last %s)", self._name, msg.transfer_id,
                     msg.tp_size, "ok" if msg.ok else "gave up")

    # ------------------------------------------------------------------
    def _expire_locked(self, now: float) -> None:
        stale = [t for t, s in self._done.items() if now - s.first_seen > 2 * self.config.abort_timeout_s]
        for tid in stale:
            del self._done[tid]

    def _close_role(self) -> None:
        if self._server is not None:
            self._server.close()
        self._close_backend()


def _refusal_key(reason: str) -> str:
    if "released" in reason:
        return "released"
    if "not issued" in reason:
        return "unissued"
    if "digest" in reason:
        return "blocks"
    return "other"
