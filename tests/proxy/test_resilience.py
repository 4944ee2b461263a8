"""Retries, the circuit breaker, down marks, client disconnects and the abandon-prefill hook.

Nothing here sleeps and then asserts that something did not happen: each
test waits on an event (an engine's change event, the registry's change
notifications) or moves a breaker's clock."""

from __future__ import annotations

import asyncio
import time

import msgspec

from tests.proxy.fake_engine import FakeEngine, get, post, register


async def _complete(proxy, n: int = 1, **body) -> list[int]:
    statuses = []
    for _ in range(n):
        statuses.append((await post(proxy.url, {"prompt": "x", "max_tokens": 2, **body}))[0])
    return statuses


def _abandoned(proxy, reason: str) -> float:
    return proxy.count("atom_kv_proxy_abandoned_prefills_total", reason=reason)


async def test_prefill_5xx_is_retried_on_another_prefill(make_proxy, make_engine):
    proxy = await make_proxy(circuit_failures=100)
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
    assert proxy.count("atom_kv_proxy_retries_total") == len(bad.received)
    assert _abandoned(proxy, "prefill_failed") == len(bad.received)


async def test_decode_5xx_and_4xx_abandon_the_prefill(make_proxy, make_engine):
    proxy = await make_proxy(circuit_failures=100)
    p = await make_engine("P")
    bad = await make_engine("D")
    good = await make_engine("D")
    await register(proxy, p, bad, good)
    bad.fail_status = 500
    assert await _complete(proxy, 4) == [200] * 4
    assert _abandoned(proxy, "decode_rejected") == len(bad.received) >= 1
    bad.fail_status = good.fail_status = 400  # a client error from decode: passed through, prefill abandoned
    before = _abandoned(proxy, "decode_rejected")
    assert await _complete(proxy, 1) == [400]
    assert _abandoned(proxy, "decode_rejected") == before + 1


async def test_connection_refused_marks_an_engine_down_at_once_and_a_probe_brings_it_back(make_proxy, make_engine):
    proxy = await make_proxy(circuit_failures=100, probe_interval_s=0.2)
    gone = await make_engine("P")
    good = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, gone, good, d)
    port = gone.port
    await gone.close()
    assert await _complete(proxy, 4) == [200] * 4  # the first failure took it out of routing
    assert len(good.received) == 4
    status, listing = await get(proxy.url, "/instances")
    state = {i["address"]: i for i in listing}[gone.base_url]
    assert state["state"] == "down" and "connection" in state["down_reason"]
    assert (await get(proxy.url, "/health"))[1] == {"status": "ok", "prefill": 1, "decode": 1}
    assert proxy.count("atom_kv_proxy_marked_down_total", role="prefill") == 1
    # the engine comes back on the same port: the next probe makes it routable again
    back = await FakeEngine("P", engine_id=gone.engine_id).start(port=port)
    try:
        assert await proxy.registry.wait_for(lambda r: len(r.live("P")) == 2, 5.0)
        assert (await get(proxy.url, "/health"))[1]["prefill"] == 2
    finally:
        await back.close()


async def test_decode_unreachable_is_retried_and_abandons_the_prefill(make_proxy, make_engine):
    proxy = await make_proxy(circuit_failures=100)
    p = await make_engine("P")
    gone = await make_engine("D")
    good = await make_engine("D")
    await register(proxy, p, gone, good)
    await gone.close()
    assert await _complete(proxy, 3) == [200] * 3
    assert _abandoned(proxy, "decode_unreachable") == 1  # then it was down and never picked again
    assert [i.base_url for i in proxy.registry.live("D")] == [good.base_url]


async def test_retries_are_bounded(make_proxy, make_engine):
    proxy = await make_proxy(max_retries=2, circuit_failures=100)
    ps = [await make_engine("P") for _ in range(4)]
    d = await make_engine("D")
    await register(proxy, *ps, d)
    for p, status in zip(ps, (500, 502, 503, 504)):  # each fails its own way (the same way twice: no retry)
        p.fail_status = status
    assert await _complete(proxy, 1) == [502]
    assert sum(len(p.received) for p in ps) == 3  # 1 + max_retries, each on a different instance
    assert all(len(p.received) <= 1 for p in ps)


