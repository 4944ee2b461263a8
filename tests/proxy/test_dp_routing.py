"""The proxy routes each leg to an (instance, DP rank): the rank goes in the
X-data-parallel-rank header and, only for engines that take it, in the
``data_parallel_rank`` body field; /metrics shows each (instance, DP rank)."""

from __future__ import annotations

import random

import aiohttp
import pytest

from atom_kv.proxy.fleet.registry import CircuitBreaker, Instance, Registration
from atom_kv.proxy.fleet.static import parse_engine_spec
from atom_kv.proxy.routing.policies import LeastLoaded, RouteContext
from tests.proxy.fake_engine import register


async def _send(proxy, n: int, body: dict | None = None) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            async with s.post(proxy.url + "/v1/completions",
                              json={"prompt": "x" * 40, "max_tokens": 1, **(body or {})}) as r:
                assert r.status == 200, await r.text()


async def test_atom_format_engines_get_the_rank_in_the_body_and_the_header(make_proxy, make_engine):
    proxy = await make_proxy()
    p = await make_engine("P", dp_size=2)
    d = await make_engine("D", dp_size=3)
    await register(proxy, p, d)
    # a client's own field never decides: the proxy's pick does
    await _send(proxy, 6, {"data_parallel_rank": 7})
    for engine, size in ((p, 2), (d, 3)):
        ranks = [x.body["data_parallel_rank"] for x in engine.received]
        assert ranks == [int(x.headers["X-data-parallel-rank"]) for x in engine.received]
        assert sorted(set(ranks)) == list(range(size))
    for pre, dec in zip(p.received, d.received):
        assert pre.kv["remote_dp_rank"] == dec.body["data_parallel_rank"]
        assert dec.kv["remote_dp_rank"] == pre.body["data_parallel_rank"]


async def test_moriio_format_engines_get_only_the_header(make_proxy, make_engine):
    proxy = await make_proxy()
    p = await make_engine("P", dp_size=2)
    d = await make_engine("D", dp_size=2)
    await register(proxy, p, d, fmt="moriio")
    await _send(proxy, 4, {"data_parallel_rank": 1})
    for engine in (p, d):
        assert all("data_parallel_rank" not in x.body for x in engine.received)
        assert sorted(int(x.headers["X-data-parallel-rank"]) for x in engine.received) == [0, 0, 1, 1]


def test_static_spec_names_the_body_field_capability():
    assert parse_engine_spec("P", "http://h:1,7000,dp=8,dp_rank_field=1").dp_rank_field is True
    assert parse_engine_spec("P", "http://h:1,7000,dp=8").dp_rank_field is False
    with pytest.raises(ValueError, match="dp_rank_field must be 0 or 1, got 'yes'"):
        parse_engine_spec("D", "http://h:1,dp_rank_field=yes")


async def test_metrics_show_requests_and_outstanding_tokens_per_instance_and_rank(make_proxy, make_engine):
    proxy = await make_proxy(policy="least_loaded")
    p = await make_engine("P", dp_size=2)
    d = await make_engine("D", dp_size=2)
    await register(proxy, p, d)
    await _send(proxy, 6)
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/metrics") as r:
            text = await r.text()
    m = {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines() if line[:1] not in ("#", ""))}
    for role, engine in (("prefill", p), ("decode", d)):
        for rank in (0, 1):
            labels = f'{{dp_rank="{rank}",instance="{engine.base_url}",role="{role}"}}'
            assert m[f"atom_kv_proxy_dp_rank_requests_total{labels}"] == 3
            assert m[f"atom_kv_proxy_dp_rank_outstanding_tokens{labels}"] == 0
            assert m[f"atom_kv_proxy_dp_rank_outstanding_requests{labels}"] == 0


