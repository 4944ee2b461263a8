"""A hostile or broken engine cannot stall the proxy or reach other parties (issue 27, item 4).

* a 64 MiB ``Server-Timing`` header: a real proxy process, a raw-socket engine sending it, and
  other clients served meanwhile (reproduction before this change: 17.2 s parsing it, other
  clients waiting up to 8.1 s);
* a prefill body over ``--max-upstream-body-bytes``: a 502 naming the flag;
* garbage ``first_token_ids`` and an 8 MiB ``first_token_text``: neither the decode leg nor the
  client sees them, the request takes the sequential path.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import pytest

from atom_kv.proxy.fleet.static import parse_engine_spec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json as http
from atom_kv.testing.web import scrape_metrics
from atom_kv.wire import KV_FEATURE_FIRST_TOKEN
from tests.proxy.fake_engine import post
from tests.proxy.procs import FakeEngines, ProxyProcess

MiB = 1024 * 1024
_HEALTH = b'{"status":"ok","role":"prefill","engine_id":"evil","tp_size":1}'
_MODELS = b'{"object":"list","data":[{"id":"fake-model","max_model_len":32768}]}'


class HugeHeaderEngine:
    """A raw-socket prefill engine (its own event loop on a named thread): answers its health
    probes, and every completion with a ``Server-Timing`` header of ``header_bytes``."""

    def __init__(self, header_bytes: int) -> None:
        self.header_bytes = header_bytes
        self.posts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-huge-header-engine", daemon=True)
        self._server: asyncio.AbstractServer | None = None

    def start(self) -> "HugeHeaderEngine":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result(10)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                await asyncio.wait_for(reader.readexactly(length), 30)
                if head.startswith(b"POST"):
                    self.posts += 1
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nserver-timing: ")
                    chunk = b"a" * MiB
                    for _ in range(self.header_bytes // MiB):
                        writer.write(chunk)
                        await writer.drain()
                    writer.write(b"\r\ncontent-length: 2\r\n\r\n{}")
                else:
                    body = _HEALTH if head.startswith(b"GET /health") else _MODELS
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                                 % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_a_64_mib_server_timing_header_does_not_stall_other_clients():
    engines = FakeEngines("--prefills", "1", "--decodes", "1")
    evil = HugeHeaderEngine(64 * MiB).start()
    proxy = ProxyProcess("--no-discovery", "--probe-interval", "0.2", "--prefill", engines.prefill[0],
                         "--prefill", evil.url, "--decode", engines.decode[0], "--prefill-timeout", "60")
    try:
        want = (200, {"status": "ok", "prefill": 2, "decode": 1})
        wait_until(lambda: http("GET", proxy.url + "/health") == want, 15, interval=0.05, what="engines up")

        async def clients() -> list[tuple[int, float]]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                async def one(i: int) -> tuple[int, float]:
                    started = time.perf_counter()
                    async with s.post(proxy.url + "/v1/completions", json={"prompt": f"c{i}", "max_tokens": 2}) as r:
                        await r.read()
                        return r.status, time.perf_counter() - started

                async def worker(w: int) -> list[tuple[int, float]]:
                    return [await one(w * 100 + i) for i in range(6)]

                return [x for xs in await asyncio.gather(*(worker(w) for w in range(4))) for x in xs]

        results = asyncio.run(asyncio.wait_for(clients(), 120))
        statuses = [s for s, _ in results]
        worst = max(t for _, t in results)
        assert statuses == [200] * 24  # the one routed to the engine was retried on the other prefill
        assert evil.posts >= 1
        # generous for a loaded test machine; the figure the issue asks for is measured by the bench
        assert worst < 2.0, f"slowest request took {worst:.3f} s"
        metrics = scrape_metrics(proxy.url + "/metrics")
        assert metrics['atom_kv_proxy_upstream_failures_total{kind="too_large",role="prefill"}'] == evil.posts
    finally:
        proxy.kill()
        engines.stop()
        evil.close()


# ---------------------------------------------------------------------------------------- in-process proxy
async def _static_pair(make_proxy, make_engine, proxy: dict | None = None, d_features: tuple[str, ...] = ()):
    p = await make_engine("P", kv_features=(KV_FEATURE_FIRST_TOKEN,))
    d = await make_engine("D", kv_features=d_features)
    running = await make_proxy(discovery=False, static_prefill=(parse_engine_spec("P", p.base_url),),
                               static_decode=(parse_engine_spec("D", d.base_url),), **(proxy or {}))
    ok = await running.registry.wait_for(lambda r: bool(r.live("P")) and bool(r.live("D")), 5)
    assert ok, running.registry.snapshot()
    return running, p, d


async def test_a_prefill_body_over_the_bound_is_a_502_naming_the_flag(make_proxy, make_engine):
    proxy, p, d = await _static_pair(make_proxy, make_engine, dict(max_upstream_body_bytes=MiB))
    p.answer_padding = 2 * MiB  # stands for the 200 MB answer, with a smaller bound
    status, _, body = await post(proxy.url, {"prompt": "x", "max_tokens": 2})
    assert status == 502
    message = json.loads(body)["error"]["message"]
    assert "over --max-upstream-body-bytes (1048576)" in message and p.base_url not in message  # the proxy's words
    assert d.received == []  # nothing went on to the decode engine
    p.answer_padding = 0
    assert (await post(proxy.url, {"prompt": "x", "max_tokens": 2}))[0] == 200


def _texts(raw: bytes) -> list[str]:
    events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ") and e != b"data: [DONE]"]
    return [c["text"] for e in events for c in json.loads(e)["choices"]]


@pytest.mark.parametrize("ids, text", [
    (["x"], "X"), ([-5], "X"), ([[1]], "X"), ([2**70], "X"), (list(range(1_000_000)), "X"),
    ([True], "X"), ([], "X"), ("7", "X"), ([7], "X" * (8 * MiB)), ([7], 7),
])
async def test_garbage_first_tokens_reach_neither_the_decode_leg_nor_the_client(make_proxy, make_engine, ids, text):
    proxy, p, d = await _static_pair(make_proxy, make_engine, d_features=(KV_FEATURE_FIRST_TOKEN,))
    p.first_token_ids, p.first_token_text = ids, text
    status, _, raw = await post(proxy.url, {"prompt": "x", "max_tokens": 3, "stream": True})
    assert status == 200
    assert _texts(raw) == [" t0", " t1", " t2"]  # the decode engine's own stream, nothing of the prefill's
    (leg,) = d.received
    assert "first_token_ids" not in leg.kv and "first_token_text" not in leg.kv
    assert "first_token_sent" not in leg.kv  # the sequential path
    assert proxy.count("atom_kv_proxy_first_tokens_dropped_total") == 1


async def test_a_well_formed_first_token_is_still_forwarded(make_proxy, make_engine):
    """The control for the test above: the same pair forwards a first token within the bounds."""
    proxy, p, d = await _static_pair(make_proxy, make_engine, d_features=(KV_FEATURE_FIRST_TOKEN,))
    p.first_token_ids, p.first_token_text = [7], "X"
    status, _, raw = await post(proxy.url, {"prompt": "x", "max_tokens": 3, "stream": True})
    assert status == 200 and _texts(raw)[0] == "X"
    (leg,) = d.received
    assert leg.kv["first_token_ids"] == [7] and leg.kv["first_token_sent"] is True
    assert proxy.count("atom_kv_proxy_first_tokens_dropped_total") == 0


async def test_a_decode_event_over_the_bound_ends_the_stream_with_an_error(make_proxy, make_engine):
    """A decode engine that never ends its event: the proxy holds at most the bound, then ends the
    client's stream with an error event naming the flag and drops the engine's connection."""
    dropped = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length")), 0)
            await reader.readexactly(length)
            if head.startswith(b"GET"):
                body = b'{"status":"ok","role":"decode"}' if head.startswith(b"GET /health") else _MODELS
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%b" % (len(body), body))
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: ")
            for _ in range(32):  # 2 MiB of one event, never ended
                writer.write(b"x" * (64 * 1024))
                await writer.drain()
            await asyncio.wait_for(reader.read(1), 10)  # until the proxy drops the connection
            dropped.set()
        except (ConnectionError, asyncio.IncompleteReadError):
            dropped.set()
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    d_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    p = await make_engine("P")
    proxy = await make_proxy(discovery=False, static_prefill=(parse_engine_spec("P", p.base_url),),
                             static_decode=(parse_engine_spec("D", d_url),), max_upstream_body_bytes=MiB)
    assert await proxy.registry.wait_for(lambda r: bool(r.live("P")) and bool(r.live("D")), 5)
    try:
        status, _, raw = await post(proxy.url, {"prompt": "x", "max_tokens": 3, "stream": True})
        assert status == 200 and len(raw) < 64 * 1024  # none of the oversized event reached the client
        assert b"over --max-upstream-body-bytes" in raw and raw.endswith(b"data: [DONE]\n\n")
        await asyncio.wait_for(dropped.wait(), 10)
        (d,) = proxy.registry.known("D")  # a request may ask for huge events: judged like a 500
        assert d.breaker.window.totals(time.monotonic()) == (0, 0, 1) and d.breaker.state() == "closed"
    finally:
        server.close()