async def test_circuit_breaker_opens_half_opens_and_closes(make_proxy, make_engine):
    proxy = await make_proxy(circuit_failures=2, circuit_cooldown_s=30.0)
    flaky = await make_engine("P")
    good = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, flaky, good, d)
    flaky.fail_status = 500
    assert await _complete(proxy, 10) == [200] * 10
    assert len(flaky.received) == 2  # opened after 2 consecutive failures, then skipped
    status, listing = await get(proxy.url, "/instances")
    states = {i["address"]: i["circuit"] for i in listing}
    assert states[flaky.base_url] == "open" and states[good.base_url] == "closed"
    assert proxy.count("atom_kv_proxy_circuit_opened_total", role="prefill") == 1
    flaky_inst = next(i for i in proxy.registry.live("P") if i.base_url == flaky.base_url)
    flaky_inst.breaker.opened_at -= 30.0  # the cooldown has passed (the breaker's clock, not a sleep)
    flaky.fail_status = None  # recovered: the half-open trial succeeds and closes the circuit
    assert await _complete(proxy, 4) == [200] * 4
    assert len(flaky.received) >= 3
    assert all(i.breaker.state() == "closed" for i in proxy.registry.live("P"))


async def test_health_is_unavailable_when_every_decode_circuit_is_open(make_proxy, make_engine):
    proxy = await make_proxy(circuit_failures=1, circuit_cooldown_s=30.0, max_retries=0)
    p = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, p, d)
    assert (await get(proxy.url, "/health"))[0] == 200
    d.fail_status = 503
    assert await _complete(proxy, 1) == [502]
    status, body = await get(proxy.url, "/health")
    assert status == 503 and body == {"status": "unavailable", "prefill": 1, "decode": 0}


async def _raw_request(port: int, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = msgspec.json.encode(body)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"X-Request-Id: gone-1\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    await writer.drain()
    return reader, writer


async def test_client_disconnect_during_prefill_cancels_it_and_skips_decode(pd_pair):
    proxy, p, d = await pd_pair()
    p.hang = True
    _, writer = await _raw_request(proxy.settings.port, {"prompt": "x"})
    assert await p.wait_until(lambda: len(p.received) == 1)
    writer.close()
    # the prefill engine sees its request cancelled only after the proxy's handler has unwound
    assert await p.wait_until(lambda: p.cancelled == ["gone-1"], 3.0)
    assert d.received == []
    assert _abandoned(proxy, "client_gone") == 1
    assert proxy.count("atom_kv_proxy_client_disconnects_total") == 1
    assert proxy.registry.live("P")[0].inflight == 0 and proxy.registry.live("D")[0].inflight == 0


async def test_client_gone_before_prefill_returns_never_starts_decode(pd_pair):
    proxy, p, d = await pd_pair(p=dict(delay_s=0.4))
    _, writer = await _raw_request(proxy.settings.port, {"prompt": "x"})
    assert await p.wait_until(lambda: len(p.received) == 1)
    writer.close()
    assert await p.wait_until(lambda: p.cancelled == ["gone-1"], 3.0)
    assert p.completed == [] and d.received == []
    assert _abandoned(proxy, "client_gone") == 1


async def test_client_disconnect_mid_stream_cancels_decode(pd_pair):
    proxy, p, d = await pd_pair(d=dict(token_delay_s=0.05))
    reader, writer = await _raw_request(proxy.settings.port, {"prompt": "x", "max_tokens": 200, "stream": True})
    seen = b""
    while seen.count(b"data: ") < 3:
        seen += await asyncio.wait_for(reader.read(4096), 3.0)
    assert b"text/event-stream" in seen
    writer.close()
    assert await d.wait_until(lambda: d.cancelled == ["gone-1"], 3.0)
    assert d.completed == []
    assert proxy.registry.live("D")[0].inflight == 0  # credited when the proxy dropped the leg, before d saw it
    assert proxy.count("atom_kv_proxy_client_disconnects_total") == 1
    assert proxy.count("atom_kv_proxy_requests_total", endpoint="/v1/completions", status="499") == 1
    assert _abandoned(proxy, "client_gone") == 0  # the decode engine had taken the KV over


async def test_one_poison_request_does_not_open_the_only_instances_breaker(make_proxy, make_engine):
    """Today's reproduction: one request the engine always answers 500 was retried on the same,
    only instance and opened its breaker; every other client got 503."""
    proxy = await make_proxy(max_retries=2, circuit_failures=3, circuit_cooldown_s=30.0)
    p = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, p, d)
    d.fail_prompt = "poison"
    assert await _complete(proxy, 1, prompt="poison") == [502]
    assert len(d.received) == 3  # retried: the failure might have been the instance's
    (inst,) = proxy.registry.live("D")
    assert inst.breaker.state() == "closed" and inst.breaker.failures == 0  # no instance failure ...
    assert inst.breaker.window.totals(time.monotonic()) == (0, 0, 1)  # ... one unresolved suspect, counted once
    assert await _complete(proxy, 3) == [200] * 3  # everyone else is still served


