"""The worker API against real processes: a proxy started with no engines at all (``--no-discovery``, none
static) answers 503 until ``POST /workers`` gives it a pair of reference engines; a decode engine drained
in the middle of a stream finishes that stream, gets no new legs, reports ``idle`` once it is done, and every
prefill block comes back; ``DELETE /workers`` forgets it; sglang-router's ``/add_worker``,
``/list_workers`` and ``/remove_worker`` do the same from a query string; every route needs the admin token."""

from __future__ import annotations

import json
import re
import threading

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json, scrape_metrics
from tests.e2e.helpers import generate
from tests.proxy.procs import ProxyProcess

ADMIN = "workers-api-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0"})
_LABEL = re.compile(r'(\w+)="([^"]*)"')
LONG_STREAM_TOKENS = 1500  # long enough on a CPU engine to drain its engine while it streams


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    c = Cluster([EngineSpec("P", num_blocks=256, register=False, extra_args=["--kv-events-config", EVENTS]),
                 EngineSpec("D", register=False),
                 EngineSpec("D", register=False)], with_proxy=False, log_dir=str(tmp_path_factory.mktemp("workers")))
    c.start()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def proxy():
    p = ProxyProcess("--no-discovery", "--admin-token", ADMIN, "--policy", "round_robin", "--probe-interval", "0.2",
                     timeout=30)
    try:
        yield p
    finally:
        p.kill()


def _call(proxy: ProxyProcess, method: str, path: str, body: dict | None = None, auth: bool = True):
    return http_json(method, proxy.url + path, body, timeout=10, headers=AUTH if auth else None)


def _workers(proxy: ProxyProcess) -> dict[str, dict]:
    status, body = _call(proxy, "GET", "/workers")
    assert status == 200, body
    return {w["id"]: w for w in body["workers"]}


def _served(engine_url: str) -> float:
    return scrape_metrics(engine_url + "/metrics").get("atom_kv_requests_ok_total", 0.0)


def _active(proxy: ProxyProcess, n: int) -> bool:
    workers = _workers(proxy).values()
    return sum(w["state"] == "active" for w in workers) == n


def test_api_adds_drains_and_removes_engines(engines, proxy):
    p_url = engines.engine_url(engines.index_of("P"))
    d_urls = [engines.engine_url(engines.index_of("D", n)) for n in range(2)]

    assert http_json("GET", proxy.url + "/health")[0] == 503
    res = generate(proxy.url, "nobody is here yet", chat=False, stream=False, max_tokens=2)
    assert res.status == 503, res
    assert _call(proxy, "GET", "/workers", auth=False)[0] == 401
    assert _call(proxy, "POST", "/workers", {"url": p_url, "role": "prefill"}, auth=False)[0] == 401
    assert _workers(proxy) == {}

    # checked like a static spec, one line naming the field
    status, body = _call(proxy, "POST", "/workers", {"url": p_url, "role": "prefill", "dp_size": 0})
    assert status == 400 and "dp_size must be >= 1" in body["error"]["message"], body
    status, body = _call(proxy, "POST", "/workers", {"url": p_url, "role": "encode"})
    assert status == 400 and "`role` must be prefill or decode" in body["error"]["message"], body
    status, body = _call(proxy, "POST", "/workers", {"url": p_url, "role": "P", "colour": "red"})
    assert status == 400 and "unknown field 'colour'" in body["error"]["message"], body
    status, body = _call(proxy, "POST", "/workers", {"url": "10.0.0.5:8000", "role": "P"})
    assert status == 400 and "http URL" in body["error"]["message"], body
    assert _workers(proxy) == {}

    status, body = _call(proxy, "POST", "/workers", {"url": p_url, "role": "prefill", "events": "tcp://127.0.0.1:1"})
    assert status == 201 and body["source"] == "api" and body["events"] == "tcp://127.0.0.1:1", body
    for d_url in d_urls:
        assert _call(proxy, "POST", "/workers", {"url": d_url, "role": "D"})[0] == 201
    assert _call(proxy, "POST", "/workers", {"url": d_urls[0], "role": "decode"})[0] == 409
    wait_until(lambda: _active(proxy, 3), 30, what="the three engines to be probed up")
    assert http_json("GET", proxy.url + "/health")[0] == 200
    for n in range(2):  # round robin: one request on each decode engine
        res = generate(proxy.url, f"through the api {n}", chat=False, stream=False, max_tokens=3, timeout=60)
        assert res.status == 200 and res.error is None, res

    # a long stream on one decode engine; drain the engine it is on while it streams
    result: dict = {}
    stream = threading.Thread(target=lambda: result.update(res=generate(
        proxy.url, "drain me while I stream", chat=False, stream=True, max_tokens=LONG_STREAM_TOKENS,
        timeout=300)), name="long-stream")
    stream.start()
    try:
        busy = wait_until(lambda: next((w for w in _workers(proxy).values() if w["role"] == "decode"
                                        and w["inflight"] > 0), None), 60, interval=0.05,
                          what="the stream's decode leg")
        status, body = _call(proxy, "POST", "/workers/drain", {"url": busy["url"]})
        assert status == 200, body
        [drained] = body["workers"]
        assert drained["state"] == "draining" and drained["inflight"] == 1 and drained["idle"] is False, drained
        other = next(u for u in d_urls if u != busy["url"])
        served = _served(busy["url"]), _served(other)
        for n in range(3):  # no new legs for the drained engine: the other one takes them all
            res = generate(proxy.url, f"while draining {n}", chat=False, stream=n == 1, max_tokens=3, timeout=60)
            assert res.status == 200 and res.error is None, res
        assert _workers(proxy)[busy["id"]]["state"] == "draining"
    finally:
        stream.join(300)
    res = result["res"]
    assert res.status == 200 and res.error is None and res.finish_reason == "length", res
    assert _served(busy["url"]) == served[0] + 1  # the stream, nothing else
    assert _served(other) == served[1] + 3
    idle = _workers(proxy)[busy["id"]]
    assert idle["state"] == "draining" and idle["inflight"] == 0 and idle["idle"] is True, idle
    wait_until(lambda: engines.engine_health(engines.index_of("P"))["kv_blocks"]["held"] == 0, 30,
               what="every prefill block to be released")

    status, body = _call(proxy, "DELETE", f"/workers?url={busy['url']}")
    assert status == 200 and [w["url"] for w in body["removed"]] == [busy["url"]], body
    assert busy["id"] not in _workers(proxy)
    assert _call(proxy, "DELETE", f"/workers?url={busy['url']}")[0] == 404
    res = generate(proxy.url, "after the removal", chat=False, stream=False, max_tokens=3, timeout=60)
    assert res.status == 200 and res.error is None, res