def _inst(n: int, dp: int) -> Instance:
    return Instance(Registration(role="D", base_url=f"http://10.0.0.{n}:8000", host=f"10.0.0.{n}", http_port=8000,
                                 handshake_port=6000, dp_size=dp, tp_size=1), breaker=CircuitBreaker(3, 1.0))


def test_least_loaded_balances_outstanding_tokens_per_rank():
    """sgl-model-gateway's DP-aware rule: the (instance, rank) with the fewest outstanding
    prompt tokens; 64 requests of mixed sizes, some finishing on the way, stay within 25%."""
    rng = random.Random(5)
    insts = [_inst(1, 2), _inst(2, 3)]
    policy = LeastLoaded()
    live: list[tuple[Instance, int, int]] = []
    for i in range(64):
        tokens = rng.randint(5, 60)
        inst, rank = policy.choose(insts, RouteContext(text="", prompt_tokens=tokens))
        inst.add_load(rank, tokens)
        live.append((inst, rank, tokens))
        if i % 8 == 7:  # a few finish
            done = live.pop(rng.randrange(len(live)))
            done[0].remove_load(done[1], done[2])
    loads = [t for inst in insts for t in inst.outstanding_tokens]
    mean = sum(loads) / len(loads)
    assert all(abs(x - mean) <= 0.25 * mean for x in loads), loads
    assert sum(r for inst in insts for r in inst.outstanding_requests) == len(live)


async def test_static_dp_size_from_health_wins_with_one_line_per_value(caplog):
    """What a static engine's /health says about its DP size, probe after probe: the spec's ``dp=`` gives
    way to it, a disagreement or an out-of-bounds value is one warning, repeated answers say nothing."""
    from atom_kv.proxy.fleet.health import HealthMonitor, UpstreamHealth
    from atom_kv.proxy.fleet.registry import Registry
    from atom_kv.proxy.observability.metrics import ProxyMetrics

    registry = Registry(heartbeat_timeout=5.0, circuit_failures=3, circuit_cooldown_s=1.0)
    monitor = HealthMonitor(registry, UpstreamHealth(registry, ProxyMetrics()), interval_s=1.0, timeout_s=1.0,
                            connect_timeout=1.0, tick_s=1.0, max_dp_size=8)
    given = registry.add_static(parse_engine_spec("D", "http://h:2,dp=4"))
    learnt = registry.add_static(parse_engine_spec("P", "http://h:1"))
    assert (given.dp_size, learnt.dp_size) == (4, 1)
    caplog.set_level("INFO", logger="atom_kv.proxy.fleet.health")
    for _ in range(3):
        assert monitor._apply(given, {"role": "decode", "dp_size": 2})
        assert monitor._apply(learnt, {"role": "prefill", "dp_size": 2})
    assert (given.dp_size, len(given.outstanding_tokens), learnt.dp_size) == (2, 2, 2)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["static decode engine http://h:2: its /health reports dp_size=2 but its --decode spec "
                        "says dp=4; using dp_size=2 from /health (correct or drop dp= in the spec)"]
    assert [r.getMessage() for r in caplog.records if r.levelname == "INFO"] == [
        "static prefill engine http://h:1: dp_size=2 from its /health"]
    caplog.clear()
    for bad in (9, 0, True, "3"):  # beyond --max-dp-size, not a size, not an int: the size stays
        assert monitor._apply(learnt, {"dp_size": bad})
        assert monitor._apply(learnt, {"dp_size": bad})
    assert learnt.dp_size == 2
    assert [r.getMessage() for r in caplog.records] == [
        "static prefill engine http://h:1: its /health reports dp_size=9, outside 1..8 (--max-dp-size); keeping "
        "dp_size=2",
        "static prefill engine http://h:1: its /health reports dp_size=0, outside 1..8 (--max-dp-size); keeping "
        "dp_size=2"]
    assert monitor._apply(given, {"dp_size": 4}) and given.dp_size == 4  # the engine came back with 4: no line
    assert [r.levelname for r in caplog.records].count("WARNING") == 2
