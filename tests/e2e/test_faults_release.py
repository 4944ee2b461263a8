"""Issue 11, item 1, against real processes: a prefill's blocks are free within 2 s of the
moment the proxy or the decode engine knows its KV will not be read, and no client is
left hanging.

One cluster (a proxy, a prefill engine and two decode engines) for the module; the tests
run in file order and the last ones kill what they need (a decode engine, the proxy).
The prefill's lease (``abort_timeout_s``) is 120 s, so only a release can free its
blocks in time. Every client call has a timeout and must come back with an answer;
blocks are polled on the prefill engine's ``/health`` with a deadline.
"""

from __future__ import annotations

import http.client
import json
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from atom_kv.testing.listeners import listeners
from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.processes import ManagedProcess
from atom_kv.testing.web import http_json, scrape_metrics
from tests.e2e.helpers import PROMPTS, generate, get_json

RELEASE_WITHIN_S = 2.0
LEASE_S = 120.0
LONG_PROMPT = "A long prompt keeps the prefill engine busy for a while. " * 21  # ~1200 tokens: ~0.6 s here


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(
        [
            EngineSpec("P", num_blocks=512, extra_config={"abort_timeout_s": LEASE_S}),
            # one request at a time, so the next ones queue on the decode engine
            EngineSpec("D", num_blocks=256, extra_args=["--max-num-seqs", "1", "--max-model-len", "4096"]),
            EngineSpec("D", num_blocks=256, extra_args=["--max-model-len", "4096"]),
        ],
        heartbeat_timeout=30.0,  # a killed engine stays "registered": only traffic can tell the proxy
        ping_interval_s=0.3,
        proxy_args=["--shutdown-timeout", "0.5", "--circuit-failures", "100"],
        log_dir=str(tmp_path_factory.mktemp("faults-release")),
    )
    c.start()
    try:
        yield c
    finally:
        c.close()


def _p(c: Cluster) -> int:
    return c.index_of("P")


def _kv(c: Cluster, i: int) -> dict:
    status, body = get_json(c.engine_url(i) + "/health", timeout=2)
    assert status == 200, body
    return body["kv_blocks"]


def _all_free_within(c: Cluster, i: int, seconds: float = RELEASE_WITHIN_S) -> None:
    """Every KV block of engine ``i`` is free within ``seconds`` (polled, never slept on)."""
    wait_until(lambda: (lambda kv: kv["free"] == kv["total"])(_kv(c, i)), seconds, interval=0.05,
               what=f"every KV block of engine {i} to be free within {seconds:g} s")