def test_sglang_router_aliases(engines, proxy):
    p_url = engines.engine_url(engines.index_of("P"))
    d_url = engines.engine_url(engines.index_of("D"))
    assert _call(proxy, "POST", f"/add_worker?url={p_url}&worker_type=prefill", auth=False)[0] == 401
    status, body = _call(proxy, "POST", f"/add_worker?url={p_url}")
    assert status == 400 and "`worker_type` is required" in body["error"]["message"], body
    status, body = _call(proxy, "POST", f"/add_worker?url={p_url}&worker_type=prefill&api_key=k")
    assert status == 400 and "unknown parameter 'api_key'" in body["error"]["message"], body
    status, body = _call(proxy, "POST", f"/add_worker?url={p_url}&worker_type=prefill&bootstrap_port=70000")
    assert status == 400 and "handshake_port must be 1..65535" in body["error"]["message"], body

    status, body = _call(proxy, "POST", f"/add_worker?url={p_url}&worker_type=prefill&bootstrap_port=8998")
    assert status == 200 and body["role"] == "prefill" and body["handshake_port"] == 8998, body
    assert _call(proxy, "POST", f"/add_worker?url={d_url}&worker_type=decode")[0] == 200
    status, body = _call(proxy, "GET", "/list_workers")
    assert status == 200 and body == {"urls": sorted([p_url, d_url]), "prefill": [p_url], "decode": [d_url]}, body
    wait_until(lambda: _active(proxy, 2), 30, what="both engines to be probed up")
    res = generate(proxy.url, "added the sglang way", chat=False, stream=False, max_tokens=3, timeout=60)
    assert res.status == 200 and res.error is None, res

    status, body = _call(proxy, "POST", f"/remove_worker?url={d_url}")
    assert status == 200 and [w["url"] for w in body["removed"]] == [d_url], body
    assert _call(proxy, "GET", "/list_workers")[1]["decode"] == []
    assert http_json("GET", proxy.url + "/health")[0] == 503
    assert _call(proxy, "POST", f"/remove_worker?url={d_url}")[0] == 404


def test_changes_need_the_admin_token_beyond_loopback():
    p = ProxyProcess("--no-discovery", host="0.0.0.0", timeout=30)
    try:
        status, body = http_json("POST", p.url + "/add_worker?url=http://127.0.0.1:9&worker_type=decode", timeout=10)
        assert status == 403 and "--admin-token-file" in body["error"]["message"], body
        status, body = http_json("POST", p.url + "/workers", {"url": "http://127.0.0.1:9", "role": "D"}, timeout=10)
        assert status == 403, body
        assert http_json("GET", p.url + "/workers", timeout=10) == (200, {"workers": []})
    finally:
        p.kill()


def _indexed(proxy: ProxyProcess, instance: str) -> float | None:
    """The proxy's indexed blocks of the prefill ``instance`` (None: the proxy does not follow it)."""
    for key, value in scrape_metrics(proxy.url + "/metrics", headers=AUTH).items():
        if key.startswith("atom_kv_proxy_kv_indexed_blocks{") and dict(_LABEL.findall(key)) == {
                "role": "prefill", "instance": instance, "dp_rank": "0"}:
            return value
    return None


def test_an_engine_added_with_its_events_is_followed_and_forgotten_once_removed(engines, proxy):
    p_url, d_url = engines.engine_url(engines.index_of("P")), engines.engine_url(engines.index_of("D"))
    status, health = http_json("GET", p_url + "/health")
    assert status == 200, health
    events = health["dp_ranks"][0]["kv_events"]["endpoint"]
    assert _call(proxy, "POST", "/workers", {"url": p_url, "role": "prefill", "events": events})[0] == 201
    assert _call(proxy, "POST", "/workers", {"url": d_url, "role": "decode"})[0] == 201
    wait_until(lambda: _active(proxy, 2), 20.0, what="both engines active")
    res = generate(proxy.url, "an engine the operator added, whose blocks the proxy follows " * 3, chat=False,
                   stream=False, max_tokens=2)
    assert res.status == 200, res
    # its BlockStored events reached the index: the API-added engine is followed as a --prefill spec's would be
    wait_until(lambda: (_indexed(proxy, p_url) or 0) > 0, 20.0, what="the added engine's blocks in the index")
    assert len(_call(proxy, "DELETE", f"/workers?url={p_url}")[1]["removed"]) == 1
    wait_until(lambda: _indexed(proxy, p_url) is None, 10.0, what="the removed engine's entries gone")
    assert _call(proxy, "DELETE", f"/workers?url={d_url}")[0] == 200
