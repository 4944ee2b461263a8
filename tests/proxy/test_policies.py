"""Routing policies: unit checks on real Instance objects, plus DP-rank spread end to end."""

from __future__ import annotations

import asyncio
import collections

import aiohttp
import pytest

from atom_kv.proxy.fleet.registry import CircuitBreaker, Instance, Registration
from atom_kv.proxy.routing.policies import (
    CacheAware, LeastLoaded, PowerOfTwo, PrefixHash, RandomChoice, RouteContext, RoundRobin, estimate_prompt_tokens,
    make_policy, prompt_text,
)
from atom_kv.proxy.routing.prefix_tree import PrefixTree
from atom_kv.proxy.settings import POLICIES, ProxySettings
from atom_kv.testing.fake_engine import wait_engines
from tests.proxy.fake_engine import post, register

CTX = RouteContext(text="", prompt_tokens=10)


def _inst(role: str, n: int, dp: int = 1) -> Instance:
    return Instance(Registration(role=role, base_url=f"http://10.0.0.{n}:8000", host=f"10.0.0.{n}", http_port=8000,
                                 handshake_port=6000, dp_size=dp, tp_size=1), breaker=CircuitBreaker(3, 1.0))


def _ctx(text: str) -> RouteContext:
    return RouteContext(text=text, prompt_tokens=max(1, len(text) // 4))


def test_per_pool_policies_default_to_policy():
    s = ProxySettings(policy="least_loaded", prefill_policy="cache_aware")
    assert (s.policy_for("P"), s.policy_for("D")) == ("cache_aware", "least_loaded")
    assert ProxySettings(policy="random").policy_for("P") == "random"
    with pytest.raises(ValueError, match="decode_policy"):
        ProxySettings(decode_policy="fastest")


def test_round_robin_per_pool_and_dp_without_aliasing():
    policy_p, policy_d = RoundRobin(), RoundRobin()
    ps = [_inst("P", 1, dp=2), _inst("P", 2, dp=2)]
    ds = [_inst("D", 3), _inst("D", 4), _inst("D", 5)]
    picks_p = [policy_p.choose(ps, CTX) for _ in range(8)]
    picks_d = [policy_d.choose(ds, CTX)[0].host for _ in range(3)]
    assert picks_d == ["10.0.0.3", "10.0.0.4", "10.0.0.5"]  # D's policy unaffected by the 8 P picks
    assert [i.host for i, _ in picks_p] == ["10.0.0.1", "10.0.0.2"] * 4
    # every (instance, rank) is used equally: a shared counter % dp would pin each instance to one rank
    assert collections.Counter((i.host, r) for i, r in picks_p) == {
        ("10.0.0.1", 0): 2, ("10.0.0.1", 1): 2, ("10.0.0.2", 0): 2, ("10.0.0.2", 1): 2}


def test_random_uses_every_instance_and_rank():
    policy = RandomChoice(seed=1)
    ps = [_inst("P", 1, dp=2), _inst("P", 2, dp=2)]
    seen = {(i.host, r) for i, r in (policy.choose(ps, CTX) for _ in range(200))}
    assert seen == {("10.0.0.1", 0), ("10.0.0.1", 1), ("10.0.0.2", 0), ("10.0.0.2", 1)}


def test_power_of_two_prefers_fewer_inflight():
    policy = PowerOfTwo(seed=0)
    a, b = _inst("D", 1), _inst("D", 2)
    a.inflight = 5
    assert all(policy.choose([a, b], CTX)[0] is b for _ in range(20))
    b.inflight = 9
    assert all(policy.choose([a, b], CTX)[0] is a for _ in range(20))


def test_least_loaded_charge_and_credit():
    policy = LeastLoaded()
    a, b = _inst("P", 1, dp=2), _inst("P", 2)
    picks = []
    for tokens in (100, 50, 10):
        inst, rank = policy.choose([a, b], CTX)
        inst.add_load(rank, tokens)
        picks.append((inst.host, rank, tokens))
    # three empty slots get one request each
    assert {(h, r) for h, r, _ in picks} == {("10.0.0.1", 0), ("10.0.0.1", 1), ("10.0.0.2", 0)}
    # the next goes to the slot holding the 10-token request
    host, rank, _ = next(p for p in picks if p[2] == 10)
    inst, r = policy.choose([a, b], CTX)
    assert (inst.host, r) == (host, rank)
    # crediting the 100-token slot makes it the emptiest
    host100, rank100, _ = next(p for p in picks if p[2] == 100)
    owner = a if host100 == a.host else b
    owner.remove_load(rank100, 100)
    assert owner.outstanding_tokens[rank100] == 0
    inst, r = policy.choose([a, b], CTX)
    assert (inst.host, r) == (host100, rank100)


def test_prefix_hash_is_stable_and_spreads():
    ps = [_inst("P", n) for n in range(1, 5)]
    one, two = PrefixHash(16), PrefixHash(16)
    for prompt in ("alpha", "beta", "gamma " * 10):
        assert one.choose(ps, _ctx(prompt))[0] is two.choose(ps, _ctx(prompt))[0]
    hosts = {one.choose(ps, _ctx(f"prompt {i}"))[0].host for i in range(64)}
    assert len(hosts) == 4
    # only the first prefix_chars characters count
    assert one.choose(ps, _ctx("same sixteen cha" + "X"))[0] is one.choose(ps, _ctx("same sixteen cha" + "Y"))[0]


def test_prefix_hash_survives_membership_changes():
    """Rendezvous hashing: a joining instance takes only the prefixes it now wins; a leaving one
    gives away only its own. (``hash % n`` would move most prefixes in both cases.)"""
    policy = PrefixHash(64)
    four = [_inst("P", n) for n in range(1, 5)]
    five = four + [_inst("P", 9)]
    prompts = [f"conversation {i}: system prompt" for i in range(2000)]
    before = {p: policy.choose(four, _ctx(p))[0].host for p in prompts}
    after = {p: policy.choose(five, _ctx(p))[0].host for p in prompts}
    moved = [p for p in prompts if before[p] != after[p]]
    assert all(after[p] == "10.0.0.9" for p in moved)
    assert 0.12 < len(moved) / len(prompts) < 0.28  # about 1/5
    without_2 = [i for i in four if i.host != "10.0.0.2"]
    after = {p: policy.choose(without_2, _ctx(p))[0].host for p in prompts}
    assert all(before[p] == after[p] for p in prompts if before[p] != "10.0.0.2")


def test_prefix_tree_match_insert_split_and_lru_bound():
    tree = PrefixTree(max_chars=1000)
    tree.insert("hello world")
    tree.insert("hello there")  # splits the edge after "hello "
    assert tree.match("hello world, again") == 11 and tree.match("hello th") == 8 and tree.match("bye") == 0
    assert tree.size == len("hello world") + len("there")
    tree.insert("hello world")  # already there: no growth
    assert tree.size == 16
    small = PrefixTree(max_chars=100)
    for i in range(50):
        small.insert(f"{i:03d}" + "z" * 20)
        assert small.size <= 100
    # the most recent prompts survive, the oldest were evicted
    assert small.match("049" + "z" * 20) == 23 and small.match("000" + "z" * 20) < 3  # only "0" is shared


def test_cache_aware_hits_on_shared_prefixes():
    policy = CacheAware(cache_threshold=0.5, balance_abs_threshold=64, balance_rel_threshold=1.5)
    ps = [_inst("P", n) for n in range(1, 4)]
    systems = [f"You are assistant number {k}. " * 8 for k in range(3)]
    first = {}
    for k, system in enumerate(systems):
        first[k] = policy.choose(ps, _ctx(system + "first question"))[0]
    assert len({i.host for i in first.values()}) == 3  # misses spread to the emptiest trees
    for turn in range(5):
        for k, system in enumerate(systems):
            inst, _ = policy.choose(ps, _ctx(system + f"question {turn}"))
            assert inst is first[k]  # the engine that holds this prefix
    assert policy.decisions["cache_hit"] == 15 and policy.decisions["load_balance"] == 0


def test_cache_aware_falls_back_to_least_loaded_on_imbalance():
    policy = CacheAware(cache_threshold=0.3, balance_abs_threshold=4, balance_rel_threshold=1.5)
    a, b = _inst("P", 1), _inst("P", 2)
    text = "shared prefix " * 20
    owner, _ = policy.choose([a, b], _ctx(text + "0"))
    other = b if owner is a else a
    owner.inflight = 10  # 10 - 0 > 4 and 10 > 0 * 1.5: imbalanced
    inst, _ = policy.choose([a, b], _ctx(text + "1"))
    assert inst is other and policy.decisions["load_balance"] == 1
    owner.inflight = 3  # within the absolute threshold: back to the cache
    assert policy.choose([a, b], _ctx(text + "2"))[0] is owner


def test_cache_aware_memory_is_bounded_and_forgets_departed_instances():
    policy = CacheAware(max_chars=5000)
    ps = [_inst("P", n) for n in range(1, 3)]
    for i in range(2000):
        policy.choose(ps, _ctx(f"{i:05d} unique prompt " + "w" * 40))
    assert all(policy.trees[p.key].size <= 5000 for p in ps)
    assert sum(t.size for t in policy.trees.values()) > 5000  # both trees were used
    policy.forget(ps[0])
    assert ps[0].key not in policy.trees


def test_prompt_helpers():
    assert estimate_prompt_tokens({"prompt": "x" * 40}) == 10
    assert estimate_prompt_tokens({"prompt": [1, 2, 3, 4, 5]}) == 5
    assert estimate_prompt_tokens({"prompt": [[1, 2], [3]]}) == 3
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": "y" * 8}]}) == 2
    assert estimate_prompt_tokens({}) == 1
    assert prompt_text({"messages": [{"content": [{"type": "text", "text": "a"}]}, {"content": "b"}]}) == "a\nb"


async def test_dp_ranks_spread_end_to_end(make_proxy, make_engine):
    proxy = await make_proxy()
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
    proxy = await make_proxy(policy="least_loaded")
    p1 = await make_engine("P", delay_s=0.8)
    p2 = await make_engine("P", delay_s=0.8)
    d = await make_engine("D")
    await register(proxy, p1, p2, d)

    async def one(session, prompt):
        async with session.post(proxy.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as r:
            assert r.status == 200

    async with aiohttp.ClientSession() as s:
        big = asyncio.create_task(one(s, "x" * 4000))  # ~1000 tokens
        assert await wait_engines([p1, p2], lambda: len(p1.received) + len(p2.received) == 1)
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
    proxy = await make_proxy(policy="prefix_hash", prefix_chars=32)
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
    proxy = await make_proxy(policy=policy)
    ps = [await make_engine("P") for _ in range(2)]
    ds = [await make_engine("D") for _ in range(2)]
    await register(proxy, *ps, *ds)
    async with aiohttp.ClientSession() as s:
        for i in range(16):  # unrelated prompts (no shared first character: cache_aware spreads them)
            body = {"prompt": f"{chr(65 + i)} prompt {i}", "max_tokens": 1}
            async with s.post(proxy.url + "/v1/completions", json=body) as r:
                assert r.status == 200
    assert sum(len(p.received) for p in ps) == 16 and sum(len(d.received) for d in ds) == 16
    assert all(d.received for d in ds)


async def test_per_pool_policies_end_to_end(make_proxy, make_engine):
    """Prefill by cache affinity, decode round robin: one conversation's prefills stay on one
    engine while its decodes spread."""
    proxy = await make_proxy(prefill_policy="cache_aware", decode_policy="round_robin")
    ps = [await make_engine("P") for _ in range(3)]
    ds = [await make_engine("D") for _ in range(3)]
    await register(proxy, *ps, *ds)
    system = "You are a careful assistant that answers in one line. " * 4
    history = system
    for turn in range(6):
        history += f" user: question {turn}?"
        assert (await post(proxy.url, {"prompt": history, "max_tokens": 2}))[0] == 200
        history += " assistant: t0 t1"
    assert sorted(len(p.received) for p in ps) == [0, 0, 6]
    assert [len(d.received) for d in ds] == [2, 2, 2]


def test_make_policy_knows_every_name_and_gives_each_pool_its_own_object():
    for name in POLICIES:
        a, b = make_policy(name), make_policy(name)
        assert a is not b and type(a) is type(b)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")
