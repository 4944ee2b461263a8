from tests.conftest import free_port
from tests.connector.engines import run_until
from tests.connector.inproc import NB, consumer_engine, producer_engine
from tests.connector.kvutil import check_blocks


def test_retries_then_peer_dropped_after_threshold_then_rehandshake():
    port = free_port()
    P1, pw1, _ = producer_engine(port)
    D, dw, dcache = consumer_engine(port, transfer_retries=2, peer_failure_threshold=2, transfer_timeout_s=1.0)
    pw2 = None
    try:
        params = P1.prefill("r1", 40)
        blocks = D.admit("d1", 40, params)
        run_until([P1, D], lambda: "d1" in D.ready)
        assert dw.stats()["handshakes"] == 1
        D.finish("d1")
        # the producer restarts on the same handshake port: the cached peer is stale
        pw1.close()
        P2, pw2, _ = producer_engine(port, shift_regions=True)
        params = P2.prefill("r2", 40)
        blocks = D.admit("d2", 40, params)
        run_until([P2, D], lambda: "d2" in D.ready or "d2" in D.failed)
        assert D.failed == {}
        s = dw.stats()
        assert s["retries"] == 2, s           # two failed reads on the stale peer
        assert s["peers_dropped"] == 1, s     # declared failed at the threshold
        assert s["handshakes"] == 2, s        # then re-handshaked
        assert check_blocks(dcache, list(zip(blocks, params["remote_block_ids"])), 0, 1, NB) == ""
        run_until([P2], lambda: "r2" in P2.freed)
    finally:
        pw1.close()
        if pw2 is not None:
            pw2.close()
        dw.close()


def test_unreachable_producer_fails_within_budget_without_stalling_others():
    port = free_port()
    dead_port = free_port()
    P, pw, _ = producer_engine(port)
    D, dw, dcache = consumer_engine(port, handshake_timeout_s=0.3, transfer_timeout_s=0.3, transfer_retries=1)
    try:
        good = P.prefill("r1", 30)
        bad = dict(good, remote_handshake_port=dead_port, remote_port=dead_port, transfer_id="P-ghost")
        D.admit("bad", 30, bad)
        blocks = D.admit("good", 30, good)
        run_until([P, D], lambda: "good" in D.ready and "bad" in D.failed, timeout_s=15)
        assert "no handshake reply" in D.failed["bad"]
        assert check_blocks(dcache, list(zip(blocks, good["remote_block_ids"])), 0, 1, NB) == ""
        assert dw.stats()["handshake_failures"] >= 2
        D.finish("good")
        assert D.pool.held == {}
    finally:
        pw.close()
        dw.close()
