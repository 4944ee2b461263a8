"""Routing policies: unit checks on real Instance objects, plus DP-rank spread end to end."""

from __future__ import annotations

import asyncio
import collections

import aiohttp
import pytest

from atom_kv.proxy.policies import (
    LeastLoaded, PowerOfTwo, PrefixHash, RandomChoice, RouteContext, RoundRobin, estimate_prompt_tokens,
    prompt_text,
)
from atom_kv.proxy.registry import CircuitBreaker, Instance
from atom_kv.proxy.settings import POLICIES
from tests.proxy.fake_engine import register

CTX = RouteContext(prefix="", prompt_tokens=10)


def _inst(role: str, n: int, dp: int = 1) -> Instance:
    return Instance(role=role, base_url=f"http://10.0.0.{n}:8000", host=f"10.0.0.{n}", http_port=8000,
                    handshake_port=6000, dp_size=dp, tp_size=1, breaker=CircuitBreaker(3, 1.0),
                    outstanding_tokens=[0] * dp)


def test_round_robin_independent_counters_and_dp_without_aliasing():
    policy = RoundRobin()
    ps = [_inst("P", 1, dp=2), _inst("P", 2, dp=2)]
    ds = [_inst("D", 3), _inst("D", 4), _inst("D", 5)]
    picks_p = [policy.choose("P", ps, CTX) for _ in range(8)]
    picks_d = [policy.choose("D", ds, CTX)[0].host for _ in range(3)]
    assert picks_d == ["10.0.0.3", "10.0.0.4", "10.0.0.5"]  # D counter unaffected by the 8 P picks
    assert [i.host for i, _ in picks_p] == ["10.0.0.1", "10.0.0.2"] * 4
    # every (instance, rank) is used equally: a shared counter % dp would pin each instance to one rank
    assert collections.Counter((i.host, r) for i, r in picks_p) == {
        ("10.0.0.1", 0): 2, ("10.0.0.1", 1): 2, ("10.0.0.2", 0): 2, ("10.0.0.2", 1): 2}


def test_random_uses_every_instance_and_rank():
    policy = RandomChoice(seed=1)
    ps = [_inst("P", 1, dp=2), _inst("P", 2, dp=2)]
    seen = {(i.host, r) for i, r in (policy.choose("P", ps, CTX) for _ in range(200))}
    assert seen == {("10.0.0.1", 0), ("10.0.0.1", 1), ("10.0.0.2", 0), ("10.0.0.2", 1)}


def test_power_of_two_prefers_fewer_inflight():
    policy = PowerOfTwo(seed=0)
    a, b = _inst("D", 1), _inst("D", 2)
    a.inflight = 5
    assert all(policy.choose("D", [a, b], CTX)[0] is b for _ in range(20))
    b.inflight = 9
    assert all(policy.choose("D", [a, b], CTX)[0] is a for _ in range(20))


def test_least_loaded_charge_and_credit():
    policy = LeastLoaded()
    a, b = _inst("P", 1, dp=2), _inst("P", 2)
    picks = []
    for tokens in (100, 50, 10):
        inst, rank = policy.choose("P", [a, b], CTX)
        inst.charge(rank, tokens)
        picks.append((inst.host, rank, tokens))
    # three empty slots get one request each
    assert {(h, r) for h, r, _ in picks} == {("10.0.0.1", 0), ("10.0.0.1", 1), ("10.0.0.2", 0)}
    # the next goes to the slot holding the 10-token request
    host, rank, _ = next(p for p in picks if p[2] == 10)
    inst, r = policy.choose("P", [a, b], CTX)
    assert (inst.host, r) == (host, rank)
    # crediting the 100-token slot makes it the emptiest
    host100, rank100, _ = next(p for p in picks if p[2] == 100)
    owner = a if host100 == a.host else b
    owner.credit(rank100, 100)
    assert owner.outstanding_tokens[rank100] == 0
    inst, r = policy.choose("P", [a, b], CTX)
    assert (inst.host, r) == (host100, rank100)


def test_prefix_hash_is_stable_and_spreads():
    ps = [_inst("P", n) for n in range(1, 5)]
    one, two = PrefixHash(16), PrefixHash(16)
    for prompt in ("alpha", "beta", "gamma " * 10):
        ctx = RouteContext(prefix=prompt[:16], prompt_tokens=1)
        assert one.choose("P", ps, ctx)[0] is two.choose("P", ps, ctx)[0]
    hosts = {one.choose("P", ps, RouteContext(prefix=f"prompt {i}", prompt_tokens=1))[0].host for i in range(64)}
    assert len(hosts) == 4
    # decode side is round robin
    ds = [_inst("D", 7), _inst("D", 8)]
    assert [one.choose("D", ds, CTX)[0].host for _ in range(4)] == ["10.0.0.7", "10.0.0.8"] * 2


