"""Proving the shared ``auth_token`` on a producer rank's handshake port: what
each side computes and checks (pure functions), and the producer's bounded,
expiring memory of the challenges it sent (:class:`ChallengeTable`).

The handshake with a token, consumer rank C and producer rank P::

    C -> P  HandshakeRequest(nonce=c)          nothing derived from the token
    P -> C  HandshakeChallenge(nonce=p, proof=server_proof(c, p, engine_id, tp_rank))
            C checks the proof first: a stranger that does not know the token
            gets nothing more (C never answers it)
    C -> P  HandshakeProof(nonce=p, proof=client_proof(c, p, request bytes))
    P -> C  SealedHandshakeReply(reply bytes, mac=reply_mac(c, p, reply bytes))

so both sides prove the token over fresh nonces, the request and the reply
cannot be altered, and the token never travels. Without a token the
handshake stays one round trip (request, plain reply).

Before a signed notice (done-reading, release) goes to a producer rank that
has not proven the token in a handshake, the sender asks it for a
:func:`peer_proof` over a nonce of its own (stateless on the producer).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Optional

from atom_kv.auth import (
    PURPOSE_BLOCKS_ANSWER,
    PURPOSE_DONE_ACK,
    PURPOSE_HANDSHAKE_CLIENT,
    PURPOSE_HANDSHAKE_REPLY,
    PURPOSE_HANDSHAKE_SERVER,
    PURPOSE_PEER_PROOF,
    canonical,
    mac,
    struct_payload,
    verify_mac,
)
from atom_kv.wire import BlocksAnswer, DoneAck, HandshakeRequest, decode

__all__ = [
    "Challenge",
    "ChallengeTable",
    "ack_mac",
    "answer_mac",
    "client_proof",
    "client_proof_of_digest",
    "peer_proof",
    "reply_mac",
    "request_digest",
    "server_proof",
    "verify_ack",
    "verify_answer",
]


def server_proof(token: str, c_nonce: str, p_nonce: str, engine_id: str, tp_rank: int) -> str:
    """The producer's proof in its challenge: both nonces and who it says it is."""
    return mac(token, PURPOSE_HANDSHAKE_SERVER,
               canonical({"c": c_nonce, "p": p_nonce, "engine_id": engine_id, "tp_rank": tp_rank}))


def client_proof(token: str, c_nonce: str, p_nonce: str, request: bytes) -> str:
    """The consumer's answer: both nonces and the request bytes it sent."""
    return client_proof_of_digest(token, c_nonce, p_nonce, request_digest(request))


def request_digest(request: bytes) -> bytes:
    """What :func:`client_proof` covers of the request (32 bytes: all a producer keeps of it)."""
    return hashlib.sha256(request).digest()


def client_proof_of_digest(token: str, c_nonce: str, p_nonce: str, digest: bytes) -> str:
    """:func:`client_proof` from the request's :func:`request_digest`."""
    return mac(token, PURPOSE_HANDSHAKE_CLIENT, canonical({"c": c_nonce, "p": p_nonce, "request": digest}))


def reply_mac(token: str, c_nonce: str, p_nonce: str, reply: bytes) -> str:
    """The sealed reply's MAC: both nonces and the reply bytes."""
    return mac(token, PURPOSE_HANDSHAKE_REPLY,
               canonical({"c": c_nonce, "p": p_nonce, "reply": hashlib.sha256(reply).digest()}))


def peer_proof(token: str, nonce: str, engine_id: str, tp_rank: int) -> str:
    """A producer rank's answer to a proof request."""
    return mac(token, PURPOSE_PEER_PROOF, canonical({"nonce": nonce, "engine_id": engine_id, "tp_rank": tp_rank}))


def ack_mac(token: str, ack: DoneAck, request_nonce: str) -> str:
    """A confirmation's MAC, bound to the done-reading notice it answers."""
    return mac(token, PURPOSE_DONE_ACK, struct_payload(ack, request_nonce=request_nonce))


