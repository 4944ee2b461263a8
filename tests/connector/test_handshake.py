import os
import socket

import msgpack
import msgspec
import zmq

from atom_kv import wire
from atom_kv.auth import PURPOSE_DONE, new_nonce, sign_struct
from atom_kv.connector.handshake_auth import client_proof
from atom_kv.connector.handshake import compat_mismatch
from tests.conftest import free_port
from tests.connector.engines import run_until
from tests.connector.inproc import NB, consumer_engine, producer_engine
from tests.connector.kvutil import check_blocks, compat


def test_compat_mismatch_message_names_the_fields():
    msg = compat_mismatch(compat(), compat(block_size=32))
    assert msg == "KV layout mismatch: block_size 16 (here) vs 32 (peer)"
    assert compat_mismatch(compat(), compat()) is None


def test_compat_carries_the_kv_layout():
    from atom_kv.wire import CompatInfo

    atom_main = CompatInfo(**{**msgspec.structs.asdict(compat()), "layout": "aiter-shuffle"})
    assert compat_mismatch(atom_main, compat(), "prefill", "decode") == (
        "KV layout mismatch: layout 'aiter-shuffle' (prefill) vs 'hnd' (decode)")
    # a peer that predates the field is read as the layout it has always had
    old = msgspec.msgpack.encode({k: v for k, v in msgspec.structs.asdict(compat()).items() if k != "layout"})
    assert msgspec.msgpack.decode(old, type=CompatInfo).layout == "hnd"
    assert compat(is_mla=True).layout == "mla"


def test_incompatible_consumer_gets_a_failed_load_with_the_reason():
    port = free_port()
    P, pw, _ = producer_engine(port)
    D, dw, dcache = consumer_engine(port, model="other-model")
    try:
        params = P.prefill("r1", 20)
        blocks = D.admit("d1", 20, params)
        run_until([P, D], lambda: "d1" in D.failed)
        reason = D.failed["d1"]
        assert "model_id 'tiny' (prefill) vs 'other-model' (decode)" in reason
        assert D.pool.held == {} and dw.stats()["retries"] == 0  # refused handshakes are not retried
        # the consumer still told the producer it is done: the lease is released, not left to expire
        run_until([P], lambda: "r1" in P.freed)
        assert P.pool.held == {}
        from tests.connector.kvutil import untouched

        assert untouched(dcache, blocks)
    finally:
        pw.close()
        dw.close()


def test_garbage_on_the_handshake_port_is_counted_and_survived():
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token="tok")
    D, dw, dcache = consumer_engine(port, auth_token="tok")
    ctx = zmq.Context()
    try:
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"tcp://127.0.0.1:{port}")
        junk = [
            [os.urandom(200)],
            [msgpack.packb({"t": "hs", "engine_id": 5})],          # right tag, wrong fields
            [msgpack.packb([1, 2, 3])],                            # valid msgpack, wrong shape
            [b"frame-1", b"frame-2", b"frame-3"],                  # multi-frame junk
            [wire.encode(wire.DoneReading(transfer_id="P-x", engine_id="evil", tp_rank=0, tp_size=1))],  # unsigned
            [wire.encode(sign_struct("tok", PURPOSE_DONE,
                                     wire.DoneReading(transfer_id="P-x", engine_id="e", tp_rank=7, tp_size=2)))],
        ]
        for frames in junk:
            raw.send_multipart(frames)
        # a handshake answered with the wrong token is refused, with a reply
        bad_hs = wire.HandshakeRequest(engine_id="x", tp_rank=0, tp_size=1, compat=compat(), backend="tcp",
                                       nonce=new_nonce())
        raw.send(wire.encode(bad_hs))
        assert raw.poll(5000)
        challenge = wire.decode(raw.recv_multipart()[-1], wire.HandshakeChallenge)
        raw.send(wire.encode(wire.HandshakeProof(nonce=challenge.nonce, proof=client_proof(
            "wrong", bad_hs.nonce, challenge.nonce, wire.encode(bad_hs)), request=wire.encode(bad_hs))))
        assert raw.poll(5000)
        reply = wire.decode(raw.recv_multipart()[-1], wire.HandshakeReply)
        assert not reply.ok and "auth_token" in reply.error
        # not even ZMTP: raw bytes on the TCP port
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(os.urandom(4096))
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(f"tcp://127.0.0.1:{port}")
        big.send(b"\x00" * (2 << 20))  # over the size limit: the connection is dropped
        run_until([P], lambda: pw.stats()["bad_messages"] >= 7, timeout_s=10)
        # and the server still works for a real engine
        params = P.prefill("r1", 40)
        blocks = D.admit("d1", 40, params)
        run_until([P, D], lambda: "d1" in D.ready and "r1" in P.freed)
        assert check_blocks(dcache, list(zip(blocks, params["remote_block_ids"])), 0, 1, NB) == ""
        assert P.pool.held == {}
        big.close(0)
        raw.close(0)
    finally:
        ctx.destroy(linger=0)
        pw.close()
        dw.close()


def test_close_stops_every_named_thread_and_is_idempotent():
    import threading

    before = set(threading.enumerate())
    port = free_port()
    P, pw, _ = producer_engine(port)
    D, dw, _ = consumer_engine(port)
    closed = False
    try:
        params = P.prefill("r1", 40)
        D.admit("d1", 40, params)
        run_until([P, D], lambda: "d1" in D.ready and "r1" in P.freed)
        started = [t for t in threading.enumerate() if t not in before]
        names = sorted(t.name for t in started)
        assert any(n.startswith("atom-kv-hs-server") for n in names), names
        assert any(n.startswith("atom-kv-read") for n in names) and "atom-kv-release" in names
        assert not [n for n in names if n.startswith("Thread-")], names  # every thread is named
        pw.close()
        dw.close()
        D.sched.close()
        closed = True
        dw.close()  # idempotent
        pw.close()
        D.sched.close()
        assert [t.name for t in started if t.is_alive()] == []
    finally:
        if not closed:
            pw.close()
            dw.close()
