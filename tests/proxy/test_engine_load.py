"""Engine-reported load: the parsers of a reference engine's ``/health`` and of vLLM's ``/metrics`` (garbage,
huge and missing lines included), the registry's clearing rules for ``reported_load``, and the
:class:`LoadReader` against real HTTP servers on 127.0.0.1 (a vLLM-like one that says nothing in
``/health``, and one whose answers are garbage: counted, survived)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web

from atom_kv.proxy.fleet.load import LoadReader, LoadSource, _Follow
from atom_kv.proxy.fleet.load_parse import (
    MAX_SAMPLES, LoadParseError, parse_health, parse_vllm_metrics,
)
from atom_kv.proxy.fleet.registry import Registration, Registry, ReportedLoad
from atom_kv.proxy.fleet.static import parse_engine_spec
from atom_kv.proxy.observability.metrics import ProxyMetrics


def _reference_health(ranks: list[tuple[int, int, int, int]]) -> bytes:
    """A body shaped like the reference engine's /health (atom_kv.reference.server), one entry per
    (running, waiting, load requests, load prompt tokens)."""
    return json.dumps({
        "status": "ok", "role": "kv_consumer", "engine_id": "e-1", "tp_size": 1, "dp_size": len(ranks),
        "kv_features": ["first_token"], "kv_blocks": {"total": 8, "free": 8, "held": 0, "cached": 0},
        "requests": {"running": sum(r[0] for r in ranks), "waiting": sum(r[1] for r in ranks), "waiting_remote_kv": 0},
        "dp_ranks": [{"dp_rank": n, "engine_id": f"e-1-{n}", "kv_blocks": {"total": 8}, "kv_events": None,
                      "requests": {"running": r[0], "waiting": r[1], "waiting_remote_kv": 0},
                      "load": {"requests": r[2], "prompt_tokens": r[3]}} for n, r in enumerate(ranks)],
        "kv_routes": [],
    }).encode()


# ---------------------------------------------------------------------------------------------- /health
def test_health_reads_each_dp_rank_load():
    assert parse_health(_reference_health([(1, 2, 3, 300), (0, 0, 0, 0)])) == {0: (3, 300), 1: (0, 0)}


def test_health_without_load_sums_requests_and_uses_top_level_without_ranks():
    body = {"dp_ranks": [{"dp_rank": 0, "requests": {"running": 2, "waiting": 1, "waiting_remote_kv": 4}}]}
    assert parse_health(json.dumps(body).encode()) == {0: (7, 0)}
    assert parse_health(b'{"status": "ok", "requests": {"running": 5, "waiting": 1}}') == {0: (6, 0)}


@pytest.mark.parametrize("raw", [b"", b"   ", b"OK", b'"ok"', b"{}", b'{"status": "ok", "dp_ranks": []}'])
def test_health_that_says_nothing_is_none(raw):
    assert parse_health(raw) is None  # vLLM's empty 200 and the like: read /metrics instead


@pytest.mark.parametrize("raw", [
    b"{not json",
    b'{"dp_ranks": [{"dp_rank": 0, "load": {"requests": -1}}]}',
    b'{"dp_ranks": [{"dp_rank": 0, "load": {"requests": "many"}}]}',
    b'{"dp_ranks": [{"dp_rank": 99999, "load": {"requests": 1}}]}',
    b'{"requests": {"running": 1e300}}',
    b'{"dp_ranks": {"0": 1}}',
    json.dumps({"dp_ranks": [{"dp_rank": 0}] * 5000}).encode(),
])
def test_malformed_health_raises_our_error(raw):
    with pytest.raises(LoadParseError) as err:
        parse_health(raw)
    assert err.value.reason == "malformed"


# ---------------------------------------------------------------------------------------------- vLLM /metrics
VLLM_METRICS = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 50.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
"""


def test_vllm_metrics_per_engine_rank():
    assert parse_vllm_metrics(VLLM_METRICS, dp_size=2) == {0: (5, 0), 1: (1, 0)}


def test_vllm_metrics_engine_indexes_beyond_dp_size():
    offset = VLLM_METRICS.replace(b'engine="0"', b'engine="4"').replace(b'engine="1"', b'engine="5"')
    assert parse_vllm_metrics(offset, dp_size=2) == {0: (5, 0), 1: (1, 0)}  # a hybrid-LB server's ranks, in order
    assert parse_vllm_metrics(offset, dp_size=1) == {0: (6, 0)}  # one rank: everything is rank 0


def test_vllm_metrics_sum_models_and_take_unlabelled_as_rank_zero():
    text = (b'vllm:num_requests_running{model_name="a",engine="0"} 1\n'
            b'vllm:num_requests_running{model_name="b",engine="0"} 2 1712345678000\n'
            b"vllm:num_requests_waiting 4\n")
    assert parse_vllm_metrics(text, dp_size=1) == {0: (7, 0)}