def verify_ack(token: str, ack: DoneAck, request_nonce: str) -> bool:
    """True when ``ack`` was signed by a token holder in answer to ``request_nonce``."""
    return verify_mac(token, PURPOSE_DONE_ACK, struct_payload(ack, request_nonce=request_nonce), ack.mac)


def answer_mac(token: str, answer: BlocksAnswer, query_nonce: str) -> str:
    """A blocks answer's MAC, bound to the query it answers."""
    return mac(token, PURPOSE_BLOCKS_ANSWER, struct_payload(answer, request_nonce=query_nonce))


def verify_answer(token: str, answer: BlocksAnswer, query_nonce: str) -> bool:
    """True when ``answer`` was signed by a token holder in answer to ``query_nonce``."""
    return verify_mac(token, PURPOSE_BLOCKS_ANSWER, struct_payload(answer, request_nonce=query_nonce), answer.mac)


@dataclass(slots=True)
class Challenge:
    """One challenge the producer sent and waits on an answer for: a few hundred
    bytes. The request as received is kept only as its digest (what the proof
    covers), and the request itself re-encoded from its decoded, bounded fields
    (anything else the peer sent is gone)."""

    identity: bytes        # the consumer's socket identity (the answer must come from it)
    c_nonce: str
    request_digest: bytes  # :func:`request_digest` of the request as received: the consumer's proof covers it
    request_bytes: bytes   # ``wire.encode`` of the decoded request
    deadline: float
    source: str = ""       # the peer's address: at most ``per_source`` pending challenges each

    @property
    def request(self) -> HandshakeRequest:
        return decode(self.request_bytes, HandshakeRequest)


class ChallengeTable:
    """Owns a producer rank's outstanding challenges: at most ``capacity`` in all
    and ``per_source`` per peer address, each forgotten after ``ttl_s``. A full
    table (or a source at its cap) refuses the new challenge: a pending one is
    never dropped early, so strangers cannot evict a proving peer's challenge.
    Single-threaded (the handshake server's thread)."""

    def __init__(self, capacity: int, ttl_s: float, per_source: int | None = None) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self.per_source = capacity if per_source is None else per_source
        self._items: dict[str, Challenge] = {}  # insertion order is deadline order (one ttl for all)
        self._by_source: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def add(self, p_nonce: str, challenge: Challenge) -> Optional[str]:
        """Remember ``challenge``; returns None, or why it was refused (``"full"``, ``"source"``)."""
        if len(self._items) >= self.capacity:
            return "full"
        held = self._by_source.get(challenge.source, 0)
        if held >= self.per_source:
            return "source"
        self._items[p_nonce] = challenge
        self._by_source[challenge.source] = held + 1
        return None

    def _forget(self, challenge: Challenge) -> None:
        left = self._by_source.get(challenge.source, 1) - 1
        if left > 0:
            self._by_source[challenge.source] = left
        else:
            self._by_source.pop(challenge.source, None)

    def new_deadline(self, now: Optional[float] = None) -> float:
        return (time.monotonic() if now is None else now) + self.ttl_s

    def take(self, p_nonce: str, now: Optional[float] = None) -> Optional[Challenge]:
        """The challenge ``p_nonce`` names (forgotten now), or None if unknown or expired."""
        challenge = self._items.pop(p_nonce, None)
        if challenge is None:
            return None
        self._forget(challenge)
        if challenge.deadline < (time.monotonic() if now is None else now):
            return None
        return challenge

    def expire(self, now: Optional[float] = None) -> list[Challenge]:
        """Forget and return the challenges nobody answered in time (oldest first)."""
        now = time.monotonic() if now is None else now
        expired = []
        for nonce, challenge in self._items.items():
            if challenge.deadline >= now:
                break
            expired.append(nonce)
        out = [self._items.pop(nonce) for nonce in expired]
        for challenge in out:
            self._forget(challenge)
        return out
