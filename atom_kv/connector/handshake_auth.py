"""Proving the shared ``auth_token`` on a producer rank's handshake port: what
each side computes and checks (pure functions over
:data:`atom_kv.auth.HANDSHAKE_CHALLENGE`, the package's one challenge-response
scheme), and the producer's bounded,
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
from typing import Callable, Optional

from atom_kv._fairshare import FairShares, ProvenSources
from atom_kv.auth import (
    HANDSHAKE_CHALLENGE,
    PURPOSE_BLOCKS_ANSWER,
    PURPOSE_DONE_ACK,
    PURPOSE_PEER_PROOF,
    canonical,
    mac,
    struct_payload,
    verify_mac,
)
from atom_kv.wire import BlocksAnswer, DoneAck

__all__ = [
    "Challenge",
    "ChallengeTable",
    "ack_mac",
    "answer_mac",
    "challenge_binding",
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
    return HANDSHAKE_CHALLENGE.prove(token, "server", c_nonce, p_nonce, engine_id=engine_id, tp_rank=tp_rank)


def client_proof(token: str, c_nonce: str, p_nonce: str, request: bytes) -> str:
    """The consumer's answer: both nonces and the request bytes it sent."""
    return client_proof_of_digest(token, c_nonce, p_nonce, request_digest(request))


def request_digest(request: bytes) -> bytes:
    """What :func:`client_proof` covers of the request (32 bytes: all a producer keeps of it)."""
    return hashlib.sha256(request).digest()


def client_proof_of_digest(token: str, c_nonce: str, p_nonce: str, digest: bytes) -> str:
    """:func:`client_proof` from the request's :func:`request_digest`."""
    return HANDSHAKE_CHALLENGE.prove(token, "client", c_nonce, p_nonce, request=digest)


def reply_mac(token: str, c_nonce: str, p_nonce: str, reply: bytes) -> str:
    """The sealed reply's MAC: both nonces and the reply bytes."""
    return HANDSHAKE_CHALLENGE.prove(token, "reply", c_nonce, p_nonce, reply=hashlib.sha256(reply).digest())


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


def challenge_binding(identity: bytes, request: bytes) -> bytes:
    """What a producer keeps of a handshake request while its challenge is pending (32 bytes): the
    connection it came on and the request's bytes. The proof must come on that connection and carry
    those bytes again (``HandshakeProof.request``)."""
    return hashlib.sha256(len(identity).to_bytes(2, "big") + identity + request).digest()


@dataclass(slots=True, eq=False)
class Challenge:
    """One challenge the producer sent and waits on an answer for: about 300
    bytes, whatever the request held. Nothing of the request is kept but
    :func:`challenge_binding`; the consumer sends it again with its proof."""

    binding: bytes          # :func:`challenge_binding` of the connection and the request as received
    ident: int              # ``hash`` of the connection's identity: which connection of its source holds it
    deadline: float
    source: str = ""        # the peer's address: see :class:`~atom_kv._fairshare.FairShares`
    reserved: bool = False  # counted in the reserve of sources that proved the token before
    older: Optional["Challenge"] = None  # the same source's next older pending challenge
    nonce: str = ""         # the producer's nonce naming it (the table's key)

    @classmethod
    def of(cls, identity: bytes, request: bytes, source: str, deadline: float) -> "Challenge":
        """The challenge for ``request`` (as received) on connection ``identity`` from ``source``."""
        return cls(challenge_binding(identity, request), hash(identity), deadline, source)


