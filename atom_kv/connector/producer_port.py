"""The prefill rank's answers on its handshake port: the
:class:`~atom_kv.connector.handshake_port.PortHandler` a
:class:`~atom_kv.connector.producer.ProducerWorker` hands its
:class:`~atom_kv.connector.handshake.HandshakeServer`."""

from __future__ import annotations

from typing import Callable, Optional, Protocol

from atom_kv.connector.handshake_port import BasePortHandler
from atom_kv.wire import BlocksAnswer, BlocksQuery, DoneAck, DoneReading, HandshakeReply, HandshakeRequest, Issued, Release

__all__ = ["ProducerPort", "ProducerRank"]


class BlocksAnswerer(Protocol):
    """What answers a blocks query (:class:`~atom_kv.connector.producer_rendezvous.Rendezvous`)."""

    def on_query(self, msg: BlocksQuery, respond: Callable[[BlocksAnswer], None], source: str = "") -> None: ...


class ProducerRank(Protocol):
    """What :class:`ProducerPort` needs of a :class:`~atom_kv.connector.producer.ProducerWorker`
    (named here so that this module does not import the worker's)."""

    engine_id: str
    tp_rank: int

    def _answer_handshake(self, req: HandshakeRequest) -> HandshakeReply: ...

    def _on_done_reading(self, msg: DoneReading, respond: Optional[Callable[[DoneAck], None]]) -> None: ...

    def _on_release(self, msg: Release) -> None: ...

    def _on_issued(self, msg: Issued) -> None: ...

    @property
    def rendezvous(self) -> "BlocksAnswerer": ...

    def _expire_deferred(self) -> None: ...


class ProducerPort(BasePortHandler):
    """Routes each checked message of a producer rank's handshake port to the
    worker's bookkeeping; owns nothing but the reference to its worker."""

    def __init__(self, worker: ProducerRank) -> None:
        self._worker = worker

    def identity(self) -> tuple[str, int]:
        return self._worker.engine_id, self._worker.tp_rank

    def answer_handshake(self, request: HandshakeRequest) -> HandshakeReply:
        return self._worker._answer_handshake(request)

    def on_done(self, msg: DoneReading, respond: Optional[Callable[[DoneAck], None]]) -> None:
        self._worker._on_done_reading(msg, respond)

    def on_release(self, msg: Release) -> None:
        self._worker._on_release(msg)

    def on_issued(self, msg: Issued) -> None:
        self._worker._on_issued(msg)

    def on_blocks(self, query: BlocksQuery, respond: Callable[[BlocksAnswer], None], source: str) -> None:
        self._worker.rendezvous.on_query(query, respond, source)

    def on_tick(self) -> None:
        self._worker._expire_deferred()
