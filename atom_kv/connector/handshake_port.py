"""What a producer rank's handshake server is handed and what it hands on: the
:class:`PortHandler` that answers the checked messages (one object instead of a
callback per message), the :class:`PortSettings` of the port, and the
:class:`MessageContext` of the one message being handled."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import zmq

from atom_kv.connector.handshake_limits import PortLimits
from atom_kv.wire import BlocksAnswer, BlocksQuery, DoneAck, DoneReading, HandshakeReply, HandshakeRequest, Issued, Release

__all__ = ["BasePortHandler", "MessageContext", "PortHandler", "PortSettings"]


class PortHandler(Protocol):
    """What a handshake server asks of the rank it serves. Every method runs on
    the server's thread and must not block; a ``respond`` may be called later,
    from any thread."""

    def identity(self) -> tuple[str, int]:
        """The rank's current ``(engine_id, tp_rank)``."""

    def answer_handshake(self, request: HandshakeRequest) -> HandshakeReply:
        """The reply to a handshake (proven, when the port has a token)."""

    def on_done(self, msg: DoneReading, respond: Optional[Callable[[DoneAck], None]]) -> None:
        """A checked done-reading notice; ``respond`` is None unless it asked for a confirmation."""

    def on_release(self, msg: Release) -> None:
        """A checked release."""

    def on_issued(self, msg: Issued) -> None:
        """A checked issue notice from the engine's own scheduler."""

    def on_blocks(self, query: BlocksQuery, respond: Callable[[BlocksAnswer], None], source: str) -> None:
        """A checked blocks query (the rendezvous); ``source`` is the asker's address."""

    def on_tick(self) -> None:
        """Housekeeping between polls (at least every 0.2 s)."""


class BasePortHandler(ABC):
    """Defaults for the optional parts of :class:`PortHandler`: issue notices are
    ignored, blocks queries answered "not a kv_producer", no housekeeping. A subclass
    gives the required parts (``identity``, ``answer_handshake``, ``on_done``, ``on_release``)."""

    @abstractmethod
    def identity(self) -> tuple[str, int]:
        """(engine id, TP rank) of the rank this port serves."""

    def on_issued(self, msg: Issued) -> None:
        pass

    def on_blocks(self, query: BlocksQuery, respond: Callable[[BlocksAnswer], None], source: str) -> None:
        respond(BlocksAnswer(transfer_id=query.transfer_id, tp_rank=self.identity()[1], found=False,
                             reason="this engine is not a kv_producer"))

    def on_tick(self) -> None:
        pass


@dataclass(frozen=True)
class PortSettings:
    """A handshake port's timings and bounds: how long a challenge waits for its
    answer, the replay window of signed notices, how often refusals are logged,
    and the pre-authentication :class:`~atom_kv.connector.handshake_limits.PortLimits`."""

    challenge_ttl_s: float = 10.0
    auth_window_s: float = 30.0
    replay_entries: int = 65536
    log_interval_s: float = 10.0
    limits: PortLimits = field(default_factory=PortLimits)

    @classmethod
    def from_config(cls, cfg: Any) -> "PortSettings":
        return cls(challenge_ttl_s=cfg.handshake_timeout_s, auth_window_s=cfg.auth_window_s,
                   replay_entries=cfg.auth_replay_entries, limits=PortLimits.from_config(cfg))


@dataclass(frozen=True, slots=True)
class MessageContext:
    """The one message being handled: the ROUTER identity of the connection it
    came on (where answers go), its bytes as received, the sender's address and
    the connection's descriptor (what a proof of the token marks as a peer's)."""

    identity: bytes
    data: bytes
    source: str = ""
    fd: Optional[int] = None

    @staticmethod
    def origin(frame: zmq.Frame) -> tuple[str, Optional[int]]:
        """The sender's IP address (ZeroMQ's ``Peer-Address``, "" where unknown) and the descriptor of the
        connection (``ZMQ_SRCFD``, None where unknown) of a received frame."""
        try:
            source = str(frame.get("Peer-Address") or "")
        except (zmq.ZMQError, AttributeError, TypeError, UnicodeDecodeError):
            source = ""
        try:
            fd: Optional[int] = int(frame.get(zmq.SRCFD))
        except (zmq.ZMQError, AttributeError, TypeError, ValueError):
            fd = None
        return source, fd

    @property
    def where(self) -> str:
        return self.source or "an unknown address"