@pytest.mark.parametrize("text", [b"", b"# only comments\n", b"http_requests_total 5\n",
                                  b"vllm:num_requests_waiting_by_reason{reason=\"x\"} 3\n"])
def test_vllm_metrics_missing_is_none(text):
    assert parse_vllm_metrics(text, dp_size=1) is None


@pytest.mark.parametrize("line", [
    b'vllm:num_requests_running{engine="0"} lots',
    b'vllm:num_requests_running{engine="0"} NaN',
    b'vllm:num_requests_running{engine="0"} -1',
    b'vllm:num_requests_running{engine="0"} +Inf',
    b'vllm:num_requests_running{engine="0" 1',
    b'vllm:num_requests_running{engine="0"}',
])
def test_vllm_metrics_garbage_raises_our_error(line):
    with pytest.raises(LoadParseError) as err:
        parse_vllm_metrics(b"# TYPE x gauge\n" + line + b"\n", dp_size=1)
    assert err.value.reason == "malformed"


def test_vllm_metrics_huge_text_is_searched_not_split():
    filler = b"".join(b'vllm:request_latency_bucket{le="%d",engine="0"} 1\n' % n for n in range(200_000))
    assert len(filler) > 8 << 20
    assert parse_vllm_metrics(filler + VLLM_METRICS, dp_size=2) == {0: (5, 0), 1: (1, 0)}
    too_many = b"".join(b'vllm:num_requests_running{engine="0",x="%d"} 1\n' % n for n in range(MAX_SAMPLES + 1))
    with pytest.raises(LoadParseError):
        parse_vllm_metrics(too_many, dp_size=1)


# ---------------------------------------------------------------------------------------------- registry
def _reg(engine_id: str, dp: int = 1) -> Registration:
    return Registration(role="D", base_url="http://127.0.0.1:9", host="127.0.0.1", http_port=9, handshake_port=None,
                        dp_size=dp, tp_size=1, engine_id=engine_id)


async def test_registry_clears_reported_load_on_restart_and_down():
    registry = Registry(15.0, 3, 10.0)
    registry.upsert(_reg("a", dp=2))
    inst = registry.get("D", "http://127.0.0.1:9")
    assert inst.reported_load == [None, None]
    inst.reported_load = [ReportedLoad(3, 30, 1.0), ReportedLoad(1, 10, 1.0)]
    registry.upsert(_reg("a", dp=2))  # the same engine pinging again: kept
    assert inst.reported_load[0] == ReportedLoad(3, 30, 1.0)
    registry.upsert(_reg("a", dp=3))  # a rank more: fitted
    assert inst.reported_load[2] is None and inst.reported_load[1] is not None
    registry.upsert(_reg("b", dp=3))  # a new engine id: a restart
    assert inst.reported_load == [None, None, None]
    registry.mark_up(inst)
    inst.reported_load = [ReportedLoad(1, 0, 1.0)] * 3
    assert inst.describe(2.0)["reported_load"][0] == {"requests": 1, "prompt_tokens": 0, "age_s": 1.0}
    registry.mark_down(inst, "gone")
    assert inst.reported_load == [None, None, None]


# ---------------------------------------------------------------------------------------------- the reader
class _Engine:
    """A real HTTP server on 127.0.0.1 answering /health and /metrics with the bodies the test sets."""

    def __init__(self, health: bytes, metrics: bytes) -> None:
        self.health, self.metrics = health, metrics
        self.paths: list[str] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> "_Engine":
        async def answer(request: web.Request) -> web.Response:
            self.paths.append(request.path)
            return web.Response(body=self.health if request.path == "/health" else self.metrics)

        app = web.Application()
        app.router.add_get("/health", answer)
        app.router.add_get("/metrics", answer)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


