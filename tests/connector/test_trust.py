"""The handshake port's trust rules, with real sockets: the token never travels,
wrong tokens and replays are refused, other protocol versions are named, and
only reads of this producer's own transfers are confirmed."""

from __future__ import annotations

import logging
import socket
import threading
import time

import msgspec
import pytest
import zmq

from atom_kv import wire
from atom_kv.auth import PURPOSE_DONE, PURPOSE_RELEASE, new_nonce, sign_struct
from atom_kv.connector import ProducerWorker
from atom_kv.connector.handshake_auth import client_proof
from atom_kv.connector.release import NoticeSender, ReleaseSpec
from tests.conftest import free_port
from tests.connector.engines import run_until
from tests.connector.inproc import consumer_engine, producer_engine
from tests.connector.kvutil import compat, config

TOKEN = "s3cret-token-4f1d9a7c2b8e6d50"


class Dealer:
    """A raw DEALER socket talking to a handshake port (the test plays the peer)."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{host}:{port}")

    def send(self, msg: msgspec.Struct) -> None:
        self.sock.send(wire.encode(msg))

    def recv(self, type_, timeout_s: float = 5.0):
        assert self.sock.poll(timeout_s * 1000), "no answer"
        return wire.decode(self.sock.recv_multipart()[-1], type_)

    def quiet(self, timeout_s: float) -> bool:
        return not self.sock.poll(timeout_s * 1000)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class FakeListener:
    """A stranger a client names as its 'prefill engine': records every frame it
    receives; answers handshakes with a made-up challenge and proof requests with
    a made-up proof (it cannot know the token)."""

    def __init__(self, port: int) -> None:
        self.frames: list[bytes] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://127.0.0.1:{port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            identity, *payload = self._sock.recv_multipart()
            self.frames.extend(payload)
            msg = wire.decode(payload[-1], wire.HandshakeMessage)
            if isinstance(msg, wire.HandshakeRequest):
                answer = wire.HandshakeChallenge(engine_id="P", tp_rank=0, nonce=new_nonce(), proof="ab" * 32)
            elif isinstance(msg, wire.PeerProofRequest):
                answer = wire.PeerProof(engine_id="P", tp_rank=0, proof="cd" * 32)
            else:
                continue
            self._sock.send_multipart([identity, wire.encode(answer)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def _params_naming(port: int, blocks: int = 3, tid: str = "victim-1") -> dict:
    return {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "127.0.0.1",
            "remote_handshake_port": port, "remote_tp_size": 1, "remote_block_ids": list(range(blocks)),
            "transfer_id": tid}


def test_a_host_named_by_a_client_gets_nothing_derived_from_the_token():
    fake = FakeListener(free_port())
    port = int(fake._sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    D, dw, _ = consumer_engine(free_port(), auth_token=TOKEN)
    try:
        D.admit("d1", 40, _params_naming(port))
        run_until([D], lambda: "d1" in D.failed)
        assert "did not prove it knows the auth token" in D.failed["d1"]
        # the release of the failed load asked the stranger to prove itself first, and it could not
        deadline = time.monotonic() + 5
        while D.sched._sender.counts["unproven"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert D.sched._sender.counts == {"sent": 0, "dropped": 1, "unproven": 1}
        kinds = [type(wire.decode(f, wire.HandshakeMessage)).__name__ for f in fake.frames]
        assert set(kinds) == {"HandshakeRequest", "PeerProofRequest"}, kinds  # no proof, no notice, no release
        for frame in fake.frames:
            assert TOKEN.encode() not in frame
            fields = msgspec.msgpack.decode(frame)
            assert set(fields) <= {"t", "v", "engine_id", "tp_rank", "tp_size", "compat", "backend", "host",
                                   "nonce", "memory"}, fields  # nothing keyed with the token: no MAC, no proof
    finally:
        dw.close()
        fake.close()


@pytest.mark.parametrize("producer_token,consumer_token,expected", [
    (TOKEN, "another-token-value-00000000", "did not prove it knows the auth token"),
    (None, TOKEN, "answered without proving the auth token"),
    (TOKEN, None, "this prefill engine requires an auth_token"),
])
def test_handshakes_across_different_tokens_are_refused(producer_token, consumer_token, expected):
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=producer_token)
    D, dw, _ = consumer_engine(port, auth_token=consumer_token)
    try:
        params = P.prefill("r1", 40)
        D.admit("d1", 40, params)
        run_until([P, D], lambda: "d1" in D.failed)
        assert expected in D.failed["d1"]
        assert dw.stats()["transfers"] == 0 and dw.stats()["retries"] == 0  # refused, not retried
    finally:
        pw.close()
        dw.close()


def test_a_consumer_that_cannot_verify_the_challenge_is_counted_by_the_producer():
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN, handshake_timeout_s=0.5)
    D, dw, _ = consumer_engine(port, auth_token="another-token-value-00000000")
    try:
        D.admit("d1", 40, P.prefill("r1", 40))
        run_until([P, D], lambda: "d1" in D.failed)
        run_until([P], lambda: pw.handshake_server.refusals().get("unanswered", 0) >= 1, timeout_s=5)
    finally:
        pw.close()
        dw.close()


def test_a_proof_with_the_wrong_token_is_refused_and_the_right_one_gets_a_sealed_reply():
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    peer = Dealer(port)
    try:
        for token, ok in (("wrong-token-value-000000000000", False), (TOKEN, True)):
            req = wire.HandshakeRequest(engine_id="x", tp_rank=0, tp_size=1, compat=compat(), backend="tcp",
                                        nonce=new_nonce())
            peer.send(req)
            challenge = peer.recv(wire.HandshakeChallenge)
            peer.send(wire.HandshakeProof(nonce=challenge.nonce,
                                          proof=client_proof(token, req.nonce, challenge.nonce, wire.encode(req)),
                                          request=wire.encode(req)))
            answer = peer.recv(wire.HandshakeReplyMessage)
            if ok:
                assert isinstance(answer, wire.SealedHandshakeReply)
                assert wire.decode(answer.reply, wire.HandshakeReply).ok
            else:
                assert isinstance(answer, wire.HandshakeReply) and "wrong auth_token" in answer.error
        # a proof for a challenge already answered (a replayed proof) is refused
        peer.send(wire.HandshakeProof(nonce=challenge.nonce, proof="00" * 32))
        assert "unknown or expired challenge" in peer.recv(wire.HandshakeReply).error
        assert pw.handshake_server.refusals() == {"auth": 1, "challenge": 1}
    finally:
        peer.close()
        pw.close()


def test_replayed_stale_and_unsigned_notices_are_refused():
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    peer = Dealer(port)
    try:
        P.prefill("r1", 40)
        P.step()
        release = sign_struct(TOKEN, PURPOSE_RELEASE, wire.Release(transfer_id="P-r1", sender="test"))
        peer.send(release)
        run_until([P], lambda: "r1" in P.freed)
        peer.send(release)  # the same message again
        stale = sign_struct(TOKEN, PURPOSE_RELEASE, wire.Release(transfer_id="P-other"), now=time.time() - 300)
        peer.send(stale)
        peer.send(wire.Release(transfer_id="P-other"))  # unsigned
        forged = msgspec.structs.replace(sign_struct(TOKEN, PURPOSE_RELEASE, wire.Release(transfer_id="P-x")),
                                         transfer_id="P-other")  # altered after signing
        peer.send(forged)
        done = sign_struct(TOKEN, PURPOSE_DONE, wire.DoneReading(transfer_id="P-y", engine_id="e", tp_rank=0,
                                                                  tp_size=2))
        peer.send(done)
        peer.send(done)
        run_until([P], lambda: sum(pw.handshake_server.refusals().values()) >= 5, timeout_s=5)
        assert pw.handshake_server.refusals() == {"replay": 2, "stale": 1, "auth": 2}
        assert pw.stats()["releases_received"] == 1 and P.freed == ["r1"]
    finally:
        peer.close()
        pw.close()


def test_other_protocol_versions_are_refused_naming_both():
    port = free_port()
    P, pw, _ = producer_engine(port)
    peer = Dealer(port)
    try:
        req = wire.HandshakeRequest(engine_id="x", tp_rank=0, tp_size=1, compat=compat(), backend="tcp", v=999)
        peer.send(req)
        reply = peer.recv(wire.HandshakeReply)
        assert not reply.ok and "version 999 (peer)" in reply.error and "version 2 (here)" in reply.error
        # a newer peer's message that does not even decode here is named the same way
        peer.sock.send(msgspec.msgpack.encode({"t": "hs", "v": 999, "new_field": 1}))
        assert "version 999 (peer)" in peer.recv(wire.HandshakeReply).error
        peer.send(wire.Release(transfer_id="P-r1", v=999))
        run_until([P], lambda: pw.handshake_server.refusals().get("version", 0) == 3, timeout_s=5)
    finally:
        peer.close()
        pw.close()


def test_a_consumer_refuses_a_producer_of_another_version():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    D, dw, _ = consumer_engine(free_port())
    try:
        D.admit("d1", 40, _params_naming(port))
        D.step()  # the worker starts the load: its handshake goes out
        assert router.poll(5000)
        identity, _ = router.recv_multipart()
        router.send_multipart([identity, wire.encode(wire.HandshakeReply(ok=True, v=999))])
        run_until([D], lambda: "d1" in D.failed)
        assert "version 999 (peer) is not version 2 (here)" in D.failed["d1"]
    finally:
        dw.close()
        router.close(0)
        ctx.term()


def _done(tid: str, blocks: list[int], offset: int = 0, **kw) -> wire.DoneReading:
    return sign_struct(TOKEN, PURPOSE_DONE, wire.DoneReading(
        transfer_id=tid, engine_id="D", tp_rank=0, tp_size=1, want_ack=True, block_offset=offset,
        num_blocks=len(blocks), blocks_digest=wire.blocks_digest(blocks), **kw))


def test_only_reads_of_this_producers_own_transfers_are_confirmed():
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN, handshake_timeout_s=1.0)
    peer = Dealer(port)
    try:
        params = P.prefill("r1", 50)
        blocks = params["remote_block_ids"]
        P.step()  # the rank learns the transfer
        peer.send(_done("never-issued", [1, 2]))  # waits for the rank to learn it, then is refused
        ack = peer.recv(wire.DoneAck)
        assert not ack.valid and "was not issued by producer P" in ack.reason
        peer.send(_done("P-r1", [b + 1 for b in blocks]))  # a read of other blocks under this transfer's id
        ack = peer.recv(wire.DoneAck)
        assert not ack.valid and "not transfer P-r1's" in ack.reason
        assert "r1" not in P.freed  # neither counted as done
        peer.send(_done("P-r1", blocks[1:], offset=1))  # the blocks not cached at the consumer
        ack = peer.recv(wire.DoneAck)
        assert ack.valid and ack.transfer_id == "P-r1"
        run_until([P], lambda: "r1" in P.freed)
    finally:
        peer.close()
        pw.close()


def test_a_confirmation_asked_before_the_rank_learnt_the_transfer_waits_for_it():
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN, handshake_timeout_s=4.0)
    peer = Dealer(port)
    try:
        blocks = P.prefill("r1", 40)["remote_block_ids"]  # the scheduler leased it; no step yet
        peer.send(_done("P-r1", blocks))
        assert peer.quiet(0.5)  # not refused: deferred
        P.step()  # start_load_kv tells the rank
        ack = peer.recv(wire.DoneAck, timeout_s=2)
        assert ack.valid
    finally:
        peer.close()
        pw.close()


def test_an_ack_is_bound_to_the_notice_it_answers():
    """A consumer ignores an ack signed for another notice (an old ack replayed)."""
    from atom_kv.connector.confirm import DoneAckClient
    from atom_kv.connector.stats import TransferStats

    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    ctx = zmq.Context()
    client = DoneAckClient(ctx, stats=TransferStats("t"), auth_token=TOKEN)
    try:
        blocks = P.prefill("r1", 40)["remote_block_ids"]
        P.step()
        msg = wire.DoneReading(transfer_id="P-r1", engine_id="D", tp_rank=0, tp_size=2, want_ack=True,
                               num_blocks=len(blocks), blocks_digest=wire.blocks_digest(blocks))
        stop = threading.Event()
        assert client.confirm({0: ("127.0.0.1", port)}, msg, 2.0, stop) is None
        # the same socket now gets an old (valid, signed) ack replayed before the real answer
        old = wire.DoneAck(transfer_id="P-r1", tp_rank=0, valid=True)
        from atom_kv.connector.handshake_auth import ack_mac

        forged = msgspec.structs.replace(old, mac=ack_mac(TOKEN, old, "0" * 32))
        judged = client._judge(wire.encode(forged), sign_struct(TOKEN, PURPOSE_DONE, msg), 0, "127.0.0.1", port)
        assert judged is None  # ignored, not taken as a confirmation
    finally:
        client.close()
        ctx.term()
        pw.close()


def test_release_frees_the_producer_at_once_and_is_idempotent():
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    sender = NoticeSender(auth_token=TOKEN, sender="test", proof_timeout_s=2.0)
    try:
        P.prefill("r1", 40)
        t0 = time.monotonic()
        for _ in range(3):
            sender.release(ReleaseSpec("P-r1", "127.0.0.1", port), "abandoned")
        run_until([P], lambda: "r1" in P.freed)
        assert time.monotonic() - t0 < 2.0
        # a release that arrives before the lease exists frees it as soon as it does
        sender.release(ReleaseSpec("P-r2", "127.0.0.1", port), "client gone")
        run_until([P], lambda: pw.stats()["releases_received"] >= 4)
        P.prefill("r2", 40)
        run_until([P], lambda: "r2" in P.freed)
        for _ in range(3):
            P.step()
        assert P.freed == ["r1", "r2"] and P.pool.held == {}  # freed once each
        assert sender.counts["sent"] == 4 and sender.counts["unproven"] == 0
    finally:
        sender.close()
        pw.close()


def test_a_release_queued_just_before_close_waits_for_the_proof_and_frees_at_once():
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    sender = NoticeSender(auth_token=TOKEN, sender="test", proof_timeout_s=2.0)
    try:
        P.prefill("r1", 40)
        sender.release(ReleaseSpec("P-r1", "127.0.0.1", port), "the engine is shutting down")
        sender.close()  # at once: the producer rank has not proved the token yet
        assert sender.counts == {"sent": 1, "dropped": 0, "unproven": 0}
        run_until([P], lambda: "r1" in P.freed)
    finally:
        sender.close()
        pw.close()


@pytest.mark.parametrize("proof_timeout_s, close_wait_s", [(0.5, 60.0), (60.0, 0.5)])
def test_close_waits_for_a_proof_that_never_comes_no_longer_than_either_bound(proof_timeout_s, close_wait_s):
    silent = free_port()  # nothing listens: the proof request is never answered
    sender = NoticeSender(auth_token=TOKEN, sender="test", proof_timeout_s=proof_timeout_s, close_wait_s=close_wait_s)
    sender.release(ReleaseSpec("P-r1", "127.0.0.1", silent), "the engine is shutting down")
    t0 = time.monotonic()
    sender.close()
    assert time.monotonic() - t0 < 0.5 + 2.0
    assert sender.counts["dropped"] == 1 and sender.counts["sent"] == 0


def test_an_early_release_is_forgotten_after_one_lease_time():
    port = free_port()
    P, pw, _ = producer_engine(port, abort_timeout_s=0.5)
    peer = Dealer(port)
    try:
        peer.send(wire.Release(transfer_id="P-never"))
        run_until([P], lambda: "P-never" in P.sched._early_done)
        run_until([P], lambda: "P-never" not in P.sched._early_done, timeout_s=5)
    finally:
        peer.close()
        pw.close()


def test_wrong_token_floods_are_counted_but_logged_at_a_bounded_rate(caplog):
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    peer = Dealer(port)
    try:
        caplog.set_level(logging.WARNING, logger="atom_kv.connector.handshake")
        bad = sign_struct("wrong-token-value-000000000000", PURPOSE_RELEASE, wire.Release(transfer_id="x"))
        for _ in range(500):
            peer.send(msgspec.structs.replace(bad, nonce=new_nonce()))
        run_until([P], lambda: pw.handshake_server.refusals().get("auth", 0) == 500, timeout_s=10)
        lines = [r for r in caplog.records if "handshake port" in r.getMessage()]
        assert 1 <= len(lines) <= 3, len(lines)
    finally:
        peer.close()
        pw.close()


def test_the_handshake_server_listens_only_on_the_given_host():
    port = free_port()
    cfg = config("kv_producer", port, backend="tcp")
    w = ProducerWorker(cfg, engine_id="P", host="127.0.0.2", tp_rank=0, tp_size=1, compat=compat()).start()
    try:
        with socket.create_connection(("127.0.0.2", port), timeout=2):
            pass
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
    finally:
        w.close()


def test_a_producer_that_announces_its_transfers_confirms_reads_before_it_steps():
    """ATOM hands metadata to its ranks only with a batch: with ``announce_sends`` the
    scheduler tells its ranks directly, so an idle producer still confirms in time."""
    from atom_kv.connector import ConnectorScheduler
    from tests.connector.kvutil import BLOCK

    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN, handshake_timeout_s=1.0)
    P.sched.close()
    P.sched = ConnectorScheduler(pw.config, engine_id="P", host="127.0.0.1", tp_size=1, block_size=BLOCK,
                                 announce_sends=True)
    peer = Dealer(port)
    try:
        blocks = P.prefill("r1", 40)["remote_block_ids"]  # no step: the metadata never reaches the rank
        peer.send(_done("P-r1", blocks))
        ack = peer.recv(wire.DoneAck, timeout_s=3)
        assert ack.valid, ack.reason
        assert pw.stats()["bad_messages"] == 0
    finally:
        peer.close()
        pw.close()


def test_outstanding_challenges_are_bounded_and_expire():
    from atom_kv.connector.handshake_auth import Challenge, ChallengeTable

    table = ChallengeTable(capacity=3, ttl_s=1.0, per_source=2)

    def challenge(i: float, source: str, ident: int = 1) -> Challenge:
        return Challenge(b"d" * 32, ident, table.new_deadline(now=100.0 + i * 0.1), source)

    # a flood of handshakes nobody answers: 10.0.0.1 at its cap pushes out its own oldest (n0), never another's
    added = [table.add(f"n{i}", challenge(i, "10.0.0.1" if i < 3 else "10.0.0.2")) for i in range(3)]
    assert added == [None, None, None] and sorted(table._items) == ["n1", "n2"]
    assert table.add("n3", challenge(3, "10.0.0.2")) is None
    # full: a newcomer takes the oldest of the address holding the most (10.0.0.1: 2, more than it holds)
    assert table.add("n4", challenge(4, "10.0.0.3")) is None and sorted(table._items) == ["n2", "n3", "n4"]
    # it holds as many as anyone: its own oldest goes
    assert table.add("n5", challenge(5, "10.0.0.3")) is None and sorted(table._items) == ["n2", "n3", "n5"]
    assert len(table) == 3
    assert table.take("n2", now=100.5) is not None and table.take("n2", now=100.5) is None  # answered once
    assert table.add("n6", challenge(6, "10.0.0.1")) is None  # room again
    assert table.take("n3", now=105.0) is None  # answered too late
    assert [c.deadline for c in table.expire(now=105.0)] == [pytest.approx(101.5), pytest.approx(101.6)]
    assert len(table) == 0 and not table._newest and len(table.shares) == 0
