"""What a stranger can make a producer rank's handshake port keep: bounded fields and frames, about
300 bytes per pending challenge whatever the request held, and no way to push out a proving peer's
challenge."""

from __future__ import annotations

import tracemalloc

import msgspec
import pytest

from atom_kv import wire
from atom_kv.auth import new_nonce
from atom_kv.connector.handshake import MAX_CHALLENGES, MAX_CHALLENGES_PER_SOURCE
from atom_kv.connector.handshake_auth import Challenge, ChallengeTable, client_proof
from atom_kv.connector.handshake_limits import largest_message_bytes
from tests.conftest import free_port
from tests.connector.engines import run_until
from tests.connector.inproc import producer_engine
from tests.connector.kvutil import compat
from tests.connector.test_trust import TOKEN, Dealer

WIDE = "\U0001f600"  # 4 bytes in UTF-8: a string at its bound in characters is 4x as many bytes


def _stranger_request(**fields) -> wire.HandshakeRequest:
    base = dict(engine_id="stranger", tp_rank=0, tp_size=1, compat=compat(), backend="tcp", nonce=new_nonce())
    base.update(fields)
    return wire.HandshakeRequest(**base)


def _request_at_bound() -> wire.HandshakeRequest:
    """Every field of a handshake request at its bound."""
    name = WIDE * 256
    info = wire.CompatInfo(model_id=name, dtype=name, num_layers=1 << 20, num_kv_heads=1 << 20, head_dim=1 << 20,
                           block_size=1 << 20, is_mla=True, layout=name)
    return wire.HandshakeRequest(engine_id=name, tp_rank=1 << 20, tp_size=1 << 20, compat=info, backend=name,
                                 host=WIDE * 255, nonce=WIDE * 128, memory=[WIDE * 16] * 16)


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


def test_every_legitimate_message_fits_the_port_size_limit_and_a_request_at_its_bound_fits_a_proof():
    limit = largest_message_bytes()
    assert limit < 1 << 20  # the issue's 1 MiB frames are over it
    assert len(wire.encode(_request_at_bound())) <= wire.MAX_HANDSHAKE_REQUEST_BYTES
    biggest = wire.Issued(transfer_id=WIDE * 128, block_ids=[(1 << 32) - 1] * wire.MAX_ISSUED_BLOCKS, ts=1.0,
                          nonce=WIDE * 128, mac=WIDE * 128)
    assert len(wire.encode(biggest)) <= limit
    with pytest.raises(wire.WireError):  # one block more is not a legitimate message
        wire.decode(wire.encode(msgspec.structs.replace(biggest, block_ids=biggest.block_ids + [1])), wire.Issued)


@pytest.mark.parametrize("sources", [1, MAX_CHALLENGES], ids=["one-address", "one-per-address"])
def test_a_full_challenge_table_keeps_under_600_bytes_per_challenge_with_every_field_at_its_bound(sources):
    """The issue measured 844 B per pending challenge, 9,436 B with every field at its bound (37 MiB for a
    full table). Measured the same way here: everything the table allocates for a full table, per challenge."""
    request = wire.encode(_request_at_bound())
    identity = b"\xff" * 255  # ZeroMQ routing ids go up to 255 bytes, and a peer may choose its own
    addresses = [f"fd00:{i // 65536:x}:{i % 65536:x}:ffff:ffff:ffff:ffff:ffff" for i in range(sources)]
    table = ChallengeTable(MAX_CHALLENGES, 60.0, MAX_CHALLENGES)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(MAX_CHALLENGES):
            source = (addresses[i % sources] + "!")[:-1]  # a new string each time, as each message's Peer-Address is
            assert table.add(new_nonce(), Challenge.of(identity + b"", request, source, table.new_deadline())) is None
        per_challenge = (tracemalloc.get_traced_memory()[0] - before) / MAX_CHALLENGES
    finally:
        tracemalloc.stop()
    assert len(table) == MAX_CHALLENGES
    assert per_challenge < 600, f"{per_challenge:.0f} bytes per pending challenge"


