"""Admission control on a real proxy process (``python -m atom_kv.proxy``) with fake engines on real sockets:

* ``--max-concurrent-per-engine``: an engine never has more legs at once than its cap;
* the queue: FIFO, bounded (past it 429 with ``Retry-After``), and bounded in time (503 after ``--queue-timeout``);
* a client that leaves while queued frees its place;
* ``--rate-limit``: one bucket per bearer token, else per address; past it 429 with ``Retry-After``;
* afterwards every engine's load (its charges) is back to 0.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from atom_kv.testing.fake_engine import FakeEngine
from atom_kv.testing.web import http_json, scrape_metrics
from tests.proxy.procs import ProxyProcess

BODY = {"model": "fake-model", "prompt": "hello admission", "max_tokens": 4, "stream": True}
TIMEOUT = aiohttp.ClientTimeout(total=60)


async def _deadline_poll(what: str, predicate, timeout: float = 15.0) -> None:
    """Wait, checking every 50 ms, until ``predicate()`` (sync or async) holds; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


class Setup:
    """A proxy process over in-process fake engines (one prefill and ``decodes`` decode engines)."""

    def __init__(self, proxy: ProxyProcess, prefill: FakeEngine, decodes: list[FakeEngine]) -> None:
        self.proxy = proxy
        self.prefill = prefill
        self.decodes = decodes

    @classmethod
    async def start(cls, *args: str, decodes: int = 1, **decode_kwargs: Any) -> "Setup":
        prefill = await FakeEngine("P").start()
        ds = [await FakeEngine("D", **decode_kwargs).start() for _ in range(decodes)]
        flags = ["--no-discovery", "--prefill", prefill.base_url, "--probe-interval", "0.1",
                 "--decode-timeout", "30", *args]
        for d in ds:
            flags += ["--decode", d.base_url]
        proxy = await asyncio.to_thread(ProxyProcess, *flags)
        setup = cls(proxy, prefill, ds)
        await _deadline_poll("the proxy's readiness", lambda: setup.get("/readiness")[0] == 200)
        return setup

    def get(self, path: str) -> tuple[int, Any]:
        return http_json("GET", self.proxy.url + path, timeout=5)

    async def metrics(self) -> dict[str, float]:
        return await asyncio.to_thread(scrape_metrics, self.proxy.url + "/metrics")

    async def depth(self) -> float:
        return (await self.metrics())["atom_kv_proxy_admission_queue_depth"]

    async def all_idle(self) -> bool:
        _, instances = await asyncio.to_thread(self.get, "/instances")
        return all(i["inflight"] == 0 and not any(i["outstanding_requests"]) for i in instances)

    async def close(self) -> None:
        self.proxy.kill()
        for engine in (self.prefill, *self.decodes):
            await engine.close()


async def _complete(session: aiohttp.ClientSession, url: str, request_id: str,
                    headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes, float]:
    t0 = time.monotonic()
    async with session.post(url + "/v1/completions", json=BODY,
                            headers={"X-Request-Id": request_id, **(headers or {})}) as r:
        body = await r.read()
        return r.status, dict(r.headers), body, time.monotonic() - t0


async def test_an_engine_never_has_more_legs_than_its_cap_and_the_charges_go_back_to_0():
    s = await Setup.start("--max-concurrent-per-engine", "2", "--queue-size", "64", decodes=2)
    s.decodes[0].token_delay_s, s.decodes[1].token_delay_s = 0.1, 0.005  # one slow: turn by turn would overfill it
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            results = await asyncio.gather(*(_complete(session, s.proxy.url, f"cap-{i}") for i in range(16)))
        assert [r[0] for r in results] == [200] * 16, [r[2][:200] for r in results if r[0] != 200]
        assert s.prefill.max_active <= 2, s.prefill.max_active
        assert max(d.max_active for d in s.decodes) == 2, [d.max_active for d in s.decodes]
        assert sum(len(d.completed) for d in s.decodes) == 16
        m = await s.metrics()
        assert m["atom_kv_proxy_admission_wait_seconds_count"] > 0  # some did wait: the cap was reached
        await _deadline_poll("every charge given back", s.all_idle)
    finally:
        await s.close()


async def test_the_queue_serves_in_arrival_order():
    s = await Setup.start("--max-concurrent-per-engine", "1", "--queue-size", "16", "--queue-timeout", "30")
    gate = s.decodes[0].gate = asyncio.Event()  # the decode engine answers nothing until every request queued
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            tasks = [asyncio.create_task(_complete(session, s.proxy.url, "fifo-0"))]
            await _deadline_poll("the first request on the decode engine", lambda: s.decodes[0].active == 1)
            for i in range(1, 7):  # each one queued behind the last before the next is sent
                tasks.append(asyncio.create_task(_complete(session, s.proxy.url, f"fifo-{i}")))
                await _deadline_poll(f"queue depth {i}", lambda i=i: _depth_at_least(s, i))
            gate.set()
            results = await asyncio.gather(*tasks)
        assert [r[0] for r in results] == [200] * 7
        order = [r.request_id for r in s.decodes[0].received]
        assert order == [f"fifo-{i}" for i in range(7)], order
        assert s.decodes[0].max_active == 1 and s.prefill.max_active == 1
        await _deadline_poll("every charge given back", s.all_idle)
        assert await s.depth() == 0
    finally:
        await s.close()