def test_prompt_helpers():
    assert estimate_prompt_tokens({"prompt": "x" * 40}) == 10
    assert estimate_prompt_tokens({"prompt": [1, 2, 3, 4, 5]}) == 5
    assert estimate_prompt_tokens({"prompt": [[1, 2], [3]]}) == 3
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": "y" * 8}]}) == 2
    assert estimate_prompt_tokens({}) == 1
    assert prompt_text({"messages": [{"content": [{"type": "text", "text": "a"}]}, {"content": "b"}]}) == "a\nb"


async def test_dp_ranks_spread_end_to_end(make_proxy, make_engine):
    proxy = make_proxy()
    p = await make_engine("P", dp_size=2)
    d = await make_engine("D", dp_size=2)
    await register(proxy, p, d)
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            async with s.post(proxy.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
                assert r.status == 200
    p_ranks = [int(x.headers["X-data-parallel-rank"]) for x in p.received]
    d_ranks = [int(x.headers["X-data-parallel-rank"]) for x in d.received]
    assert sorted(p_ranks) == [0, 0, 1, 1] and sorted(d_ranks) == [0, 0, 1, 1]
    for pre, dec in zip(p.received, d.received):
        # prefill is told which decode rank will read; decode is told which prefill rank holds the KV
        assert pre.kv["remote_dp_rank"] == int(dec.headers["X-data-parallel-rank"])
        assert pre.kv["remote_dp_size"] == 2
        assert dec.kv["dp_rank"] == dec.kv["remote_dp_rank"] == int(pre.headers["X-data-parallel-rank"])


async def test_least_loaded_end_to_end_charges_then_credits(make_proxy, make_engine):
    proxy = make_proxy(policy="least_loaded")
    p1 = await make_engine("P", delay_s=0.8)
    p2 = await make_engine("P", delay_s=0.8)
    d = await make_engine("D")
    await register(proxy, p1, p2, d)

    async def one(session, prompt):
        async with session.post(proxy.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as r:
            assert r.status == 200

    async with aiohttp.ClientSession() as s:
        big = asyncio.create_task(one(s, "x" * 4000))  # ~1000 tokens
        assert await p1.wait_until(lambda: len(p1.received) + len(p2.received) == 1)
        async with s.get(proxy.url + "/instances") as r:
            snap = {(i["role"], i["address"]): i for i in await r.json()}
        loaded = [snap[("P", e.base_url)]["outstanding_tokens"] for e in (p1, p2)]
        assert sorted(loaded) == [[0], [1000]]
        # three small requests all avoid the instance holding the big one
        smalls = [asyncio.create_task(one(s, "y" * 40)) for _ in range(3)]
        await asyncio.gather(big, *smalls)
    big_engine = p1 if any(len(x.body["prompt"]) == 4000 for x in p1.received) else p2
    assert len(big_engine.received) == 1
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/instances") as r:
            assert all(i["outstanding_tokens"] == [0] and i["inflight"] == 0 for i in await r.json())


async def test_prefix_hash_end_to_end_locality(make_proxy, make_engine):
    proxy = make_proxy(policy="prefix_hash", prefix_chars=32)
    ps = [await make_engine("P") for _ in range(3)]
    d = await make_engine("D")
    await register(proxy, *ps, d)
    shared = "You are a helpful assistant. " * 4  # longer than prefix_chars
    async with aiohttp.ClientSession() as s:
        for i in range(5):
            body = {"prompt": shared + f"question {i}", "max_tokens": 1}
            async with s.post(proxy.url + "/v1/completions", json=body) as r:
                assert r.status == 200
        assert sorted(len(p.received) for p in ps) == [0, 0, 5]  # same prefix, same prefill
        for i in range(30):
            async with s.post(proxy.url + "/v1/completions", json={"prompt": f"{i} other", "max_tokens": 1}) as r:
                assert r.status == 200
    assert all(len(p.received) > 0 for p in ps)


@pytest.mark.parametrize("policy", POLICIES)
async def test_every_policy_serves_and_uses_all_decodes(make_proxy, make_engine, policy):
    proxy = make_proxy(policy=policy)
    ps = [await make_engine("P") for _ in range(2)]
    ds = [await make_engine("D") for _ in range(2)]
    await register(proxy, *ps, *ds)
    async with aiohttp.ClientSession() as s:
        for i in range(16):
            async with s.post(proxy.url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 1}) as r:
                assert r.status == 200
    assert sum(len(p.received) for p in ps) == 16 and sum(len(d.received) for d in ds) == 16
    assert all(d.received for d in ds)
