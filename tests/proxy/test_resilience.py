"""Retries on another prefill, the circuit breaker, and client-disconnect cancellation."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec

from tests.proxy.fake_engine import register


async def _complete(proxy, n: int = 1, **body) -> list[int]:
    statuses = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            async with s.post(proxy.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, **body}) as r:
                await r.read()
                statuses.append(r.status)
    return statuses


async def test_prefill_5xx_is_retried_on_another_prefill(make_proxy, make_engine):
    proxy = make_proxy(circuit_failures=100)
    bad = await make_engine("P")
    good = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, bad, good, d)
    bad.fail_status = 503
    assert await _complete(proxy, 6) == [200] * 6
    assert len(bad.received) >= 2  # round robin did send it traffic...
    assert len(good.received) == 6  # ...and every request was re-planned onto the good one
    # the decode leg only ever saw kv_transfer_params minted by the good prefill
    assert len(d.received) == 6
    assert all(x.kv["remote_engine_id"] == good.engine_id for x in d.received)
    retries = proxy.metrics.registry.get_sample_value("atom_kv_proxy_retries_total")
    assert retries == len(bad.received)


async def test_prefill_connection_failure_is_retried(make_proxy, make_engine):
    proxy = make_proxy(circuit_failures=100)
    gone = await make_engine("P")
    good = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, gone, good, d)
    await gone.close()
    assert await _complete(proxy, 4) == [200] * 4
    assert len(good.received) == 4


async def test_retries_are_bounded(make_proxy, make_engine):
    proxy = make_proxy(max_retries=2, circuit_failures=100)
    ps = [await make_engine("P") for _ in range(4)]
    d = await make_engine("D")
    await register(proxy, *ps, d)
    for p in ps:
        p.fail_status = 500
    assert await _complete(proxy, 1) == [502]
    assert sum(len(p.received) for p in ps) == 3  # 1 + max_retries, each on a different instance
    assert all(len(p.received) <= 1 for p in ps)


async def test_circuit_breaker_opens_half_opens_and_closes(make_proxy, make_engine):
    proxy = make_proxy(circuit_failures=2, circuit_cooldown_s=0.6)
    flaky = await make_engine("P")
    good = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, flaky, good, d)
    flaky.fail_status = 500
    assert await _complete(proxy, 10) == [200] * 10
    assert len(flaky.received) == 2  # opened after 2 consecutive failures, then skipped
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/instances") as r:
            states = {i["address"]: i["circuit"] for i in await r.json()}
    assert states[flaky.base_url] == "open" and states[good.base_url] == "closed"
    assert proxy.metrics.registry.get_sample_value("atom_kv_proxy_circuit_opened_total", {"role": "prefill"}) == 1
    await asyncio.sleep(0.7)
    flaky.fail_status = None  # recovered: the half-open trial succeeds and closes the circuit
    assert await _complete(proxy, 4) == [200] * 4
    assert len(flaky.received) >= 3
    assert proxy.registry.live("P")[0].breaker.state() == "closed"
    assert all(i.breaker.state() == "closed" for i in proxy.registry.live("P"))


async def _raw_request(port: int, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = msgspec.json.encode(body)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"X-Request-Id: gone-1\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    await writer.drain()
    return reader, writer


async def test_client_disconnect_during_prefill_cancels_it_and_skips_decode(make_proxy, make_engine):
    proxy = make_proxy()
    p = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, p, d)
    p.hang = True
    _, writer = await _raw_request(proxy.settings.port, {"prompt": "x"})
    assert await p.wait_until(lambda: len(p.received) == 1)
    writer.close()
    assert await p.wait_until(lambda: p.cancelled == ["gone-1"], 3.0)
    await asyncio.sleep(0.3)
    assert d.received == []
    assert proxy.registry.live("P")[0].inflight == 0 and proxy.registry.live("D")[0].inflight == 0


async def test_client_gone_before_prefill_returns_never_starts_decode(make_proxy, make_engine):
    proxy = make_proxy()
    p = await make_engine("P", delay_s=0.4)
    d = await make_engine("D")
    await register(proxy, p, d)
    _, writer = await _raw_request(proxy.settings.port, {"prompt": "x"})
    assert await p.wait_until(lambda: len(p.received) == 1)
    writer.close()
    await asyncio.sleep(0.8)  # past the moment prefill would have answered
    assert d.received == []
    assert p.cancelled == ["gone-1"] and p.completed == []


async def test_client_disconnect_mid_stream_cancels_decode(make_proxy, make_engine):
    proxy = make_proxy()
    p = await make_engine("P")
    d = await make_engine("D", token_delay_s=0.05)
    await register(proxy, p, d)
    reader, writer = await _raw_request(proxy.settings.port, {"prompt": "x", "max_tokens": 200, "stream": True})
    seen = b""
    while seen.count(b"data: ") < 3:
        seen += await asyncio.wait_for(reader.read(4096), 3.0)
    assert b"text/event-stream" in seen
    writer.close()
    assert await d.wait_until(lambda: d.cancelled == ["gone-1"], 3.0)
    assert d.completed == []
    assert await d.wait_until(lambda: proxy.registry.live("D")[0].inflight == 0, 2.0)
    assert proxy.metrics.registry.get_sample_value("atom_kv_proxy_client_disconnects_total") == 1