async def _depth_at_least(s: Setup, n: int) -> bool:
    return await s.depth() >= n


async def test_past_the_queue_429_with_retry_after_and_a_queued_request_gets_503_after_the_queue_timeout():
    s = await Setup.start("--max-concurrent-per-engine", "1", "--queue-size", "2", "--queue-timeout", "1.5")
    s.decodes[0].hang = True
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            holder = asyncio.create_task(_complete(session, s.proxy.url, "holder"))
            await _deadline_poll("the holder on the decode engine", lambda: s.decodes[0].active == 1)
            queued = [asyncio.create_task(_complete(session, s.proxy.url, f"queued-{i}")) for i in range(2)]
            await _deadline_poll("two queued", lambda: _depth_at_least(s, 2))
            status, headers, body, _ = await _complete(session, s.proxy.url, "refused")
            assert status == 429, body
            assert headers.get("Retry-After") == "2", headers  # ceil(--queue-timeout)
            assert "already waiting" in json.loads(body)["error"]["message"]
            for status, _, body, elapsed in await asyncio.gather(*queued):
                assert status == 503, body
                assert "admission queue" in json.loads(body)["error"]["message"]
                assert 1.4 <= elapsed < 10, elapsed  # the queue timeout, not at once and not the decode timeout
            holder.cancel()
        m = await s.metrics()
        assert m['atom_kv_proxy_admission_rejections_total{reason="queue_full"}'] == 1
        assert m['atom_kv_proxy_admission_rejections_total{reason="queue_timeout"}'] == 2
        assert m["atom_kv_proxy_admission_queue_depth"] == 0
        await _deadline_poll("every charge given back", s.all_idle)
    finally:
        await s.close()


async def test_a_client_that_leaves_the_queue_frees_its_place():
    s = await Setup.start("--max-concurrent-per-engine", "1", "--queue-size", "1", "--queue-timeout", "30")
    s.decodes[0].hang = True
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            holder = asyncio.create_task(_complete(session, s.proxy.url, "holder"))
            await _deadline_poll("the holder on the decode engine", lambda: s.decodes[0].active == 1)
            leaver = asyncio.create_task(_complete(session, s.proxy.url, "leaver"))
            await _deadline_poll("one queued", lambda: _depth_at_least(s, 1))
            assert (await _complete(session, s.proxy.url, "no-room"))[0] == 429
            leaver.cancel()  # the client closes its connection while queued
            await _deadline_poll("the queue empty again", lambda: _depth_is(s, 0))
            taker = asyncio.create_task(_complete(session, s.proxy.url, "taker"))  # queued, not 429
            await _deadline_poll("the newcomer queued", lambda: _depth_at_least(s, 1))
            assert not taker.done()
            s.decodes[0].hang = False
            holder.cancel()  # frees the decode engine: the queued one goes next
            status, _, body, _ = await taker
            assert status == 200, body
        assert "leaver" not in [r.request_id for r in s.decodes[0].received]
        m = await s.metrics()
        assert m['atom_kv_proxy_admission_rejections_total{reason="queue_full"}'] == 1
        await _deadline_poll("every charge given back", s.all_idle)
    finally:
        await s.close()


async def _depth_is(s: Setup, n: int) -> bool:
    return await s.depth() == n


async def test_the_rate_limit_is_per_bearer_token_else_per_address():
    s = await Setup.start("--rate-limit", "0.2,2")
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            sent = iter(range(100))

            async def send(token: str | None) -> tuple[int, dict[str, str]]:
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                status, answer_headers, _, _ = await _complete(session, s.proxy.url, f"rl-{next(sent)}", headers)
                return status, answer_headers

            alpha = [await send("alpha-secret-token") for _ in range(3)]
            assert [st for st, _ in alpha] == [200, 200, 429]
            assert 1 <= int(alpha[2][1]["Retry-After"]) <= 5, alpha[2][1]  # one token at 0.2/s
            assert (await send("beta-secret-token"))[0] == 200  # its own bucket
            by_address = [(await send(None))[0] for _ in range(3)]
            assert by_address == [200, 200, 429]  # no token: the client's address is the key
        m = await s.metrics()
        assert m['atom_kv_proxy_admission_rejections_total{reason="rate_limited"}'] == 2
        await _deadline_poll("every charge given back", s.all_idle)
        assert not [line for line in s.proxy.lines if "secret-token" in line]  # never logged
    finally:
        await s.close()
