"""The producer (prefill) side of the worker connector, one per TP rank.

The rank serves its handshake port: it answers handshakes with its backend
descriptor and registered regions, counts done-reading notices per transfer
until every consumer rank reported (then the transfer is in
``finished_sending``), and answers confirmations. A read is confirmed only if
the scheduler had not released the transfer's blocks (its lease expired)
before the notice arrived: releases arrive in ``ConnectorMetadata.released``,
learnt in ``start_load_kv`` before the step's forward can overwrite them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from atom_kv._lru import BoundedDict, BoundedSet
from atom_kv.config import KVTransferConfig
from atom_kv.connector.handshake import HandshakeServer, compat_mismatch, handshake_port
from atom_kv.connector.types import ConnectorMetadata
from atom_kv.connector.worker import ConnectorWorker
from atom_kv.wire import DoneAck, DoneReading, HandshakeReply, HandshakeRequest

__all__ = ["ProducerWorker"]

logger = logging.getLogger(__name__)

#: transfers with some but not all done-reading notices, at most
MAX_PARTIAL_DONE = 65536
#: finished or released transfer ids remembered, at most
MAX_REMEMBERED = 65536


@dataclass
class _DoneState:
    ranks: set[int] = field(default_factory=set)
    tp_size: int = 1
    first_seen: float = field(default_factory=time.monotonic)


class ProducerWorker(ConnectorWorker):
    """Owns a prefill rank's handshake server and the done-reading and
    release bookkeeping of its transfers."""

    role = "kv_producer"

    _server: Optional[HandshakeServer] = None  # until _start() made it

    def __init__(self, config: KVTransferConfig, *, bind_host: str = "0.0.0.0", **identity: Any) -> None:
        """``identity`` as for :class:`ConnectorWorker`; the handshake server listens on ``bind_host``."""
        self._bind_host = bind_host
        super().__init__(config, **identity)

    def _start(self) -> None:
        self._done: BoundedDict[str, _DoneState] = BoundedDict(MAX_PARTIAL_DONE)
        self._completed: BoundedSet[str] = BoundedSet(MAX_REMEMBERED)
        self._released: BoundedSet[str] = BoundedSet(MAX_REMEMBERED)  # transfers whose blocks the scheduler freed
        self._server = HandshakeServer(
            self._ctx,
            bind_host=self._bind_host,
            port=handshake_port(self.config.handshake_port, self.dp_rank, self.tp_size, self.tp_rank),
            auth_token=self.config.auth_token,
            responder=self._answer_handshake,
            on_done=self._on_done_reading,
            stats=self.stats_,
            name=f"atom-kv-hs-server-tp{self.tp_rank}",
        )

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        with self._lock:
            for tid in metadata.released:
                self._done.pop(tid, None)
                self._completed.add(tid)
                self._released.add(tid)
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
        base = dict(engine_id=self.engine_id, tp_rank=self.tp_rank, tp_size=self.tp_size,
                    dp_rank=self.dp_rank, compat=self.compat, backend=self.backend.name, host=self.host)
        error = compat_mismatch(self.compat, req.compat, "prefill", "decode")
        if error is None and not regions:
            error = "the producer has not registered its KV caches yet"
        if error is None and req.backend and req.backend != self.backend.name:
            error = f"transfer backend mismatch: {self.backend.name} (here) vs {req.backend} (peer)"
        if error is not None:
            logger.warning("%s: refused handshake from engine %s rank %d: %s",
                           self._name, req.engine_id, req.tp_rank, error)
            return HandshakeReply(ok=False, error=error, **base)
        return HandshakeReply(ok=True, descriptor=self.backend.export_descriptor(), regions=regions, **base)

    def _on_done_reading(self, msg: DoneReading) -> Optional[DoneAck]:
        ack: Optional[DoneAck] = None
        if msg.want_ack and msg.ok:
            # checked under the lock that start_load_kv marks releases under
            with self._lock:
                released = msg.transfer_id in self._released
            if released:
                why = (f"producer released transfer {msg.transfer_id} before the read was confirmed "
                       f"(lease expired after abort_timeout_s)")
                logger.warning("%s: consumer %s rank %d read transfer %s after its lease expired; "
                               "telling it the read is invalid", self._name, msg.engine_id, msg.tp_rank,
                               msg.transfer_id)
                ack = DoneAck(transfer_id=msg.transfer_id, tp_rank=self.tp_rank, valid=False, reason=why)
            else:
                ack = DoneAck(transfer_id=msg.transfer_id, tp_rank=self.tp_rank, valid=True)
        self._count_done(msg)
        return ack

    def _count_done(self, msg: DoneReading) -> None:
        with self._lock:
            if msg.transfer_id in self._completed:
                return
            st = self._done.get(msg.transfer_id)
            if st is None:  # bounded even if notices never complete
                st = _DoneState(tp_size=msg.tp_size)
                self._done[msg.transfer_id] = st
            st.ranks.add(msg.tp_rank)
            if len(st.ranks) < st.tp_size:
                return
            del self._done[msg.transfer_id]
            self._completed.add(msg.transfer_id)
            self._finished_send.append(msg.transfer_id)
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