def _prefill_by_hand(c: Cluster, prompt: str) -> dict:
    """The prefill leg as a router sends it; returns the producer's kv_transfer_params (now held)."""
    status, body = http_json("POST", c.engine_url(_p(c)) + "/v1/completions", {
        "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}, timeout=30)
    assert status == 200, body
    params = body["kv_transfer_params"]
    kv = _kv(c, _p(c))
    assert kv["held"] == len(params["remote_block_ids"]) > 0  # lent to a reader until released
    return params


# --- the decode engine rejects: it releases the prefill itself -------------------
@pytest.mark.parametrize("max_tokens", [-1, 0, 10**9, "a string"], ids=["-1", "0", "too-large", "string"])
def test_invalid_max_tokens(cluster, max_tokens):
    # through the proxy: refused before any prefill is spent
    t0 = time.monotonic()
    status, body = http_json("POST", cluster.proxy_url + "/v1/completions",
                             {"prompt": PROMPTS[1], "max_tokens": max_tokens}, timeout=10)
    assert status == 400 and "max_tokens" in json.dumps(body), body
    assert time.monotonic() - t0 < 5
    _all_free_within(cluster, _p(cluster))
    # a router that does not check sends it to the decode engine after the prefill: the decode
    # engine rejects it and releases the prefill's blocks
    params = _prefill_by_hand(cluster, PROMPTS[1])
    d = cluster.index_of("D", 1)
    status, body = http_json("POST", cluster.engine_url(d) + "/v1/completions", {
        "prompt": PROMPTS[1], "max_tokens": max_tokens, "kv_transfer_params": params}, timeout=10)
    assert status == 400, body
    _all_free_within(cluster, _p(cluster))


def test_prompt_plus_max_tokens_overflowing_the_model_length(cluster):
    prompt = "a" * 10000  # 10000 tokens for a 4096-token decode engine
    t0 = time.monotonic()
    status, body = http_json("POST", cluster.proxy_url + "/v1/completions",
                             {"prompt": prompt, "max_tokens": 500}, timeout=10)
    assert status == 400 and "maximum context length is 4096" in body["error"]["message"], body
    assert time.monotonic() - t0 < 3  # no 8 s detour through a prefill
    _all_free_within(cluster, _p(cluster))
    params = _prefill_by_hand(cluster, "b" * 3800)  # fits the prefill engine, not 3800 + 500 at decode
    d = cluster.index_of("D", 1)
    status, body = http_json("POST", cluster.engine_url(d) + "/v1/completions", {
        "prompt": "b" * 3800, "max_tokens": 500, "kv_transfer_params": params}, timeout=10)
    assert status == 400 and "maximum context length" in body["error"]["message"], body
    _all_free_within(cluster, _p(cluster))


def test_a_load_failed_by_the_prefill_side_says_so(cluster):
    """The decode engine names the prefill side in its error answer, so a proxy does not
    open the healthy decode engine's breaker (``X-KV-Transfer-Failure: prefill``)."""
    params = _prefill_by_hand(cluster, PROMPTS[0])
    params = dict(params, do_remote_prefill=True, remote_engine_id="an-engine-that-restarted")
    d = cluster.index_of("D", 1)
    req = urllib.request.Request(cluster.engine_url(d) + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": PROMPTS[0], "max_tokens": 4,
                                                  "kv_transfer_params": params}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 502 and err.value.headers.get("X-KV-Transfer-Failure") == "prefill"
    assert "restarted" in json.loads(err.value.read())["error"]["message"]
    _all_free_within(cluster, d)
    _all_free_within(cluster, _p(cluster))  # and the decode engine released the prefill's blocks


# --- the proxy abandons the prefill: it releases it ------------------------------
def _requests_at(c: Cluster, i: int) -> int:
    return sum(get_json(c.engine_url(i) + "/health")[1]["requests"].values())



def test_client_disconnects_during_the_prefill(cluster):
    p = _p(cluster)
    conn = http.client.HTTPConnection("127.0.0.1", cluster.proxy_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": LONG_PROMPT + "gone", "max_tokens": 4}),
                 {"Content-Type": "application/json"})
    wait_until(lambda: _requests_at(cluster, p) >= 1, 20, interval=0.01, what="the prefill to start")
    conn.close()  # the client leaves during its prefill
    left = time.monotonic()
    wait_until(lambda: (lambda kv: kv["free"] == kv["total"])(_kv(cluster, p)), RELEASE_WITHIN_S, interval=0.05,
               what="the prefill engine's blocks to be free within 2 s of the client leaving")
    assert time.monotonic() - left < RELEASE_WITHIN_S
    m = scrape_metrics(cluster.proxy_url + "/metrics")
    assert m.get('atom_kv_proxy_abandoned_prefills_total{reason="client_gone"}', 0) >= 1


def test_proxy_restarted_mid_request(cluster):
    p = _p(cluster)
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(generate, cluster.proxy_url, LONG_PROMPT + f"term{i}", chat=False, stream=bool(i),
                               max_tokens=64, timeout=30) for i in range(3)]
        wait_until(lambda: _requests_at(cluster, p) > 0, 20, interval=0.01, what="the prefill engine to start working")
        assert cluster.proxy is not None
        cluster.proxy.proc.send_signal(signal.SIGTERM)
        cluster.proxy.proc.wait(10)
        stopped = time.monotonic()
        results = [f.result() for f in futures]  # every client got an answer (maybe an error), none hangs
    assert all(r.status or r.error for r in results), results
    wait_until(lambda: (lambda kv: kv["free"] == kv["total"])(_kv(cluster, p)),
               max(0.1, RELEASE_WITHIN_S - (time.monotonic() - stopped)), interval=0.05,
               what="the prefill engine's blocks to be free within 2 s of the proxy stopping")
    # the proxy comes back on the same ports and the engines register again
    cluster.proxy = ManagedProcess("proxy-restarted", cluster.proxy.argv, cluster.log_dir)
    cluster.wait_registered(30)
    res = generate(cluster.proxy_url, PROMPTS[0], chat=False, stream=False, max_tokens=4, timeout=30)
    assert res.error is None, res


def test_proxy_retries_on_another_pair(cluster):
    p, dead = _p(cluster), cluster.index_of("D", 1)
    cluster.engines[dead].kill()  # still registered: the proxy learns it from a refused connection
    with ThreadPoolExecutor(2) as pool:  # round robin: one of the two goes to the dead engine first
        results = list(pool.map(lambda i: generate(cluster.proxy_url, PROMPTS[2] + str(i), chat=False,
                                                   stream=False, max_tokens=4, timeout=30), range(2)))
    answered = time.monotonic()
    assert all(r.error is None for r in results), results
    wait_until(lambda: (lambda kv: kv["free"] == kv["total"])(_kv(cluster, p)),
               max(0.1, RELEASE_WITHIN_S - (time.monotonic() - answered)), interval=0.05,
               what="the abandoned prefill's blocks to be free")
    m = scrape_metrics(cluster.proxy_url + "/metrics")
    assert m.get('atom_kv_proxy_abandoned_prefills_total{reason="decode_unreachable"}', 0) >= 1
    assert m.get('atom_kv_proxy_releases_total{outcome="sent"}', 0) >= 1


# --- the first token went out from the prefill before the decode leg answered -----
def test_first_token_streamed_then_decode_unreachable_goes_to_the_other_decode_engine(cluster, colocated):
    """The client has its first token; the decode engine it was paired with is gone: the proxy
    sends the decode leg to the other engine, which reads the same (still held) prefill."""
    dead = cluster.index_of("D", 1)  # killed by the test above; back, then gone again
    cluster.restart_engine(dead)
    wait_until(lambda: any(i["address"].endswith(f":{cluster.ports[dead]}") and i["state"] == "up"
                           for i in get_json(cluster.proxy_url + "/instances")[1]),
               20, interval=0.1, what="the restarted decode engine to be routable")
    cluster.engines[dead].kill()
    before = scrape_metrics(cluster.proxy_url + "/metrics")
    with ThreadPoolExecutor(2) as pool:  # round robin: one of the two goes to the dead engine first
        results = list(pool.map(lambda i: generate(cluster.proxy_url, PROMPTS[1] + str(i), chat=False,
                                                   stream=True, max_tokens=6, timeout=30), range(2)))
    assert all(r.error is None for r in results), results
    assert [r.text for r in results] == [colocated.text(PROMPTS[1] + str(i), chat=False, max_tokens=6)
                                         for i in range(2)]
    after = scrape_metrics(cluster.proxy_url + "/metrics")
    forwarded = "atom_kv_proxy_first_tokens_forwarded_total"
    assert after[forwarded] - before.get(forwarded, 0) == 2
    assert after["atom_kv_proxy_retries_total"] > before.get("atom_kv_proxy_retries_total", 0)
    _all_free_within(cluster, _p(cluster))


def _stream_request(c: Cluster, prompt: str, max_tokens: int) -> tuple[http.client.HTTPConnection, bytes]:
    """A streamed completion through the proxy, left open; returns the connection and the first event."""
    conn = http.client.HTTPConnection("127.0.0.1", c.proxy_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp.readline()


def test_client_leaves_after_the_first_token_before_the_decode_answered(cluster):
    """Both engines get their blocks back within 2 s of a client that read its first token (from
    the prefill) and left while its decode leg waited in the decode engine's queue."""
    p, d = _p(cluster), cluster.index_of("D", 0)  # one request at a time there
    cluster.engines[cluster.index_of("D", 1)].kill()  # (dead already after the tests above)

    def requests_at_d() -> dict:
        return get_json(cluster.engine_url(d) + "/health")[1]["requests"]

    busy, _ = _stream_request(cluster, PROMPTS[0] + "busy", 2000)  # keeps the decode engine's only slot
    try:
        wait_until(lambda: requests_at_d()["running"] >= 1, 20, interval=0.02, what="the decode engine to be busy")
        conn, first = _stream_request(cluster, PROMPTS[2] + "leaves", 8)
        assert first.startswith(b"data: {") and json.loads(first[6:])["choices"][0]["text"]  # from the prefill
        wait_until(lambda: requests_at_d()["waiting"] == 1, 10, interval=0.02,
                   what="the decode leg to wait in the decode engine's queue")
        conn.close()  # the client leaves
        left = time.monotonic()
        wait_until(lambda: requests_at_d()["waiting"] == 0, RELEASE_WITHIN_S, interval=0.05,
                   what="the decode engine to drop the request")
        _all_free_within(cluster, p, max(0.1, RELEASE_WITHIN_S - (time.monotonic() - left)))
    finally:
        busy.close()
    _all_free_within(cluster, d)
    _all_free_within(cluster, p)
    m = scrape_metrics(cluster.proxy_url + "/metrics")
    assert m.get('atom_kv_proxy_abandoned_prefills_total{reason="client_gone"}', 0) >= 1


def test_decode_engine_killed_with_requests_queued(cluster):
    p, d = _p(cluster), cluster.index_of("D", 0)  # one request at a time there
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(generate, cluster.proxy_url, PROMPTS[i % 3] + f"q{i}", chat=False,
                               stream=bool(i % 2), max_tokens=400, timeout=60) for i in range(4)]
        wait_until(lambda: get_json(cluster.engine_url(d) + "/health")[1]["requests"]["waiting"] >= 2, 30,
                   interval=0.05, what="requests to queue on the decode engine")
        cluster.engines[d].kill()
        killed = time.monotonic()
        results = [f.result() for f in futures]
    ended = time.monotonic() - killed
    assert ended < 10, f"clients waited {ended:.1f} s after the kill"  # ended at once, not at a timeout
    assert sum(r.error is not None for r in results) >= 2, results  # at least the queued ones failed
    wait_until(lambda: (lambda kv: kv["free"] == kv["total"])(_kv(cluster, p)),
               max(0.1, RELEASE_WITHIN_S - (time.monotonic() - killed)) + 0.5, interval=0.05,
               what="the prefill engine's blocks to be free after the decode engine died")


def test_every_listener_of_an_engine_binds_its_host(cluster):
    """The engines run with ``--host 127.0.0.1``: HTTP, the handshake server and the data path's
    servers all listen there, none on 0.0.0.0."""
    p = _p(cluster)
    port = json.loads(cluster._configs[p][1])["handshake_port"]
    listening = _listeners_of(cluster.engines[p].pid)
    assert ("127.0.0.1", port) in listening and ("127.0.0.1", cluster.ports[p]) in listening, listening
    assert len(listening) >= 3, listening  # HTTP, handshake, and the backend's read server(s)
    assert {addr for addr, _ in listening} == {"127.0.0.1"}, listening


def _listeners_of(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket the process holds."""
    return listeners([pid])