def _failures(metrics: ProxyMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("atom_kv_proxy_engine_load_failures_total", {"reason": reason}) or 0.0


async def _reader_for(port: int, dp: int = 1, max_bytes: int = 1 << 20, interval_s: float = 3600.0):
    """A started reader and its one static instance, marked up after the reader's first tick (so with the
    default interval, only the test's own ``read`` calls read it)."""
    registry = Registry(15.0, 3, 10.0)
    inst = registry.add_static(parse_engine_spec("D", f"http://127.0.0.1:{port},dp={dp}"))
    metrics = ProxyMetrics()
    reader = LoadReader(registry, metrics, interval_s=interval_s, timeout_s=2.0, connect_timeout=2.0,
                        max_bytes=max_bytes)
    await reader.start()
    await asyncio.sleep(0)  # its first tick: nothing up yet
    registry.mark_up(inst)
    return reader, inst, metrics


async def test_reader_falls_back_to_vllm_metrics_and_survives_garbage():
    async with _Engine(b"", VLLM_METRICS) as engine:
        reader, inst, metrics = await _reader_for(engine.port, dp=2)
        try:
            follow = _Follow(inst)
            await reader.read(follow)  # /health says nothing: /metrics, at once
            assert engine.paths == ["/health", "/metrics"] and follow.source is LoadSource.METRICS
            assert [(r.requests, r.prompt_tokens) for r in inst.reported_load] == [(5, 0), (1, 0)]
            await reader.read(follow)
            assert engine.paths[2:] == ["/metrics"]  # known to be a /metrics engine: no /health again

            before = inst.reported_load
            engine.metrics = b'vllm:num_requests_running{engine="0"} garbage\n'
            await reader.read(follow)
            assert _failures(metrics, "malformed") == 1 and inst.reported_load == before  # counted, kept
            engine.metrics = b"nothing_here 1\n"
            await reader.read(follow)
            assert _failures(metrics, "missing") == 1 and follow.source is LoadSource.NONE
        finally:
            await reader.close()


async def test_reader_reads_reference_health_bounded():
    async with _Engine(_reference_health([(1, 1, 2, 64)]), b"") as engine:
        reader, inst, metrics = await _reader_for(engine.port, max_bytes=4096)
        try:
            follow = _Follow(inst)
            await reader.read(follow)
            assert engine.paths == ["/health"] and follow.source is LoadSource.HEALTH
            assert (inst.reported_load[0].requests, inst.reported_load[0].prompt_tokens) == (2, 64)
            engine.health = b'{"dp_ranks": [{"dp_rank": 0, "load": {"requests": 1}}], "pad": "' + b"x" * 8192 + b'"}'
            await asyncio.wait_for(reader.read(follow), 10)  # over the bound and whole in one read: refused
            assert _failures(metrics, "too_large") == 1 and inst.reported_load[0].requests == 2
        finally:
            await reader.close()
        assert reader._pool is None


async def test_reader_task_reads_at_its_interval_and_sees_the_load_change():
    async with _Engine(_reference_health([(1, 0, 1, 10)]), b"") as engine:
        reader, inst, _ = await _reader_for(engine.port, interval_s=0.1)
        try:
            await asyncio.wait_for(_until(lambda: inst.reported_load[0] is not None), 5)
            assert inst.reported_load[0].requests == 1
            engine.health = _reference_health([(0, 0, 0, 0)])
            await asyncio.wait_for(_until(lambda: inst.reported_load[0].requests == 0), 5)
            assert "/metrics" not in engine.paths
        finally:
            await reader.close()


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.05)


class _CountingServers:
    """``n`` real HTTP/1.1 keep-alive servers on 127.0.0.1 answering ``GET /health`` with a reference body;
    counts the connections they accept, all together."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.accepted = 0
        self.servers: list[asyncio.base_events.Server] = []
        self.ports: list[int] = []
        body = _reference_health([(0, 0, 0, 0)])
        self.answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(self.answer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> "_CountingServers":
        for _ in range(self.n):
            server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.servers.append(server)
            self.ports.append(server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        for server in self.servers:
            server.close()


async def test_reader_keeps_one_connection_per_engine_in_a_fleet_larger_than_its_concurrency():
    from atom_kv.proxy.fleet.load import MAX_CONCURRENT_READS

    n = MAX_CONCURRENT_READS + 16
    async with _CountingServers(n) as engines:
        registry = Registry(15.0, 3, 10.0, max_instances=2 * n)
        for port in engines.ports:
            registry.upsert(Registration(role="D", base_url=f"http://127.0.0.1:{port}", host="127.0.0.1",
                                         http_port=port, handshake_port=1, dp_size=1, tp_size=1))
        insts = registry.known("D")
        for inst in insts:
            registry.mark_up(inst)
        reader = LoadReader(registry, ProxyMetrics(), interval_s=1.0, timeout_s=5.0, connect_timeout=5.0,
                            max_bytes=1 << 20)
        await reader.start()
        try:
            reader._task.cancel()  # the test runs the ticks itself
            for rounds in (1, 2, 3):
                reader.tick(time.monotonic() + 10.0 * rounds)  # every engine due
                reads = [f.task for f in reader._follows.values() if f.task is not None]
                assert len(reads) == n
                await asyncio.wait_for(asyncio.gather(*reads), 20)
                assert all(i.reported_load[0] is not None for i in insts)
            # each engine's connection was opened once and kept for the next readings (not 1 per reading)
            assert engines.accepted == n
        finally:
            await reader.close()
