"""Concurrent dispatch against real processes: the proxy sends both legs at once
(``--concurrent-dispatch``; both engines announce the rendezvous), and every way
a request can end before the decode engine owns the KV gives the blocks back on
both engines within 2 s: the prefill fails, the decode is rejected, the prefill
is slower than the decode's ``prefill_wait_timeout_s``, the client leaves.

One cluster for the module. The prefill engine holds 2,048 tokens, the decode
engine 4,096, so each side can refuse a request the other takes. The prefill's
lease (``abort_timeout_s``) is 120 s: only a release can free its blocks in time.
"""

from __future__ import annotations

import http.client
import json
import time

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json, scrape_metrics
from tests.e2e.helpers import PROMPTS, generate, get_json

RELEASE_WITHIN_S = 2.0
WAIT_S = 1.0  # the decode engine's prefill_wait_timeout_s


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(
        [
            EngineSpec("P", num_blocks=128, extra_config={"abort_timeout_s": 120.0}),
            EngineSpec("D", num_blocks=256, extra_config={"prefill_wait_timeout_s": WAIT_S}),
        ],
        proxy_args=["--concurrent-dispatch", "--circuit-failures", "100"],
        log_dir=str(tmp_path_factory.mktemp("concurrent-dispatch")),
    )
    c.start()
    try:
        yield c
    finally:
        c.close()


def _free(c: Cluster, i: int) -> bool:
    kv = c.engine_health(i, timeout=2)["kv_blocks"]
    return kv["free"] == kv["total"]


def _both_free_within(c: Cluster, since: float, seconds: float = RELEASE_WITHIN_S) -> None:
    for i in (c.index_of("P"), c.index_of("D")):
        wait_until(lambda: _free(c, i), max(0.1, seconds - (time.monotonic() - since)), interval=0.05,
                   what=f"every KV block of engine {i} to be free within {seconds:g} s")


def _metric(c: Cluster, name: str) -> float:
    return scrape_metrics(c.proxy_url + "/metrics").get(name, 0.0)


def test_both_engines_announce_the_rendezvous_and_the_legs_go_out_together(cluster):
    for i in range(2):
        assert "rendezvous" in cluster.engine_health(i, timeout=2)["kv_features"]
    before = _metric(cluster, "atom_kv_proxy_concurrent_dispatches_total")
    res = generate(cluster.proxy_url, PROMPTS[0], chat=False, stream=True, max_tokens=6)
    assert res.status == 200 and res.error is None and len(res.text) == 6, res
    assert _metric(cluster, "atom_kv_proxy_concurrent_dispatches_total") - before == 1
    _both_free_within(cluster, time.monotonic())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_seeded_sampling_samples_every_position_once_and_equals_colocated(cluster, colocated, stream):
    """The decode engine continues from the prefill's token (brought by the rendezvous): it samples
    max_tokens - 1 positions, and the answer equals a colocated engine's."""
    extra = {"temperature": 2.0, "seed": 77}
    d = cluster.index_of("D")
    before = scrape_metrics(cluster.engine_url(d) + "/metrics")["atom_kv_generation_tokens_total"]
    forwarded = _metric(cluster, "atom_kv_proxy_first_tokens_forwarded_total")
    res = generate(cluster.proxy_url, PROMPTS[1], chat=True, stream=stream, max_tokens=10, extra=extra)
    direct = generate(colocated.url, PROMPTS[1], chat=True, stream=stream, max_tokens=10, extra=extra)
    assert res.error is None and direct.error is None, (res, direct)
    assert res.text == direct.text and len(res.text) == 10
    after = scrape_metrics(cluster.engine_url(d) + "/metrics")["atom_kv_generation_tokens_total"]
    assert after - before == 9
    # streamed: the first token went out from the prefill's answer, the decode engine left it out
    assert _metric(cluster, "atom_kv_proxy_first_tokens_forwarded_total") - forwarded == (1 if stream else 0)
    _both_free_within(cluster, time.monotonic())


