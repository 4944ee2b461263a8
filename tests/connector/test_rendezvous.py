"""The rendezvous: a decode load admitted before its prefill finished learns the
transfer's block ids from the producer rank (keyed by transfer_id), then reads;
every way it can end frees the blocks on both engines."""

import time

import pytest

from atom_kv.connector.release import NoticeSender, ReleaseSpec
from tests.conftest import free_port
from tests.connector.engines import run_until
from tests.connector.inproc import NB, consumer_engine, producer_engine
from tests.connector.kvutil import BLOCK, check_blocks

TOKEN = "rendezvous-secret"


def pending(port: int, tid: str) -> dict:
    """A decode leg's kv_transfer_params sent at the same time as the prefill leg."""
    return {"do_remote_prefill": True, "remote_blocks_pending": True, "remote_engine_id": "P",
            "remote_host": "127.0.0.1", "remote_handshake_port": port, "remote_tp_size": 1, "transfer_id": tid}


def start_prefill(P, rid: str, tid: str, num_tokens: int) -> None:
    assert P.sched.get_num_new_matched_tokens(rid, num_tokens, {"do_remote_decode": True, "transfer_id": tid}) == (0, False)
    P.pool.alloc(rid, -(-num_tokens // BLOCK))


def finish_prefill(P, rid: str) -> dict:
    delay, params = P.sched.request_finished(rid, P.pool.held[rid])
    assert delay and params is not None
    return params


@pytest.mark.parametrize("token", [None, TOKEN])
def test_decode_admitted_first_reads_the_blocks_once_the_prefill_finishes(token):
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=token)
    D, dw, dcaches = consumer_engine(port, auth_token=token)
    try:
        P.pool.alloc("offset", 5)  # producer and consumer block ids differ
        start_prefill(P, "p", "t-1", 40)
        local = D.admit("d", 40, pending(port, "t-1"))
        for _ in range(20):  # the decode waits while the prefill computes
            P.step()
            D.step()
            time.sleep(0.005)
        assert "d" not in D.ready and "d" not in D.failed and dw.num_loading() == 1
        params = finish_prefill(P, "p")
        run_until([P, D], lambda: "d" in D.ready and "p" in P.freed, timeout_s=10)
        assert D.failed == {} and P.freed == ["p"]
        assert check_blocks(dcaches, list(zip(local, params["remote_block_ids"])), 0, 1, NB) == ""
        D.finish("d")
        assert D.pool.held == {} and set(P.pool.held) == {"offset"}
    finally:
        pw.close()
        dw.close()


def test_the_prefills_first_token_comes_with_the_blocks_to_a_decode_that_asked_for_it():
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    D, dw, _ = consumer_engine(port, auth_token=TOKEN)
    try:
        start_prefill(P, "p1", "t-asks", 40)
        start_prefill(P, "p2", "t-quiet", 40)
        D.admit("d1", 40, {**pending(port, "t-asks"), "first_token_pending": True})
        D.admit("d2", 40, pending(port, "t-quiet"))  # computes its first token itself
        for rid, token in (("p1", 65), ("p2", 66)):
            delay, params = P.sched.request_finished(rid, P.pool.held[rid], first_token_ids=[token])
            assert delay and params is not None and params["first_token_ids"] == [token]
        run_until([P, D], lambda: {"d1", "d2"} <= set(D.ready), timeout_s=10)
        assert D.first_tokens == {"d1": [65]} and D.failed == {}
    finally:
        pw.close()
        dw.close()


def test_prefill_the_producer_never_heard_of_fails_the_load_after_the_wait():
    port = free_port()
    P, pw, _ = producer_engine(port, prefill_wait_timeout_s=0.5)
    D, dw, _ = consumer_engine(port, prefill_wait_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        D.admit("d", 40, pending(port, "t-elsewhere"))  # no prefill admitted it here
        run_until([P, D], lambda: "d" in D.failed, timeout_s=10)
        assert 0.5 <= time.monotonic() - t0 < 5.0
        assert "t-elsewhere" in D.failed["d"] and "within" in D.failed["d"], D.failed
        assert D.pool.held == {}
    finally:
        pw.close()
        dw.close()


def test_queued_prefill_past_the_wait_is_still_coming_and_the_load_succeeds():
    """The producer's scheduler admitted the prefill (queued or computing): a question whose wait
    ends is answered "still coming" and asked again, so a slow queue does not fail the load."""
    port = free_port()
    P, pw, _ = producer_engine(port, prefill_wait_timeout_s=0.3)
    D, dw, dcaches = consumer_engine(port, prefill_wait_timeout_s=0.3, prefill_queue_timeout_s=30.0)
    try:
        start_prefill(P, "p", "t-queued", 40)
        local = D.admit("d", 40, pending(port, "t-queued"))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:  # five waits' worth
            P.step()
            D.step()
            time.sleep(0.01)
        assert "d" not in D.failed and dw.num_loading() == 1, D.failed
        params = finish_prefill(P, "p")
        t1 = time.monotonic()
        run_until([P, D], lambda: "d" in D.ready and "p" in P.freed, timeout_s=5)
        assert time.monotonic() - t1 < 2.0 and D.failed == {}
        assert check_blocks(dcaches, list(zip(local, params["remote_block_ids"])), 0, 1, NB) == ""
        D.finish("d")
        assert D.pool.held == {} and P.pool.held == {}
    finally:
        pw.close()
        dw.close()


def test_queued_prefill_past_the_queue_bound_fails_the_load_and_frees_both_sides():
    port = free_port()
    P, pw, _ = producer_engine(port, prefill_wait_timeout_s=0.3)
    D, dw, _ = consumer_engine(port, prefill_wait_timeout_s=0.3, prefill_queue_timeout_s=1.0)
    try:
        start_prefill(P, "p", "t-stuck", 40)
        t0 = time.monotonic()
        D.admit("d", 40, pending(port, "t-stuck"))
        run_until([P, D], lambda: "d" in D.failed, timeout_s=10)
        assert 1.0 <= time.monotonic() - t0 < 5.0
        assert "prefill_queue_timeout_s" in D.failed["d"], D.failed
        assert D.pool.held == {}
        finish_prefill(P, "p")  # the decode's release came first: the lease ends at once
        t1 = time.monotonic()
        run_until([P, D], lambda: "p" in P.freed, timeout_s=10)
        assert time.monotonic() - t1 < 2.0 and P.pool.held == {}
    finally:
        pw.close()
        dw.close()


def test_prefill_aborted_while_a_question_waits_is_answered_at_once():
    port = free_port()
    P, pw, _ = producer_engine(port, prefill_wait_timeout_s=30.0)
    D, dw, _ = consumer_engine(port, prefill_wait_timeout_s=30.0)
    try:
        start_prefill(P, "p", "t-aborted", 40)
        D.admit("d", 40, pending(port, "t-aborted"))
        for _ in range(10):
            P.step()
            D.step()
            time.sleep(0.01)
        P.finish("p", aborted=True)  # no release from anyone: the scheduler's own word is enough
        t0 = time.monotonic()
        run_until([P, D], lambda: "d" in D.failed, timeout_s=5)
        assert time.monotonic() - t0 < 2.0
        assert "without lending blocks" in D.failed["d"], D.failed
        assert D.pool.held == {} and P.pool.held == {}
    finally:
        pw.close()
        dw.close()


def test_prefill_that_fails_is_released_and_the_waiting_decode_fails_at_once():
    """The proxy releases a transfer whose prefill failed: the question waiting
    on the producer is answered at once instead of after the wait."""
    port = free_port()
    P, pw, _ = producer_engine(port, prefill_wait_timeout_s=30.0)
    D, dw, _ = consumer_engine(port, prefill_wait_timeout_s=30.0)
    proxy = None
    try:
        start_prefill(P, "p", "t-fail", 40)
        D.admit("d", 40, pending(port, "t-fail"))
        for _ in range(10):
            P.step()
            D.step()
            time.sleep(0.01)
        P.finish("p", aborted=True)  # the prefill engine failed the request: its blocks are its own again
        proxy = NoticeSender(auth_token=None, sender="proxy", proof_timeout_s=2.0)
        proxy.release(ReleaseSpec("t-fail", "127.0.0.1", port), "the prefill failed")  # the abandoned pair's release
        t0 = time.monotonic()
        # "at once": well inside the 30 s the decode would otherwise wait (bounds loose enough for a loaded box)
        run_until([P, D], lambda: "d" in D.failed, timeout_s=15)
        assert time.monotonic() - t0 < 10.0
        assert "released" in D.failed["d"], D.failed
        assert D.pool.held == {} and P.pool.held == {}
    finally:
        if proxy is not None:
            proxy.close()
        pw.close()
        dw.close()


def test_decode_that_ends_while_waiting_frees_its_blocks_and_the_prefill_gets_its_back():
    """The client left (or the decode engine rejected the request) while the prefill computed."""
    port = free_port()
    P, pw, _ = producer_engine(port)
    D, dw, _ = consumer_engine(port)
    try:
        start_prefill(P, "p", "t-gone", 40)
        D.admit("d", 40, pending(port, "t-gone"))
        for _ in range(10):
            P.step()
            D.step()
            time.sleep(0.01)
        t0 = time.monotonic()
        D.finish("d", aborted=True)
        run_until([P, D], lambda: "d" in D.freed, timeout_s=5)
        assert time.monotonic() - t0 < 2.0 and D.pool.held == {} and dw.num_loading() == 0
        finish_prefill(P, "p")
        run_until([P, D], lambda: "p" in P.freed, timeout_s=5)
        assert time.monotonic() - t0 < 2.0 and P.pool.held == {}
    finally:
        pw.close()
        dw.close()


def test_answer_signed_with_another_token_is_never_taken():
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token="one-token", prefill_wait_timeout_s=0.5)
    D, dw, _ = consumer_engine(port, auth_token="another-token", prefill_wait_timeout_s=0.5)
    try:
        start_prefill(P, "p", "t-auth", 40)
        finish_prefill(P, "p")  # the producer knows the blocks, but cannot prove the token
        D.admit("d", 40, pending(port, "t-auth"))
        run_until([P, D], lambda: "d" in D.failed, timeout_s=10)
        assert "d" not in D.ready and D.pool.held == {}
        assert pw.handshake_server.refusals().get("auth", 0) >= 1
    finally:
        pw.close()
        dw.close()


def test_loads_waiting_on_slow_prefills_never_hold_up_a_load_whose_blocks_are_known():
    """More loads wait on their prefills than the rank has read threads; one whose prefill
    finished still reads at once."""
    port = free_port()
    P, pw, _ = producer_engine(port)
    D, dw, _ = consumer_engine(port, prefill_wait_timeout_s=20.0)
    try:
        waiting = [f"d-wait-{i}" for i in range(8)]
        for i, rid in enumerate(waiting):
            D.admit(rid, 16, pending(port, f"t-never-{i}"))
        start_prefill(P, "p", "t-now", 16)
        D.admit("d-now", 16, pending(port, "t-now"))
        finish_prefill(P, "p")
        run_until([P, D], lambda: "d-now" in D.ready, timeout_s=5)
        assert not any(rid in D.ready or rid in D.failed for rid in waiting)
        for rid in waiting:
            D.finish(rid, aborted=True)
        run_until([P, D], lambda: all(rid in D.freed for rid in waiting), timeout_s=5)
    finally:
        pw.close()
        dw.close()


def test_the_blocks_clients_answer_without_blocks_carries_a_typed_reason_next_to_the_producers_words():
    import threading

    import zmq

    from atom_kv.connector.reasons import BlocksFailure, NoBlocks
    from atom_kv.connector.rendezvous import BlocksClient
    from atom_kv.connector.stats import TransferStats
    from atom_kv.wire import BlocksQuery

    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    ctx = zmq.Context()
    client = BlocksClient(ctx, stats=TransferStats("test"), auth_token=TOKEN)
    stop, cancelled = threading.Event(), threading.Event()
    try:
        query = BlocksQuery(transfer_id="never", engine_id="D", tp_rank=0, tp_size=1)
        refused = client.blocks("127.0.0.1", port, query, 0.0, stop, cancelled)
        assert isinstance(refused, NoBlocks) and refused.reason is BlocksFailure.REFUSED
        assert "was not issued by producer P rank 0" in refused.text and str(refused) == refused.text
        cancelled.set()
        gone = client.blocks("127.0.0.1", port, query, 5.0, stop, cancelled)
        assert isinstance(gone, NoBlocks) and gone.reason is BlocksFailure.CANCELLED
    finally:
        client.close()
        ctx.term()
        pw.close()
