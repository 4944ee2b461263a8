import time

from tests.conftest import free_port
from tests.connector.engines import run_until
from tests.connector.inproc import producer_engine


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