def test_prefill_fails(cluster):
    """The prefill engine refuses the prompt (too long for it) while the decode engine waits on it."""
    t0 = time.monotonic()
    status, body = http_json("POST", cluster.proxy_url + "/v1/completions",
                             {"prompt": "f" * 3000, "max_tokens": 4}, timeout=30)
    assert status == 400 and "blocks" in json.dumps(body), body
    _both_free_within(cluster, time.monotonic())
    assert time.monotonic() - t0 < 10
    assert _metric(cluster, 'atom_kv_proxy_abandoned_prefills_total{reason="prefill_failed"}') >= 1


def test_decode_rejected(cluster):
    """The decode engine refuses the request (prompt + max_tokens too long for it) while the prefill computes."""
    status, body = http_json("POST", cluster.proxy_url + "/v1/completions",
                             {"prompt": "r" * 1500, "max_tokens": 3000}, timeout=30)
    answered = time.monotonic()
    assert status == 400 and "blocks" in json.dumps(body), body
    _both_free_within(cluster, answered)
    assert _metric(cluster, 'atom_kv_proxy_abandoned_prefills_total{reason="decode_rejected"}') >= 1


def test_prefill_slower_than_the_wait(cluster):
    """The decode leg came, its prefill did not within ``prefill_wait_timeout_s``: the decode engine
    fails the request naming the prefill side and frees its blocks; when the prefill does come,
    its blocks are free at once (the decode engine released the transfer)."""
    p, d = cluster.index_of("P"), cluster.index_of("D")
    prefill = next(i for i in get_json(cluster.proxy_url + "/instances")[1] if i["role"] == "P")
    kv = {"do_remote_prefill": True, "remote_blocks_pending": True, "remote_engine_id": prefill["engine_id"],
          "remote_host": "127.0.0.1", "remote_handshake_port": prefill["handshake_port"],
          "remote_tp_size": 1, "transfer_id": "slow-prefill-1"}
    t0 = time.monotonic()
    status, body = http_json("POST", cluster.engine_url(d) + "/v1/completions",
                             {"prompt": PROMPTS[1], "max_tokens": 4, "kv_transfer_params": kv}, timeout=30)
    waited = time.monotonic() - t0
    assert status == 502 and "slow-prefill-1" in json.dumps(body), body
    assert WAIT_S <= waited < WAIT_S + 5, waited
    _both_free_within(cluster, time.monotonic())
    status, body = http_json("POST", cluster.engine_url(p) + "/v1/completions", {
        "prompt": PROMPTS[1], "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "slow-prefill-1"}}, timeout=30)
    assert status == 200 and body["kv_transfer_params"]["transfer_id"] == "slow-prefill-1", body
    _both_free_within(cluster, time.monotonic())


def test_client_leaves_while_the_prefill_computes(cluster):
    p, d = cluster.index_of("P"), cluster.index_of("D")
    conn = http.client.HTTPConnection("127.0.0.1", cluster.proxy_port, timeout=30)
    # long enough to see both engines busy, short enough that the prefill's one step (which a release
    # cannot cut short) ends well within the bound on a loaded machine
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "c" * 1000, "max_tokens": 4, "stream": True}),
                 {"Content-Type": "application/json"})
    wait_until(lambda: cluster.engine_health(d, timeout=2)["requests"]["waiting_remote_kv"] >= 1
               and sum(cluster.engine_health(p, timeout=2)["requests"].values()) >= 1, 20, interval=0.01,
               what="the decode engine to wait on the prefill while it computes")
    conn.close()
    left = time.monotonic()
    _both_free_within(cluster, left)
    wait_until(lambda: sum(cluster.engine_health(d, timeout=2)["requests"].values()) == 0, 5, interval=0.05,
               what="the decode engine to drop the request")
    assert _metric(cluster, 'atom_kv_proxy_abandoned_prefills_total{reason="client_gone"}') >= 1
