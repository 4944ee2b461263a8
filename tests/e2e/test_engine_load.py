"""Engine-reported load against real processes: a request sent straight to a decode engine, bypassing the
proxy, shows in the proxy's ``/instances`` (``reported_load``) and ``/metrics``
(``atom_kv_proxy_engine_reported_requests``) while it runs, read from the engine's ``/health`` every
``--engine-load-interval``, and the reading drops back to 0 once the request is gone. The proxy's own
in-flight count stays 0 all along: it never saw the request."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json, scrape_metrics

LOAD_INTERVAL_S = 0.2
LONG_STREAM_TOKENS = 4000  # far longer than the test holds it open on a CPU engine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster([EngineSpec("P"), EngineSpec("D")], log_dir=str(tmp_path_factory.mktemp("engine-load")),
                proxy_args=["--engine-load-interval", str(LOAD_INTERVAL_S)])
    c.start()
    try:
        yield c
    finally:
        c.close()


def _decode(cluster: Cluster) -> dict:
    status, body = http_json("GET", cluster.proxy_url + "/instances", timeout=10)
    assert status == 200, body
    [decode] = [i for i in body if i["role"] == "D"]
    return decode


def _reported(cluster: Cluster) -> int | None:
    load = _decode(cluster)["reported_load"]
    return None if load[0] is None else load[0]["requests"]


def _stream_straight_to(engine_url: str) -> http.client.HTTPConnection:
    """A slow streamed completion sent to the engine itself (not through the proxy), read until its first
    event arrived, and left open."""
    url = urlsplit(engine_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    body = {"model": "atom-kv-tiny", "prompt": "traffic that bypasses the proxy", "max_tokens": LONG_STREAM_TOKENS,
            "temperature": 0, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:300]
    assert resp.read(5) == b"data:"  # it runs
    return conn


def test_proxy_sees_load_that_bypasses_it(cluster):
    d_url = cluster.engine_url(cluster.index_of("D"))
    assert wait_until(lambda: _reported(cluster) == 0, timeout=15), _decode(cluster)

    conn = _stream_straight_to(d_url)
    try:
        assert wait_until(lambda: (_reported(cluster) or 0) >= 1, timeout=15), _decode(cluster)
        decode = _decode(cluster)
        assert decode["inflight"] == 0 and decode["outstanding_requests"] == [0]  # the proxy never saw it
        assert decode["reported_load"][0]["prompt_tokens"] > 0
        assert decode["reported_load"][0]["age_s"] < 10 * LOAD_INTERVAL_S + 2
        metrics = scrape_metrics(cluster.proxy_url + "/metrics")
        key = f'atom_kv_proxy_engine_reported_requests{{dp_rank="0",instance="{d_url}",role="decode"}}'
        assert metrics.get(key, 0.0) >= 1, sorted(k for k in metrics if "engine_reported" in k)
    finally:
        conn.close()  # the client is gone: the engine drops the request

    assert wait_until(lambda: _reported(cluster) == 0, timeout=30), _decode(cluster)
    metrics = scrape_metrics(cluster.proxy_url + "/metrics")
    assert metrics.get('atom_kv_proxy_engine_load_failures_total{reason="malformed"}', 0.0) == 0
