import time

import pytest
import zmq

from tests.conftest import free_port
from tests.connector.engines import run_until
from tests.connector.inproc import consumer_engine, producer_engine


def test_consumer_that_never_reads_lease_frees_producer_blocks_once(caplog):
    P, pw, _ = producer_engine(free_port(), abort_timeout_s=1.0)
    try:
        t0 = time.monotonic()
        P.prefill("never-read", 40)
        assert P.sched.has_pending()
        run_until([P], lambda: "never-read" in P.freed, timeout_s=10)
        assert time.monotonic() - t0 >= 1.0
        assert P.pool.held == {} and P.freed == ["never-read"]
        assert "never-read" in caplog.text and "expired" in caplog.text
        for _ in range(3):
            P.step()  # the worker learns the id was released; nothing is freed again
        assert P.freed == ["never-read"] and not P.sched.has_pending()
    finally:
        pw.close()
        pw.close()  # idempotent


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_read_after_the_producer_lease_expired_is_never_ready(policy, caplog):
    """The decode side queued the request past the producer's lease: the
    producer freed the blocks (they may already hold another request's KV).
    The bytes are still in place here, so only the producer's verdict can
    tell: the load must end failed/recomputed, never ready."""
    port = free_port()
    P, pw, _ = producer_engine(port, abort_timeout_s=0.3)
    D, dw, _ = consumer_engine(port, load_failure_policy=policy, handshake_timeout_s=2.0)
    try:
        params = P.prefill("late", 40)
        run_until([P], lambda: "late" in P.freed, timeout_s=10)
        P.step()  # the next step's metadata carries `released` to the producer worker
        D.admit("d-late", 40, params)
        run_until([P, D], lambda: "d-late" in D.ready or "d-late" in D.failed or "d-late" in D.recompute,
                  timeout_s=10)
        assert "d-late" not in D.ready
        if policy == "fail":
            reason = D.failed["d-late"]
            assert "released transfer" in reason and params["transfer_id"] in reason, reason
            assert "lease expired" in reason, reason
        else:
            assert D.recompute == ["d-late"] and D.failed == {}
            assert "lease expired" in caplog.text
        assert P.freed == ["late"]  # the late done-reading frees nothing twice
        for _ in range(3):
            P.step()
        assert P.freed == ["late"]
    finally:
        pw.close()
        dw.close()


def test_happy_path_confirmed_then_producer_frees_once():
    port = free_port()
    P, pw, _ = producer_engine(port)
    D, dw, _ = consumer_engine(port)
    try:
        params = P.prefill("r", 40)
        D.admit("d", 40, params)
        run_until([P, D], lambda: "d" in D.ready and "r" in P.freed and pw.stats().get("done_received", 0) >= 1,
                  timeout_s=10)
        assert D.failed == {} and P.freed == ["r"]
        assert pw.stats()["done_received"] == 1  # the acked done-reading counted once
        for _ in range(3):
            P.step()
        assert P.freed == ["r"]
    finally:
        pw.close()
        dw.close()


def _bind_retry(sock: zmq.Socket, port: int) -> None:
    deadline = time.monotonic() + 5
    while True:
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.parametrize("reply", [None, b"\xc1garbage"], ids=["silent", "garbage"])
def test_producer_that_never_acks_fails_the_load_within_handshake_timeout(reply):
    """After a first load (handshake cached, data channel up), the producer's
    handshake port is taken over by a raw ROUTER that swallows done-readings
    (an old peer) or answers garbage: the read itself succeeds, but without a
    confirmation the load fails within handshake_timeout_s."""
    port = free_port()
    P, pw, _ = producer_engine(port)
    D, dw, _ = consumer_engine(port, handshake_timeout_s=1.0)
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    try:
        params = P.prefill("r1", 40)
        D.admit("d1", 40, params)
        run_until([P, D], lambda: "d1" in D.ready, timeout_s=10)
        pw._server.close()  # the handshake port goes quiet; the transfer backend stays up
        _bind_retry(rogue, port)
        params = P.prefill("r2", 40)
        t0 = time.monotonic()
        D.admit("d2", 40, params)
        seen = []
        deadline = time.monotonic() + 10
        while "d2" not in D.failed and "d2" not in D.ready and time.monotonic() < deadline:
            if rogue.poll(5, zmq.POLLIN):
                frames = rogue.recv_multipart()
                seen.append(frames)
                if reply is not None:
                    rogue.send_multipart([frames[0], reply])
            D.step()
        elapsed = time.monotonic() - t0
        assert "d2" not in D.ready
        reason = D.failed["d2"]
        assert f"producer rank 0 at 127.0.0.1:{port}" in reason, reason
        if reply is None:
            assert "no confirmation" in reason and "within 1 s" in reason, reason
            assert 1.0 <= elapsed < 4.0, elapsed
        else:
            assert "bad confirmation" in reason, reason
            assert dw.stats()["bad_messages"] >= 1
        assert seen, "the consumer never asked for a confirmation"
    finally:
        rogue.close(0)
        ctx.term()
        pw.close()
        dw.close()


def test_transfer_from_a_restarted_producer_is_refused():
    """kv_transfer_params name the engine that prefilled; if another engine
    (a restart) now answers on that port, its KV for the transfer is gone."""
    port = free_port()
    P, pw, _ = producer_engine(port)
    D, dw, _ = consumer_engine(port, handshake_timeout_s=2.0)
    try:
        params = P.prefill("r", 40)
        stale = dict(params, remote_engine_id="engine-before-restart")
        D.admit("d", 40, stale)
        run_until([P, D], lambda: "d" in D.failed or "d" in D.ready, timeout_s=10)
        assert "d" not in D.ready
        assert "restarted" in D.failed["d"] and "engine-before-restart" in D.failed["d"], D.failed
    finally:
        pw.close()
        dw.close()
