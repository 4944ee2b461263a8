"""Error replies in vLLM's shape with real statuses."""

from __future__ import annotations

import json

import aiohttp

from tests.proxy.fake_engine import register


def _is_vllm_error(payload: dict, status: int) -> bool:
    err = payload.get("error")
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and err["code"] == status and isinstance(err["message"], str) and err["message"])


async def _post(url: str, body=None, data=None, path="/v1/completions"):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body, data=data) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.read()


async def test_503_when_a_role_is_missing(make_proxy, make_engine):
    proxy = make_proxy()
    status, ctype, raw = await _post(proxy.url, {"prompt": "x"})
    assert status == 503 and ctype.startswith("application/json")

    assert _is_vllm_error(json.loads(raw), 503) and b"decode" in raw
    d = await make_engine("D")
    await register(proxy, d)
    status, _, raw = await _post(proxy.url, {"prompt": "x"}, path="/v1/chat/completions")
    assert status == 503 and b"prefill" in raw
    assert d.received == []


async def test_400_on_bad_client_json(make_proxy):

    proxy = make_proxy()
    for data in (b"{not json", b"[1, 2]", b""):
        status, _, raw = await _post(proxy.url, data=data)
        assert status == 400 and _is_vllm_error(json.loads(raw), 400), raw


async def test_upstream_4xx_passed_through(make_proxy, make_engine):

    proxy = make_proxy()
    p = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, p, d)
    p.fail_status = 422
    status, _, raw = await _post(proxy.url, {"prompt": "x"})
    assert status == 422 and json.loads(raw)["error"]["message"] == "fake engine failure 422"
    assert len(p.received) == 1 and d.received == []  # a client error is not retried
    p.fail_status = None
    d.fail_status = 400
    status, _, raw = await _post(proxy.url, {"prompt": "x", "stream": True})
    assert status == 400 and json.loads(raw)["error"]["message"] == "fake engine failure 400"


async def test_502_when_upstream_unreachable(make_proxy, make_engine):

    proxy = make_proxy(max_retries=1)
    p = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, p, d)
    await p.close()  # registered, but nobody listens any more
    status, _, raw = await _post(proxy.url, {"prompt": "x"})
    assert status == 502 and _is_vllm_error(json.loads(raw), 502)
    assert p.base_url in json.loads(raw)["error"]["message"]
    assert proxy.metrics.registry.get_sample_value("atom_kv_proxy_retries_total") == 1
    assert d.received == []


async def test_504_on_prefill_timeout(make_proxy, make_engine):

    proxy = make_proxy(prefill_timeout=0.5)
    p = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, p, d)
    p.hang = True
    status, _, raw = await _post(proxy.url, {"prompt": "x"})
    assert status == 504 and _is_vllm_error(json.loads(raw), 504)
    assert await p.wait_until(lambda: len(p.cancelled) == 1)  # the hung leg was abandoned
    assert d.received == []


async def test_504_on_decode_timeout(make_proxy, make_engine):

    proxy = make_proxy(decode_timeout=0.5)
    p = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, p, d)
    d.hang = True
    status, _, raw = await _post(proxy.url, {"prompt": "x"})
    assert status == 504 and _is_vllm_error(json.loads(raw), 504)


async def test_mid_stream_failure_becomes_error_event(make_proxy, make_engine):

    proxy = make_proxy()
    p = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, p, d)
    d.drop_after_chunks = 3
    status, ctype, raw = await _post(proxy.url, {"prompt": "x", "max_tokens": 10, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = [e for e in raw.decode().split("\n\n") if e]
    assert len(events) == 5, events
    assert all(e.startswith("data: {") for e in events[:3]) and '"error"' not in "".join(events[:3])
    err = json.loads(events[3][len("data: "):])
    assert _is_vllm_error(err, 502) and "interrupted" in err["error"]["message"]
    assert events[4] == "data: [DONE]"


async def test_unknown_route_is_json_404(make_proxy):

    proxy = make_proxy()
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/v2/nothing") as r:
            assert r.status == 404 and _is_vllm_error(await r.json(), 404)


async def test_never_an_empty_200(make_proxy, make_engine):
    proxy = make_proxy()
    p = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, p, d)
    d.empty_response = True
    status, _, raw = await _post(proxy.url, {"prompt": "x"})
    assert status == 502 and _is_vllm_error(json.loads(raw), 502) and b"empty" in raw
    status, _, raw = await _post(proxy.url, {"prompt": "x", "stream": True})
    events = [e for e in raw.decode().split("\n\n") if e]
    assert status == 200 and len(events) == 2 and events[1] == "data: [DONE]"
    assert _is_vllm_error(json.loads(events[0][len("data: "):]), 502)


async def test_wrong_method_and_oversized_body(make_proxy):
    proxy = make_proxy(max_request_bytes=1024)
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/v1/completions", headers={"X-Request-Id": "r-405"}) as r:
            assert r.status == 405 and _is_vllm_error(await r.json(), 405)
            assert r.headers["X-Request-Id"] == "r-405"
        async with s.post(proxy.url + "/v1/chat/completions", json={"prompt": "x" * 2048}) as r:
            assert r.status == 413 and _is_vllm_error(await r.json(), 413)
