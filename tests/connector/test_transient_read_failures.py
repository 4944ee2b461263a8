"""Transient read failures, from the test-only fault injector (atom_kv/transfer/fault_injector.py).

A read that fails fewer times in a row than ``transfer_retries`` allows recovers on a retry, and its peer is kept
(no new handshake); a peer is dropped, and handshaked again on its next use, only once ``peer_failure_threshold``
reads in a row failed. Each failed attempt's log line names the bytes, the ranges and the peer.
"""

from __future__ import annotations

import logging
import re

import pytest

from atom_kv.transfer.fault_injector import READ_FAIL_ENV, SEED_ENV, FaultInjector, with_injected_faults
from tests.conftest import free_port
from tests.connector.engines import run_until
from tests.connector.inproc import NB, consumer_engine, producer_engine
from tests.connector.kvutil import check_blocks


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setenv(READ_FAIL_ENV, "0.0001")  # the hook on; the test says which reads fail
    monkeypatch.setenv(SEED_ENV, "1")
    port = free_port()
    P, pw, _ = producer_engine(port)
    D, dw, dcache = consumer_engine(port, transfer_retries=2, transfer_retry_backoff_ms=10.0,
                                    peer_failure_threshold=3, transfer_timeout_s=2.0)
    try:
        assert isinstance(dw.backend, FaultInjector), "the environment variable did not turn the injector on"
        dw.backend.read_fail = 0.0
        yield P, D, dw, dcache
    finally:
        pw.close()
        dw.close()


def _load(P, D, rid: str):
    params = P.prefill("p-" + rid, 40)
    blocks = D.admit(rid, 40, params)
    run_until([P, D], lambda: rid in D.ready or rid in D.failed)
    return params, blocks


def test_reads_recover_with_retries_and_the_peer_is_dropped_only_past_the_threshold(pair, caplog):
    P, D, dw, dcache = pair
    caplog.set_level(logging.INFO, logger="atom_kv.connector.reads")
    dw.backend.fail_next(2)  # two failures, then the third attempt (transfer_retries=2) reads
    params, blocks = _load(P, D, "d1")
    assert D.failed == {}, D.failed
    assert check_blocks(dcache, list(zip(blocks, params["remote_block_ids"])), 0, 1, NB) == ""
    s = dw.stats()
    assert (s["retries"], s["peers_dropped"], s["handshakes"]) == (2, 0, 1), s
    D.finish("d1")

    dw.backend.fail_next(2)  # the success started the count over: two more failures drop nothing either
    params, blocks = _load(P, D, "d2")
    assert D.failed == {} and dw.stats()["peers_dropped"] == 0, (D.failed, dw.stats())
    D.finish("d2")

    dw.backend.fail_next(3)  # three in a row: every attempt of d3 fails, the third reaches the threshold
    _load(P, D, "d3")
    assert "fault injector" in D.failed.get("d3", ""), D.failed
    s = dw.stats()
    assert (s["peers_dropped"], s["handshakes"]) == (1, 1), s

    params, blocks = _load(P, D, "d4")  # the next use handshakes again, and reads
    assert "d4" in D.ready, D.failed
    assert check_blocks(dcache, list(zip(blocks, params["remote_block_ids"])), 0, 1, NB) == ""
    assert dw.stats()["handshakes"] == 2, dw.stats()
    D.finish("d4")
    assert dw.backend.injected == 7

    attempts = [r.getMessage() for r in caplog.records if "attempt" in r.getMessage()]
    assert len(attempts) == 7, attempts
    for line in attempts:  # the bytes, the ranges and the peer (engine id, host and port)
        assert re.search(r"read of \d+ bytes in \d+ ranges from peer P at 127\.0\.0\.1:\d+ failed", line), line


def test_the_hook_is_off_unless_its_variable_says_a_fraction(monkeypatch):
    class Backend:
        name = "tcp"

    backend = Backend()
    assert with_injected_faults(backend, {}) is backend  # type: ignore[arg-type]
    assert with_injected_faults(backend, {READ_FAIL_ENV: "0"}) is backend  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=READ_FAIL_ENV):
        with_injected_faults(backend, {READ_FAIL_ENV: "often"})  # type: ignore[arg-type]
