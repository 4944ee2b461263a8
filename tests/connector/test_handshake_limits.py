"""What a stranger can make a producer rank's handshake port keep: bounded fields, a few hundred
bytes per pending challenge, a per-source cap, and no eviction of a proving peer's challenge."""

from __future__ import annotations

import sys

import msgspec

from atom_kv import wire
from atom_kv.auth import new_nonce
from atom_kv.connector.handshake import MAX_CHALLENGES_PER_SOURCE
from atom_kv.connector.handshake_auth import client_proof
from tests.conftest import free_port
from tests.connector.engines import run_until
from tests.connector.inproc import producer_engine
from tests.connector.kvutil import compat
from tests.connector.test_trust import TOKEN, Dealer

MB = 1 << 20


class _Padded(wire.HandshakeRequest, tag="hs"):
    """A handshake request with an extra field the producer does not know (it is ignored when decoding)."""

    pad: bytes = b""


def _stranger_request(**fields) -> wire.HandshakeRequest:
    base = dict(engine_id="stranger", tp_rank=0, tp_size=1, compat=compat(), backend="tcp", nonce=new_nonce())
    base.update(fields)
    return wire.HandshakeRequest(**base)


def _retained(challenge) -> int:
    """Bytes one pending challenge keeps alive: its own fields and the request's (strings, ints, the compat info)."""
    total = sys.getsizeof(challenge)
    fields = challenge.__dataclass_fields__
    for value in (getattr(challenge, name) for name in fields):
        total += sys.getsizeof(value)
        if isinstance(value, msgspec.Struct):
            for inner in msgspec.structs.astuple(value):
                total += sys.getsizeof(inner)
                if isinstance(inner, msgspec.Struct):
                    total += sum(sys.getsizeof(x) for x in msgspec.structs.astuple(inner))
    return total


def _drain(peer: Dealer, n: int, timeout_s: float = 10.0) -> list:
    answers = []
    while len(answers) < n and peer.sock.poll(timeout_s * 1000):
        answers.append(wire.decode(peer.sock.recv_multipart()[-1], wire.HandshakeReplyMessage))
    return answers


def test_oversized_fields_are_refused_before_anything_is_kept():
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    peer = Dealer(port)
    try:
        server = pw.handshake_server
        for name in ("engine_id", "host", "backend"):
            peer.send(_stranger_request(**{name: "x" * 100_000}))
        peer.send(_stranger_request(compat=msgspec.structs.replace(compat(), model_id="m" * 100_000)))
        run_until([P], lambda: server.refusals().get("decode", 0) == 4, timeout_s=10)
        assert len(server._challenges) == 0
    finally:
        peer.close()
        pw.close()


def test_a_stranger_keeps_at_most_a_few_hundred_bytes_per_challenge_and_a_bounded_count():
    """Today's reproduction: requests padded to ~0.5 MB were kept whole for 10 s (300 took a
    prefill engine from 38 MB to 829 MB)."""
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    peer = Dealer(port)
    try:
        server = pw.handshake_server
        n = 120
        for _ in range(n):
            base = _stranger_request()
            peer.sock.send(wire.encode(_Padded(**msgspec.structs.asdict(base), pad=b"p" * (MB // 2))))
        answers = _drain(peer, n)
        assert len(answers) == n
        challenges = [a for a in answers if isinstance(a, wire.HandshakeChallenge)]
        assert len(challenges) == MAX_CHALLENGES_PER_SOURCE  # the rest: refused for this source
        assert server.refusals().get("challenges_source") == n - MAX_CHALLENGES_PER_SOURCE
        assert len(server._challenges) == MAX_CHALLENGES_PER_SOURCE
        kept = [_retained(c) for c in server._challenges._items.values()]
        assert max(kept) < 600, max(kept)  # a few hundred bytes, object headers included; was 0.5 MB each
    finally:
        peer.close()
        pw.close()


def test_strangers_never_evict_a_proving_peers_challenge():
    """Today's reproduction: 4,200 stranger requests between a real client's challenge and its
    proof evicted the real challenge ("unknown or expired challenge")."""
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    real, stranger = Dealer(port), Dealer(port)
    try:
        req = _stranger_request(engine_id="D")
        real.send(req)
        challenge = real.recv(wire.HandshakeChallenge)
        for _ in range(4200):
            stranger.send(_stranger_request())
        run_until([P], lambda: sum(pw.handshake_server.refusals().values()) >= 4200 - MAX_CHALLENGES_PER_SOURCE,
                  timeout_s=20)
        real.send(wire.HandshakeProof(nonce=challenge.nonce,
                                      proof=client_proof(TOKEN, req.nonce, challenge.nonce, wire.encode(req))))
        answer = real.recv(wire.HandshakeReplyMessage)
        assert isinstance(answer, wire.SealedHandshakeReply), answer
        assert wire.decode(answer.reply, wire.HandshakeReply).ok
    finally:
        real.close()
        stranger.close()
        pw.close()


def test_a_non_ascii_proof_is_a_counted_refusal_not_a_traceback(caplog):
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    peer = Dealer(port)
    try:
        req = _stranger_request()
        peer.send(req)
        challenge = peer.recv(wire.HandshakeChallenge)
        peer.send(wire.HandshakeProof(nonce=challenge.nonce, proof="é" * 64))
        answer = peer.recv(wire.HandshakeReply)
        assert not answer.ok and "wrong auth_token" in answer.error
        assert pw.handshake_server.refusals() == {"auth": 1}
        assert not any(r.exc_info for r in caplog.records)
    finally:
        peer.close()
        pw.close()
