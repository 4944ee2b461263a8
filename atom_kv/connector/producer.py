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

What the rank knows of each transfer is one record in one bounded table
(:mod:`atom_kv.connector.producer_transfers`), whose stage moves
``COMING`` -> ``LENT`` -> ``READ`` -> ``RELEASED``. A refused confirmation says
why as a :class:`~atom_kv.connector.reasons.Refusal` next to the words on the
wire. The rendezvous (blocks queries, "still coming", and the promise a found
answer carries) is answered by a
:class:`~atom_kv.connector.producer_rendezvous.Rendezvous` handed the same table;
this module takes its releases: one from anyone but the promised consumer's
engine waits until the promise ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from atom_kv._ratelimit import RateLimitedLog
from atom_kv.connector.handshake import HandshakeError, HandshakeServer, compat_mismatch
from atom_kv.connector.handshake_port import PortSettings
from atom_kv.connector.producer_port import ProducerPort
from atom_kv.connector.producer_rendezvous import Rendezvous
from atom_kv.connector.producer_transfers import Deferred, Ending, Stage, TransferTable
from atom_kv.connector.reasons import Refusal
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

__all__ = ["ProducerWorker", "Verdict"]

logger = logging.getLogger(__name__)

#: confirmations waiting on one transfer, at most
MAX_DEFERRED_PER_TRANSFER = 64
#: longest a confirmation waits for the rank to learn its transfer
MAX_DEFER_S = 5.0


@dataclass(frozen=True)
class Verdict:
    """The answer to a confirmation: valid, or refused for a :class:`Refusal` in the operator's words."""

    refusal: Optional[Refusal] = None
    text: str = ""

    @property
    def valid(self) -> bool:
        return self.refusal is None


_VALID = Verdict()


