"""/health, /instances, /metrics and /v1/models; two proxies in one process."""

from __future__ import annotations

import json

import aiohttp

from tests.proxy.fake_engine import register


async def _get(url: str):
    async with aiohttp.ClientSession() as s:
        async with s.get(url) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.read()


async def test_health_counts(make_proxy, make_engine):

    proxy = await make_proxy()
    status, _, raw = await _get(proxy.url + "/health")
    assert status == 503 and json.loads(raw) == {"status": "unavailable", "prefill": 0, "decode": 0}
    p = await make_engine("P")
    await register(proxy, p)
    status, _, raw = await _get(proxy.url + "/health")
    assert status == 503 and json.loads(raw)["prefill"] == 1
    d1, d2 = await make_engine("D"), await make_engine("D")
    await register(proxy, d1, d2)
    status, _, raw = await _get(proxy.url + "/health")
    assert status == 200 and json.loads(raw) == {"status": "ok", "prefill": 1, "decode": 2}


async def test_instances_listing(make_proxy, make_engine):

    proxy = await make_proxy()
    p = await make_engine("P", tp_size=2, dp_size=4)
    d = await make_engine("D")
    await register(proxy, p, d)
    status, ctype, raw = await _get(proxy.url + "/instances")
    assert status == 200 and ctype.startswith("application/json")
    listing = json.loads(raw)
    assert [(i["role"], i["address"]) for i in listing] == [("P", p.base_url), ("D", d.base_url)]
    pi = listing[0]
    assert (pi["tp_size"], pi["dp_size"], pi["inflight"], pi["circuit"]) == (2, 4, 0, "closed")
    assert pi["last_seen"] > 0 and 0 <= pi["last_seen_age_s"] < 5 and pi["state"] == "up"


async def test_metrics_exposition(make_proxy, make_engine):
    proxy = await make_proxy()
    p = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, p, d)
    async with aiohttp.ClientSession() as s:
        for stream in (False, True):
            async with s.post(proxy.url + "/v1/completions", json={"prompt": "x", "stream": stream}) as r:
                await r.read()
        async with s.post(proxy.url + "/v1/completions", data=b"nope",
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
    status, ctype, raw = await _get(proxy.url + "/metrics")
    text = raw.decode()
    assert status == 200 and ctype.startswith("text/plain")
    assert 'atom_kv_proxy_requests_total{endpoint="/v1/completions",status="200"} 2.0' in text
    assert 'atom_kv_proxy_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
    assert 'atom_kv_proxy_instances{role="prefill"} 1.0' in text
    assert 'atom_kv_proxy_instances{role="decode"} 1.0' in text
    assert "atom_kv_proxy_prefill_duration_seconds_count 2.0" in text
    assert 'atom_kv_proxy_request_duration_seconds_count{endpoint="/v1/completions"} 3.0' in text
    assert 'atom_kv_proxy_time_to_first_byte_seconds_count{endpoint="/v1/completions"} 3.0' in text
    for name in ("evictions_total", "retries_total", "rejected_registrations", "bad_discovery_messages_total",
                 "abandoned_prefills", "marked_down_total"):
        assert f"atom_kv_proxy_{name}" in text


async def test_models_from_decode(make_proxy, make_engine):

    proxy = await make_proxy()
    status, _, raw = await _get(proxy.url + "/v1/models")
    assert status == 503 and json.loads(raw)["error"]["code"] == 503
    d = await make_engine("D", model="my-model")
    await register(proxy, d)
    status, _, raw = await _get(proxy.url + "/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "my-model"
    await d.close()
    status, _, raw = await _get(proxy.url + "/v1/models")
    assert status == 502 and json.loads(raw)["error"]["code"] == 502


async def test_two_proxies_in_one_process_are_independent(make_proxy, make_engine):
    a, b = await make_proxy(), await make_proxy()
    p = await make_engine("P")
    await register(a, p)
    assert len(a.registry.live("P")) == 1 and b.registry.live("P") == []
    assert a.metrics.registry is not b.metrics.registry


async def test_the_admin_token_guards_the_management_routes(make_proxy):
    """Today's reproduction: /instances and /metrics showed the topology and the handshake ports to anyone."""
    import aiohttp

    proxy = await make_proxy(admin_token="adm-1234")
    async with aiohttp.ClientSession() as s:
        for path in ("/instances", "/metrics"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer \u00e9"},
                            {"Authorization": "adm-1234"}):
                async with s.get(proxy.url + path, headers=headers) as r:
                    assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer", (path, headers)
            async with s.get(proxy.url + path, headers={"Authorization": "Bearer adm-1234"}) as r:
                assert r.status == 200
        async with s.get(proxy.url + "/health") as r:
            assert r.status == 503  # open to probes (no engines here)
