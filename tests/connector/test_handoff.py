"""The short handoff after a rendezvous: the producer's answer is a promise to hold the
blocks (``lease_ms``), a third party's release waits for it, and a consumer whose read
ended inside it sends its done-reading notices without waiting for a confirmation.

Each test races a proxy's release against the read by sending the release from inside
the consumer's backend read (after the answer, before the bytes move), so the order is
fixed, not left to timing."""

from __future__ import annotations

import threading
import time

from atom_kv.connector.producer_transfers import Stage
from atom_kv.connector.release import NoticeSender, ReleaseSpec
from tests.conftest import free_port
from tests.connector.engines import run_until
from tests.connector.inproc import NB, consumer_engine, producer_engine
from tests.connector.kvutil import check_blocks
from tests.connector.test_rendezvous import TOKEN, finish_prefill, pending, start_prefill


def _wait(cond, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)


def _release_during_read(dw, pw, port: int, tid: str, *, delay_after_s: float = 0.0) -> dict:
    """Make the consumer's first read send the proxy's release of ``tid`` and wait until the
    producer has taken it in (held or applied), then sleep ``delay_after_s``, then read."""
    proxy = NoticeSender(auth_token=TOKEN, sender="proxy", proof_timeout_s=2.0)
    seen = {"released_before_read": None}
    real_read = dw.backend.read
    once = threading.Lock()

    def read(peer_id, ops, *, timeout_s):
        if once.acquire(blocking=False):
            proxy.release(ReleaseSpec(tid, "127.0.0.1", port), "the client left")
            _wait(lambda: pw.stats_.snapshot().get("releases_received", 0) >= 1)
            seen["released_before_read"] = pw.transfers.stage(tid) is Stage.RELEASED
            time.sleep(delay_after_s)
        return real_read(peer_id, ops, timeout_s=timeout_s)

    dw.backend.read = read
    seen["proxy"] = proxy
    return seen


def test_a_proxy_release_racing_the_read_waits_for_the_promise_and_the_read_needs_no_confirmation():
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    D, dw, dcaches = consumer_engine(port, auth_token=TOKEN)
    seen = _release_during_read(dw, pw, port, "t-race")
    try:
        start_prefill(P, "p", "t-race", 40)
        local = D.admit("d", 40, pending(port, "t-race"))
        params = finish_prefill(P, "p")
        t0 = time.monotonic()
        run_until([P, D], lambda: "d" in (set(D.ready) | set(D.failed)) and "p" in P.freed, timeout_s=10)
        assert D.failed == {} and "d" in D.ready
        assert seen["released_before_read"] is False  # the release waited for the promise
        assert check_blocks(dcaches, list(zip(local, params["remote_block_ids"])), 0, 1, NB) == ""
        assert dw.stats_.snapshot()["confirmations_skipped"] == 1
        assert time.monotonic() - t0 < 2.0  # blocks back on the prefill within 2 s
        D.finish("d")
        assert D.pool.held == {} and P.pool.held == {}
    finally:
        seen["proxy"].close()
        pw.close()
        dw.close()


def test_a_read_that_outlasts_the_promise_asks_for_the_confirmation_and_the_release_wins():
    """A short lease (abort_timeout_s leaves ~0.5 s of promise): the read sleeps past it, the held
    release is then taken, and the confirmation the consumer now asks for is refused: the load
    fails instead of trusting blocks the producer may have reused."""
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN, abort_timeout_s=1.5)
    D, dw, _ = consumer_engine(port, auth_token=TOKEN)
    seen = _release_during_read(dw, pw, port, "t-late", delay_after_s=1.0)
    try:
        start_prefill(P, "p", "t-late", 40)
        D.admit("d", 40, pending(port, "t-late"))
        finish_prefill(P, "p")
        run_until([P, D], lambda: "d" in D.failed, timeout_s=10)
        assert "released" in D.failed["d"], D.failed
        assert dw.stats_.snapshot()["confirmations_skipped"] == 0
        t0 = time.monotonic()
        run_until([P, D], lambda: "p" in P.freed, timeout_s=5)
        assert time.monotonic() - t0 < 2.0
        assert D.pool.held == {} and P.pool.held == {}
    finally:
        seen["proxy"].close()
        pw.close()
        dw.close()


def test_the_consumers_own_release_is_taken_at_once_despite_the_promise():
    """The decode's client left while its read was in flight: the decode engine's release frees
    the prefill's blocks at once (it discards what it reads), the promise notwithstanding."""
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN)
    D, dw, _ = consumer_engine(port, auth_token=TOKEN)
    in_read, go_on = threading.Event(), threading.Event()
    real_read = dw.backend.read

    def read(peer_id, ops, *, timeout_s):
        in_read.set()
        go_on.wait(5.0)
        return real_read(peer_id, ops, timeout_s=timeout_s)

    dw.backend.read = read
    try:
        start_prefill(P, "p", "t-own", 40)
        D.admit("d", 40, pending(port, "t-own"))
        finish_prefill(P, "p")
        run_until([P, D], in_read.is_set, timeout_s=5)
        assert pw.transfers.get("t-own").pin is not None  # the promise was given
        t0 = time.monotonic()
        D.finish("d", aborted=True)  # the decode engine's release goes to the prefill now
        run_until([P, D], lambda: "p" in P.freed, timeout_s=5)
        assert time.monotonic() - t0 < 2.0 and P.pool.held == {}
        go_on.set()
        run_until([P, D], lambda: "d" in D.freed, timeout_s=5)
        assert D.pool.held == {} and "d" not in D.ready
    finally:
        go_on.set()
        pw.close()
        dw.close()