class ProducerWorker(ConnectorWorker):
    """Owns a prefill rank's handshake server, its table of transfers (done-reading counts,
    releases, confirmations waiting) and the rendezvous answered from that table."""

    role = "kv_producer"

    _server: Optional[HandshakeServer] = None  # until _start() made it

    def _start(self) -> None:
        self._transfers = TransferTable(self._lock)
        self.rendezvous = Rendezvous(self._transfers, self.config, name=self._name, tp_rank=self.tp_rank,
                                     pp_size=self.pp_size, engine_id=lambda: self.engine_id)
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

    @property
    def transfers(self) -> TransferTable:
        """The rank's transfer records (hold ``transfers.lock`` to read them)."""
        return self._transfers

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
        table = self._transfers
        with self._lock:
            for tid in metadata.coming:
                if table.stage(tid) in (None, Stage.NOTICED, Stage.COMING):
                    table.record(tid).stage = Stage.COMING
            for send in metadata.sends:
                rec = table.get(send.transfer_id)
                if rec is not None and rec.stage.refused:
                    continue
                rec = table.record(send.transfer_id)
                rec.blocks = list(send.block_ids)
                if rec.stage is not Stage.READ:
                    rec.stage = Stage.LENT
                if rec.learnt is None:
                    rec.learnt = now
                if send.first_token_ids:
                    rec.first_tokens = list(send.first_token_ids[:MAX_FIRST_TOKENS])
            for tid in metadata.dropped:
                rec = table.get(tid)
                if rec is not None and rec.stage is Stage.COMING:
                    table.end(rec, Stage.DROPPED, Ending.DROPPED)
            for tid in metadata.released:  # the scheduler freed the blocks
                rec = table.record(tid)
                if rec.stage.refused:  # released or dropped before: its reason stays
                    table.end(rec, Stage.RELEASED, rec.ending or Ending.RELEASED, rec.why)
                else:
                    table.end(rec, Stage.RELEASED, Ending.READ if rec.stage is Stage.READ else Ending.LEASE_EXPIRED)
            answers = self._resolve_deferred_locked()
            found = self.rendezvous.resolve_locked()
        self._answer(answers)
        self.rendezvous.answer(found)
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
        base: dict[str, Any] = dict(engine_id=self.engine_id, tp_rank=self.tp_rank, tp_size=self.tp_size,
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
                respond(self._ack(msg, Verdict(Refusal.NOT_READ,
                                               "the consumer reported that it did not read the blocks")))
            return
        with self._lock:
            verdict = self._verdict_locked(msg)
            if verdict is None:
                rec = self._transfers.record(msg.transfer_id)
                if len(rec.deferred) < MAX_DEFERRED_PER_TRANSFER:
                    self._transfers.defer(rec, Deferred(msg, respond, time.monotonic() + self._defer_s))
                else:
                    verdict = Verdict(Refusal.CROWDED, f"too many confirmations wait for transfer {msg.transfer_id}")
            dropped = self._transfers.take_dropped()
        self._answer([(d, self._unissued(d.msg)) for d in dropped])
        if verdict is not None:
            self._answer([(Deferred(msg, respond, 0.0), verdict)])

    def _on_issued(self, msg: Issued) -> None:
        """The engine's scheduler lent these blocks (ahead of the metadata that says so)."""
        with self._lock:
            stage = self._transfers.stage(msg.transfer_id)
            if stage is not None and (stage.refused or stage.ended):
                return
            rec = self._transfers.record(msg.transfer_id)
            rec.blocks, rec.stage = list(msg.block_ids), Stage.LENT
            if rec.learnt is None:
                rec.learnt = time.monotonic()
            answers = self._resolve_deferred_locked()
            found = self.rendezvous.resolve_locked()
        self._answer(answers)
        self.rendezvous.answer(found)

    def _on_release(self, msg: Release) -> None:
        tid = msg.transfer_id
        why = f"released by {msg.sender or 'a peer'}" + (f" ({msg.reason})" if msg.reason else "")
        with self._lock:
            rec = self._transfers.get(tid)
            if rec is not None and (rec.stage.refused or rec.stage.ended):
                return  # idempotent: already counted or released
            pin = rec.pin if rec is not None else None
            if pin is not None and msg.sender != engine_sender("decode", pin.consumer):
                if time.monotonic() < pin.until:
                    pin.held = pin.held or msg  # applied when the promise ends, unless the reads end first
                    logger.info("%s: transfer %s %s; holding its blocks until the rendezvous lease given to "
                                "engine %s ends", self._name, tid, why, pin.consumer)
                    return
            rec = self._transfers.record(tid)
            self._transfers.end(rec, Stage.RELEASED, Ending.RELEASED, why)
            self._finished_send.append(tid)
            waiting = self._transfers.undefer(rec)
            queries = self.rendezvous.pop_locked(tid, why)
        self._wake()
        logger.info("%s: transfer %s %s; freeing its blocks", self._name, tid, why)
        self.rendezvous.answer(queries)
        self._answer([(d, Verdict(Refusal.RELEASED, f"producer {why} before the read was confirmed"))
                      for d in waiting])

    # ------------------------------------------------------------------
    def _ack(self, msg: DoneReading, verdict: Verdict) -> DoneAck:
        return DoneAck(transfer_id=msg.transfer_id, tp_rank=self.tp_rank, valid=verdict.valid, reason=verdict.text)

    def _unissued(self, msg: DoneReading) -> Verdict:
        return Verdict(Refusal.UNISSUED, f"transfer {msg.transfer_id} was not issued by producer {self.engine_id} "
                                         f"rank {self.tp_rank}")

    def _verdict_locked(self, msg: DoneReading) -> Optional[Verdict]:
        """The answer to a confirmation, or None while the rank has not learnt the transfer."""
        tid = msg.transfer_id
        rec = self._transfers.get(tid)
        if rec is None:
            return None
        if rec.stage.refused:
            return Verdict(Refusal.RELEASED,
                           f"producer released transfer {tid} before the read was confirmed ({rec.why})")
        blocks = rec.blocks
        if blocks is None:
            return None
        end = msg.block_offset + msg.num_blocks
        if (msg.num_blocks <= 0 or msg.block_offset < 0 or end > len(blocks)
                or blocks_digest(blocks[msg.block_offset:end]) != msg.blocks_digest):
            return Verdict(Refusal.BLOCKS, f"the consumer read blocks that are not transfer {tid}'s (blocks "
                                           f"{msg.block_offset}..{end} of {len(blocks)}, digest mismatch)")
        return _VALID

    def _resolve_deferred_locked(self) -> list[tuple[Deferred, Verdict]]:
        answers = []
        for rec in [r for r in self._transfers.deferring() if r.blocks is not None or r.stage.refused]:
            for d in self._transfers.undefer(rec):
                verdict = self._verdict_locked(d.msg)
                answers.append((d, verdict if verdict is not None else self._unissued(d.msg)))
        return answers

    def _expire_deferred(self) -> None:
        """Answer the confirmations and blocks queries that waited too long, and take the releases
        whose promise ended (the handshake server calls it between polls)."""
        now = time.monotonic()
        self.rendezvous.expire(now)
        for msg in self.rendezvous.due_releases(now):
            self._on_release(msg)
        with self._lock:
            answers = [(d, self._unissued(d.msg)) for d in self._transfers.take_dropped()]
            for rec in self._transfers.deferring():
                late = [d for d in rec.deferred if d.deadline <= now]
                if late:
                    self._transfers.keep_deferred(rec, [d for d in rec.deferred if d.deadline > now])
                    answers += [(d, self._unissued(d.msg)) for d in late]
        self._answer(answers)

    def _answer(self, answers: list[tuple[Deferred, Verdict]]) -> None:
        for d, verdict in answers:
            if verdict.refusal is None:
                self._count_done(d.msg)
            else:
                self._refusals.event(verdict.refusal.value, f"{self._name}: not confirming the read of transfer "
                                     f"{d.msg.transfer_id} by engine {d.msg.engine_id} rank {d.msg.tp_rank}: "
                                     f"{verdict.text}")
            try:
                d.respond(self._ack(d.msg, verdict))
            except Exception:
                logger.exception("%s: answering a confirmation of transfer %s failed", self._name, d.msg.transfer_id)

    def _count_done(self, msg: DoneReading) -> None:
        with self._lock:
            rec = self._transfers.get(msg.transfer_id)
            if rec is not None and rec.stage.ended:
                return
            rec = self._transfers.record(msg.transfer_id)  # bounded even if notices never complete
            if not self._transfers.count_done(rec, msg.tp_rank, msg.tp_size):
                return
            if rec.stage.refused:  # dropped: it stays refused, now counted too
                self._transfers.end(rec, Stage.RELEASED, rec.ending or Ending.DROPPED, rec.why)
            else:  # its blocks stay known: a late confirmation still finds them
                self._transfers.end(rec, Stage.READ, Ending.READ)
            self._finished_send.append(msg.transfer_id)
        self._wake()
        logger.debug("%s: transfer %s read by all %d consumer ranks (last %s)", self._name, msg.transfer_id,
                     msg.tp_size, "ok" if msg.ok else "gave up")

    # ------------------------------------------------------------------
    def _expire_locked(self, now: float) -> None:
        self._transfers.expire_counts(now - 2 * self.config.abort_timeout_s)

    def _close_role(self) -> None:
        if self._server is not None:
            self._server.close()
        self._close_backend()
