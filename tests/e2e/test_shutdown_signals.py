"""A second SIGTERM hurries the reference engine's orderly shutdown, against real processes.

A decode engine (one request at a time, ``--shutdown-timeout`` 300 s) holds two
requests: one whose KV load waits on a prefill engine that never answers (its
handshake may take 300 s), and one queued behind it that names KV a real
prefill engine holds for it (a 600 s lease). The first SIGTERM starts the
orderly shutdown, which would wait for both; the second hurries it: the
engine exits 0 within seconds, both clients get an answer, and the queued
request's release reaches the prefill engine, whose blocks come back long
before their lease would free them. Today's engine ignored the second
signal while it waited (and died of one, -15, once it was closing).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.ports import free_port
from atom_kv.testing.web import http_json
from tests.e2e.helpers import generate

ORDERLY_WAIT_S = 300.0  # what the orderly shutdown would wait for the stuck load
HURRIED_WITHIN_S = 30.0  # generous on a loaded machine, ten times less than the orderly wait
RELEASED_WITHIN_S = 10.0
LEASE_S = 600.0
PROMPT = "A prefill engine lends this prompt's blocks to the decode engine. " * 2


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(
        [
            EngineSpec("P", extra_config={"abort_timeout_s": LEASE_S}),
            EngineSpec("D", extra_config={"handshake_timeout_s": ORDERLY_WAIT_S, "transfer_retries": 0},
                       extra_args=["--max-num-seqs", "1", "--shutdown-timeout", str(ORDERLY_WAIT_S)]),
        ],
        with_proxy=False,
        # with the cluster's token: a release first waits for the producer to prove it, and the release
        # sender waits for that proof when the engine closes
        log_dir=str(tmp_path),
    )
    c.start()
    try:
        yield c
    finally:
        c.close()


def _refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_second_sigterm_hurries_the_orderly_shutdown_and_still_releases(cluster):
    p, d = cluster.index_of("P"), cluster.index_of("D")
    status, body = http_json("POST", cluster.engine_url(p) + "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}, timeout=60)
    assert status == 200, body
    held = body["kv_transfer_params"]
    assert cluster.engine_health(p)["kv_blocks"]["held"] == len(held["remote_block_ids"]) > 0
    decode = dict(held, do_remote_prefill=True, do_remote_decode=False)
    dead = free_port()  # nothing listens there: the load's handshake waits ORDERLY_WAIT_S
    stuck = dict(decode, remote_engine_id="gone", remote_port=dead, remote_handshake_port=dead,
                 transfer_id="gone-1")
    url = cluster.engine_url(d)
    engine = cluster.engines[d].proc
    pool = ThreadPoolExecutor(2)
    try:
        first = pool.submit(generate, url, PROMPT, chat=False, stream=False, max_tokens=4,
                            timeout=ORDERLY_WAIT_S + 60, extra={"kv_transfer_params": stuck})
        wait_until(lambda: cluster.engine_health(d)["requests"]["waiting_remote_kv"] == 1, 30,
                   what="the stuck load to start")
        queued = pool.submit(generate, url, PROMPT, chat=False, stream=False, max_tokens=4,
                             timeout=ORDERLY_WAIT_S + 60, extra={"kv_transfer_params": decode})
        wait_until(lambda: cluster.engine_health(d)["requests"]["waiting"] == 1, 30,
                   what="the second request to queue behind the stuck one")

        engine.send_signal(signal.SIGTERM)
        wait_until(lambda: _refuses_connections(cluster.ports[d]), 10,
                   what="the decode engine to stop accepting connections (its orderly shutdown began)")
        assert engine.poll() is None  # the orderly shutdown waits for the two requests
        hurried = time.monotonic()
        engine.send_signal(signal.SIGTERM)
        try:
            rc = engine.wait(HURRIED_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the decode engine still runs {HURRIED_WITHIN_S:g} s after the second SIGTERM "
                        f"(the orderly shutdown would wait up to {ORDERLY_WAIT_S:g} s)")
        took = time.monotonic() - hurried
        answers = [first.result(30), queued.result(30)]
    finally:
        if engine.poll() is None:
            cluster.engines[d].kill()  # a failed run leaves no client waiting for ORDERLY_WAIT_S
        pool.shutdown(wait=False)

    assert rc == 0, (rc, cluster.engines[d].tail())
    assert took < HURRIED_WITHIN_S
    for answer in answers:  # nobody is left hanging: both end now, as the engine shuts down
        assert answer.status == 503 and "shutting down" in (answer.error or ""), answer
    # the queued request's release reached the prefill engine: its blocks are back, the lease was 600 s
    wait_until(lambda: cluster.engine_health(p)["kv_blocks"]["held"] == 0, RELEASED_WITHIN_S, interval=0.05,
               what=f"the prefill engine's blocks to come back within {RELEASED_WITHIN_S:g} s of the shutdown")
    log = cluster.engines[d].log_text()  # one line per signal, saying what happens now
    assert log.count("SIGTERM: shutting down in order") == 1
    assert log.count("second SIGTERM: hurrying the shutdown") == 1