class ChallengeTable:
    """Owns a producer rank's outstanding challenges: bounded by
    :class:`~atom_kv._fairshare.FairShares` (``capacity`` in all, ``per_source``
    per peer address, ``reserved`` for addresses that proved the token before),
    each forgotten after ``ttl_s``. A source at its cap loses its own oldest
    challenge of the connection holding the most; a full table takes the
    oldest of the source holding the most, or refuses the newcomer. So
    strangers cannot evict the challenge of a peer that holds one or two.
    Single-threaded (the handshake server's thread)."""

    def __init__(self, capacity: int, ttl_s: float, per_source: int | None = None, *, reserved: int = 0,
                 proven: Optional[ProvenSources] = None,
                 on_evict: Optional[Callable[[Challenge, str], None]] = None) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self.per_source = capacity if per_source is None else per_source
        self.shares = FairShares(capacity, self.per_source, reserved, proven)
        self._on_evict = on_evict
        self._items: dict[str, Challenge] = {}  # insertion order is deadline order (one ttl for all)
        self._newest: dict[str, Challenge] = {}  # source -> its newest pending challenge (a chain to the oldest)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def proven(self) -> ProvenSources:
        return self.shares.proven

    def add(self, p_nonce: str, challenge: Challenge) -> Optional[str]:
        """Remember ``challenge``; returns None, or why it was refused (``"full"``)."""
        verdict = self.shares.admit(challenge.source)
        if not verdict.ok:
            return verdict.reason
        if verdict.evict is not None:
            same = verdict.evict == challenge.source
            victim = self._hog_oldest(verdict.evict, challenge.ident) if same else self._oldest(verdict.evict)
            if victim is not None:
                self._drop(victim)
                if self._on_evict is not None:
                    self._on_evict(victim, "source" if same else "full")
        challenge.reserved = verdict.reserved
        head = self._newest.get(challenge.source)
        if head is not None:
            challenge.source = head.source  # one string per source, shared
        challenge.older = head
        self._newest[challenge.source] = challenge
        self._items[p_nonce] = challenge
        challenge.nonce = p_nonce
        self.shares.add(challenge.source, challenge.reserved)
        return None

    def _chain(self, source: str) -> list[Challenge]:
        out = []
        ch = self._newest.get(source)
        while ch is not None:
            out.append(ch)
            ch = ch.older
        return out  # newest first

    def _oldest(self, source: str) -> Optional[Challenge]:
        chain = self._chain(source)
        return chain[-1] if chain else None

    def _hog_oldest(self, source: str, newcomer: int) -> Optional[Challenge]:
        """The oldest challenge of the connection holding the most of ``source``'s (the newcomer's
        connection counts its new one)."""
        chain = self._chain(source)
        counts: dict[int, int] = {newcomer: 1}
        for ch in chain:
            counts[ch.ident] = counts.get(ch.ident, 0) + 1
        most = max(counts.values())
        for ch in reversed(chain):
            if counts[ch.ident] == most:
                return ch
        return chain[-1] if chain else None

    def _drop(self, challenge: Challenge) -> None:
        self._items.pop(challenge.nonce, None)
        self._unlink(challenge)
        self.shares.remove(challenge.source, challenge.reserved)

    def _unlink(self, challenge: Challenge) -> None:
        newer = None
        ch = self._newest.get(challenge.source)
        while ch is not None and ch is not challenge:
            newer, ch = ch, ch.older
        if ch is None:
            return
        if newer is None:
            if challenge.older is None:
                del self._newest[challenge.source]
            else:
                self._newest[challenge.source] = challenge.older
        else:
            newer.older = challenge.older
        challenge.older = None

    def new_deadline(self, now: Optional[float] = None) -> float:
        return (time.monotonic() if now is None else now) + self.ttl_s

    def take(self, p_nonce: str, now: Optional[float] = None) -> Optional[Challenge]:
        """The challenge ``p_nonce`` names (forgotten now), or None if unknown or expired."""
        challenge = self._items.get(p_nonce)
        if challenge is None:
            return None
        self._drop(challenge)
        if challenge.deadline < (time.monotonic() if now is None else now):
            return None
        return challenge

    def expire(self, now: Optional[float] = None) -> list[Challenge]:
        """Forget and return the challenges nobody answered in time (oldest first)."""
        now = time.monotonic() if now is None else now
        expired = []
        for challenge in self._items.values():
            if challenge.deadline >= now:
                break
            expired.append(challenge)
        for challenge in expired:
            self._drop(challenge)
        return expired