async def test_poison_requests_failing_on_two_instances_charge_neither(make_proxy, make_engine):
    """Today's reproduction: with several instances, 3 such requests took them all out."""
    proxy = await make_proxy(max_retries=2, circuit_failures=2, circuit_cooldown_s=30.0)
    p = await make_engine("P")
    ds = [await make_engine("D") for _ in range(3)]
    await register(proxy, p, *ds)
    for d in ds:
        d.fail_prompt = "poison"
    assert await _complete(proxy, 3, prompt="poison") == [502] * 3
    assert sum(len(d.received) for d in ds) == 6  # each stopped after the same 500 on a second instance
    assert all(i.breaker.state() == "closed" and i.breaker.failures == 0 for i in proxy.registry.live("D"))
    assert await _complete(proxy, 3) == [200] * 3


async def test_failures_of_different_requests_still_open_the_breaker(make_proxy, make_engine):
    """An only instance that answers everybody 500 (nobody served well) opens at the minimum volume;
    with every circuit of the role open, the least recently failed instance still gets the requests."""
    proxy = await make_proxy(max_retries=0, circuit_failures=3, circuit_cooldown_s=30.0, circuit_min_requests=3)
    p = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, p, d)
    d.fail_status = 500  # the instance is unwell: every request fails there
    assert await _complete(proxy, 3) == [502, 502, 502]
    (inst,) = proxy.registry.known("D")
    assert inst.breaker.state() == "open"
    assert proxy.count("atom_kv_proxy_circuit_opened_total", role="decode") == 1
    d.fail_status = None  # it recovered: routed to anyway (no other instance), it closes again
    assert await _complete(proxy, 1) == [200]
    assert proxy.count("atom_kv_proxy_all_circuits_open_routed_total", role="decode") == 1
    assert inst.breaker.state() == "closed"


async def test_a_client_that_stops_reading_is_dropped_after_the_stall_timeout(make_proxy, make_engine):
    """Today's reproduction: a streaming client that stopped reading pinned the decode request (and
    its slot and KV) for as long as it slept. Now: both legs are aborted, the prefill is released
    and it is counted."""
    import socket

    proxy = await make_proxy(stall_timeout=0.5, decode_timeout=30.0)
    p = await make_engine("P", max_model_len=1 << 20)
    d = await make_engine("D", max_model_len=1 << 20)
    await register(proxy, p, d)
    d.events_per_write = 200
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect(("127.0.0.1", proxy.settings.port))
    data = msgspec.json.encode({"prompt": "x", "max_tokens": 200_000, "stream": True})
    raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"X-Request-Id: sleeper\r\nContent-Length: %d\r\n\r\n%b" % (len(data), data))
    try:
        assert await d.wait_until(lambda: "sleeper" in d.cancelled, timeout=20.0)  # the decode leg was aborted
        assert proxy.count("atom_kv_proxy_client_stalls_total") == 1
        assert _abandoned(proxy, "client_stalled") == 1  # its prefill's release went out
    finally:
        raw.close()


async def test_models_and_completions_go_to_the_least_recently_failed_when_every_circuit_is_open(make_proxy,
                                                                                                 make_engine):
    proxy = await make_proxy(circuit_failures=1, circuit_cooldown_s=60.0)
    p = await make_engine("P")
    older, newer = await make_engine("D"), await make_engine("D")
    await register(proxy, p, older, newer)
    by_url = {i.base_url: i for i in proxy.registry.live("D")}
    now = time.monotonic()
    by_url[older.base_url].breaker.record_failure(now - 2.0)
    by_url[newer.base_url].breaker.record_failure(now - 1.0)
    assert all(i.breaker.state() == "open" for i in by_url.values())
    assert (await get(proxy.url, "/v1/models"))[0] == 200
    assert await _complete(proxy, 2) == [200, 200]
    assert len(older.received) == 2 and newer.received == []  # the one that failed longer ago ...
    assert by_url[older.base_url].breaker.state() == "closed"  # ... whose success closed its circuit
    assert by_url[newer.base_url].breaker.state() == "open"
    # /v1/models and the first completion were the fallback's; the second found a closed circuit
    assert proxy.count("atom_kv_proxy_all_circuits_open_routed_total", role="decode") == 2