def test_a_stranger_at_its_address_cap_pushes_out_only_its_own_oldest_challenges():
    """Requests at their bound (about 8 KiB each) from one connection: each is answered, the address keeps
    at most its cap, and what goes is its own oldest."""
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    peer = Dealer(port)
    try:
        server = pw.handshake_server
        n = MAX_CHALLENGES_PER_SOURCE + 56
        for _ in range(n):
            peer.send(msgspec.structs.replace(_request_at_bound(), nonce=new_nonce()))
        answers = _drain(peer, n)
        assert len(answers) == n and all(isinstance(a, wire.HandshakeChallenge) for a in answers)
        assert server.refusals().get("challenges_source") == n - MAX_CHALLENGES_PER_SOURCE
        assert len(server._challenges) == MAX_CHALLENGES_PER_SOURCE
        assert sorted(server._challenges._items) == sorted(a.nonce for a in answers[-MAX_CHALLENGES_PER_SOURCE:])
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
        real.send(wire.HandshakeProof(nonce=challenge.nonce, request=wire.encode(req),
                                      proof=client_proof(TOKEN, req.nonce, challenge.nonce, wire.encode(req))))
        answer = real.recv(wire.HandshakeReplyMessage)
        assert isinstance(answer, wire.SealedHandshakeReply), answer
        assert wire.decode(answer.reply, wire.HandshakeReply).ok
    finally:
        real.close()
        stranger.close()
        pw.close()


def test_a_proof_must_carry_the_request_it_answers(caplog):
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    peer = Dealer(port)
    try:
        for request in (b"", wire.encode(_stranger_request())):  # none (an older consumer), or another one
            req = _stranger_request()
            peer.send(req)
            challenge = peer.recv(wire.HandshakeChallenge)
            peer.send(wire.HandshakeProof(nonce=challenge.nonce, request=request,
                                          proof=client_proof(TOKEN, req.nonce, challenge.nonce, wire.encode(req))))
            answer = peer.recv(wire.HandshakeReply)
            assert not answer.ok
        assert any("older atom-kv" in r.getMessage() for r in caplog.records)
        assert pw.handshake_server.refusals() == {"challenge": 2}
    finally:
        peer.close()
        pw.close()


def test_a_non_ascii_proof_is_a_counted_refusal_not_a_traceback(caplog):
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    peer = Dealer(port)
    try:
        req = _stranger_request()
        peer.send(req)
        challenge = peer.recv(wire.HandshakeChallenge)
        peer.send(wire.HandshakeProof(nonce=challenge.nonce, proof="é" * 64, request=wire.encode(req)))
        answer = peer.recv(wire.HandshakeReply)
        assert not answer.ok and "wrong auth_token" in answer.error
        assert pw.handshake_server.refusals() == {"auth": 1}
        assert not any(r.exc_info for r in caplog.records)
    finally:
        peer.close()
        pw.close()


def test_invalid_utf8_in_a_string_field_is_counted_as_decode_not_internal():
    """The issue: 100 of 100 such frames were counted as ``internal`` (our own bugs' label)."""
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    peer = Dealer(port)
    try:
        good = wire.encode(_stranger_request(engine_id="abcdefgh"))
        bad = good.replace(b"abcdefgh", b"\xff\xfe\xfd\xfc\xc3\x28\xa0\xa1")
        for _ in range(100):
            peer.sock.send(bad)
        run_until([P], lambda: sum(pw.handshake_server.refusals().values()) >= 100, timeout_s=10)
        assert pw.handshake_server.refusals() == {"decode": 100}
    finally:
        peer.close()
        pw.close()


def test_connections_that_never_prove_the_token_are_capped_per_address():
    """Raw TCP connections that never speak ZeroMQ, 100 from one address: the port keeps that address's
    newest 64 (handshake_max_unproven_connections_per_source), and a peer on that address still gets in."""
    import socket

    import zmq

    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    guard = pw.handshake_server.guard
    socks = [socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.9", 0)) for _ in range(100)]
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    try:
        run_until([P], lambda: pw.handshake_server.refusals().get("connections_source", 0) == 36, timeout_s=10)
        assert guard.sources() == {"127.0.0.9": 64}
        peer.connect(f"tcp://127.0.0.9:0;127.0.0.1:{port}")
        req = _stranger_request(engine_id="D")
        peer.send(wire.encode(req))
        assert peer.poll(5000)
        challenge = wire.decode(peer.recv_multipart()[-1], wire.HandshakeChallenge)
        peer.send(wire.encode(wire.HandshakeProof(nonce=challenge.nonce, request=wire.encode(req),
                                                  proof=client_proof(TOKEN, req.nonce, challenge.nonce,
                                                                     wire.encode(req)))))
        assert peer.poll(5000)
        assert isinstance(wire.decode(peer.recv_multipart()[-1], wire.HandshakeReplyMessage),
                          wire.SealedHandshakeReply)
    finally:
        for s in socks:
            s.close()
        peer.close(0)
        ctx.term()
    try:
        run_until([P], lambda: len(guard) == 0, timeout_s=10)  # every disconnect was counted
    finally:
        pw.close()
