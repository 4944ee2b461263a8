"""kv_aware: its cost (cached prefix against load, the engine's reported load blended with the proxy's own,
stale reports ignored), ties broken alike in every proxy process, predict-on-route, the cache_aware fallback,
and the prompt token ids it routes on (body, --tokenizer, an engine's /tokenize)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys

import pytest

from atom_kv.proxy.fleet.registry import CircuitBreaker, Instance, Registration, ReportedLoad
from atom_kv.proxy.kv_events.index import KvIndex
from atom_kv.proxy.kv_events.wire import BlockStored
from atom_kv.proxy.routing.kv_aware import (
    LOAD_WEIGHT, REPORTED_LOAD_MAX_AGE_S, REQUEST_BLOCKS, KvAware, rank_cost,
)
from atom_kv.proxy.routing.policies import CacheAware, RouteContext, make_policy
from atom_kv.proxy.routing.token_ids import PromptTokenIds, body_token_ids
from atom_kv.proxy.settings import ProxySettings
from atom_kv.testing.processes import REPO_ROOT

BS = 16
PROMPT = [(i * 37 + 11) % 32000 for i in range(8 * BS)]  # eight blocks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _inst(role: str, n: int, dp: int = 1) -> Instance:
    return Instance(Registration(role=role, base_url=f"http://10.0.0.{n}:8000", host=f"10.0.0.{n}", http_port=8000,
                                 handshake_port=6000, dp_size=dp, tp_size=1), breaker=CircuitBreaker(3, 1.0))


def _stored(index: KvIndex, inst: Instance, rank: int, blocks: int, tokens=PROMPT) -> None:
    index.apply(inst.key, rank, [BlockStored(block_hashes=list(range(1000 * rank + 1, 1000 * rank + blocks + 1)),
                                             parent_block_hash=None, token_ids=tokens[:blocks * BS],
                                             block_size=BS)])


def _ctx(index: KvIndex, tokens=PROMPT) -> RouteContext:
    return RouteContext("", len(tokens), tokens, index.prompt_keys(tokens))


def _policy(role: str = "P", clock: Clock | None = None) -> tuple[KvAware, KvIndex]:
    clock = clock or Clock()
    index = KvIndex(max_blocks=10_000, max_blocks_per_worker=10_000, clock=clock)
    return KvAware(role, index, CacheAware(), clock=clock), index


def test_the_cost_is_uncached_blocks_plus_the_weighted_queue_in_blocks():
    # 8 blocks, 3 cached: 5 to compute; 64 own tokens (4 blocks) and 2 own requests queued
    assert rank_cost("P", 128, 48, BS, 64, 2, None) == 5 + LOAD_WEIGHT["P"] * (4 + REQUEST_BLOCKS * 2)
    # a partial last block is a block to compute; a cached part of a block is not cached
    assert rank_cost("D", 129, 40, BS, 0, 0, None) == 9 - 2
    # the engine's report is blended by the larger of the two views, each on its own
    report = ReportedLoad(requests=1, prompt_tokens=160, at=0.0)
    assert rank_cost("P", 128, 0, BS, 64, 3, report) == 8 + LOAD_WEIGHT["P"] * (10 + REQUEST_BLOCKS * 3)


def test_the_prefill_rank_holding_the_longest_prefix_wins_until_its_queue_outweighs_it():
    policy, index = _policy("P")
    a, b = _inst("P", 1, dp=2), _inst("P", 2)
    _stored(index, a, 1, 6)
    _stored(index, b, 0, 2)
    assert policy.choose([a, b], _ctx(index)) == (a, 1)
    assert policy.decisions["cache_hit"] == 1
    # rank 1 of a gets busy: it costs 2 uncached + 0.25 * (30 queued + 1 request) = 9.75 blocks, b's idle rank
    # 6 uncached, a's idle rank 0 all 8
    assert LOAD_WEIGHT["P"] == 0.25
    policy2, index2 = _policy("P")
    _stored(index2, a, 1, 6)
    _stored(index2, b, 0, 2)
    a.outstanding_tokens[1], a.outstanding_requests[1] = 30 * BS, 1
    assert policy2.choose([a, b], _ctx(index2)) == (b, 0)


def test_a_prefill_leg_is_charged_the_tokens_it_computes_and_a_decode_leg_its_whole_prompt():
    policy, index = _policy("P")
    a, b = _inst("P", 1), _inst("P", 2)
    _stored(index, a, 0, 6)  # 6 of the prompt's 8 blocks
    ctx = _ctx(index)
    assert policy.choose([a, b], ctx) == (a, 0)
    assert policy.charged_tokens(a, 0, ctx, 8 * BS) == 2 * BS  # what a computes, not what it found cached
    assert policy.charged_tokens(a, 0, ctx, 8 * BS) == 8 * BS  # one charge per pick: no stale decision reused
    decode, dindex = _policy("D")
    d = _inst("D", 3)
    _stored(dindex, d, 0, 6)
    dctx = _ctx(dindex)
    assert decode.choose([d], dctx) == (d, 0)
    assert decode.charged_tokens(d, 0, dctx, 8 * BS) == 8 * BS  # it holds the whole prompt's KV while it decodes


def test_the_decode_leg_goes_where_most_of_the_prompt_already_is():
    policy, index = _policy("D")
    d1, d2 = _inst("D", 3), _inst("D", 4)
    _stored(index, d2, 0, 7)
    _stored(index, d1, 0, 3)
    assert policy.choose([d1, d2], _ctx(index)) == (d2, 0)


def test_the_engines_reported_load_counts_when_fresh_and_is_ignored_when_stale():
    clock = Clock()
    policy, index = _policy("P", clock)
    a, b = _inst("P", 1), _inst("P", 2)
    _stored(index, a, 0, 4)
    # another proxy (or traffic around this one) keeps a busy: its engine says so, this proxy saw nothing
    a.reported_load = [ReportedLoad(requests=3, prompt_tokens=40 * BS, at=clock.now - 1.0)]
    assert policy.choose([a, b], _ctx(index))[0] is b
    a.reported_load = [ReportedLoad(requests=3, prompt_tokens=40 * BS, at=clock.now - REPORTED_LOAD_MAX_AGE_S - 1)]
    fresh, index2 = _policy("P", clock)
    _stored(index2, a, 0, 4)
    assert fresh.choose([a, b], _ctx(index2))[0] is a  # stale: only the proxy's own (empty) view
    a.reported_load = []  # nothing read yet (or a DP resize): the same
    assert fresh.choose([a, b], _ctx(index2))[0] is a
    a.reported_load = [None]
    assert fresh.choose([a, b], _ctx(index2))[0] is a


def test_the_proxys_own_count_wins_when_larger_than_a_lagging_report():
    clock = Clock()
    policy, index = _policy("P", clock)
    a, b = _inst("P", 1), _inst("P", 2)
    _stored(index, a, 0, 4)
    a.reported_load = [ReportedLoad(requests=0, prompt_tokens=0, at=clock.now)]  # read before our legs arrived
    a.outstanding_tokens[0], a.outstanding_requests[0] = 30 * BS, 2
    assert policy.choose([a, b], _ctx(index))[0] is b


def test_ties_are_broken_the_same_way_in_every_process_and_spread_over_prompts():
    # the index's chain keys are keyed per process: the tie-break must not use them
    insts = [_inst("P", n, dp=2) for n in (1, 2, 3)]
    prompts = [[p * 1000 + i for i in range(40)] for p in range(24)]
    here = []
    for tokens in prompts:
        policy, index = _policy("P")
        inst, rank = policy.choose(insts, _ctx(index, tokens))
        here.append([inst.base_url, rank])
    code = ("import json, sys\n"
            "from atom_kv.proxy.routing.kv_aware import prompt_tie_hash, tie_weight\n"
            "prompts, slots = json.loads(sys.stdin.read())\n"
            "print(json.dumps([max(slots, key=lambda s: tie_weight(prompt_tie_hash(p), s[0], s[1])) "
            "for p in prompts]))\n")
    slots = [[i.base_url, r] for i in insts for r in range(2)]
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": REPO_ROOT}
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps([prompts, slots]), capture_output=True,
                         text=True, env=env, timeout=60, check=True)
    assert json.loads(out.stdout) == here
    assert len({tuple(x) for x in here}) >= 4  # prompts spread over the ranks, not all to the first


def test_a_pick_is_recorded_so_a_burst_of_siblings_routes_together():
    policy, index = _policy("P")
    insts = [_inst("P", n) for n in (1, 2, 3)]
    first = policy.choose(insts, _ctx(index))
    first[0].outstanding_tokens[0], first[0].outstanding_requests[0] = len(PROMPT), 1  # its leg is in flight
    assert index.longest_prefix(PROMPT) == {(first[0].key, 0): len(PROMPT)}
    for n in range(2):  # before any event, the siblings find the prefix where the first went
        sibling = PROMPT[:6 * BS] + [7, 8, n]
        assert policy.choose(insts, _ctx(index, sibling)) == first


def test_without_token_ids_it_routes_as_cache_aware_and_says_so_once(caplog):
    policy, _ = _policy("D")
    insts = [_inst("D", n) for n in (1, 2)]
    text = "a prompt that only came as text " * 4
    with caplog.at_level(logging.INFO, logger="atom_kv.proxy.routing.kv_aware"):
        picks = [policy.choose(insts, RouteContext(text, len(text) // 4)) for _ in range(3)]
    assert policy.fallbacks == 3 and policy.decisions["fallback"] == 3
    assert len({p[0].key for p in picks}) == 1  # cache_aware's prefix tree kept them together
    assert sum("routing such prompts as cache_aware" in r.getMessage() for r in caplog.records) == 1
    assert policy.fallback.trees  # the fallback's own tree learnt them


def test_make_policy_and_settings_know_kv_aware():
    assert isinstance(make_policy("kv_aware", role="D"), KvAware)
    s = ProxySettings(decode_policy="kv_aware")
    assert s.wants_token_ids and not ProxySettings().wants_token_ids
    assert ProxySettings(local_prefill_max_tokens=64).wants_token_ids
    with pytest.raises(ValueError, match="local_prefill_max_tokens"):
        ProxySettings(local_prefill_max_tokens=-1)


def test_prompt_token_ids_from_the_body_first_then_the_engine():
    assert body_token_ids({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert body_token_ids({"prompt": [[4, 5]]}) == [4, 5]
    assert body_token_ids({"prompt": [[4], [5]]}) is None and body_token_ids({"prompt": "text"}) is None
    assert body_token_ids({"prompt": [1, True]}) is None and body_token_ids({"prompt": [-1]}) is None
    asked, counted = [], []

    async def engine(body, rid, auth):
        asked.append(body)
        return [9, 9]

    ids = PromptTokenIds(engine, count=counted.append)
    assert asyncio.run(ids.of({"prompt": [1, 2]}, "r", None)) == [1, 2] and not asked
    assert asyncio.run(ids.of({"prompt": "hi"}, "r", None)) == [9, 9] and len(asked) == 1
    assert asyncio.run(ids.of({"prompt": ["a", "b"]}, "r", None)) is None and len(asked) == 1  # a batch
    assert counted == ["body", "engine", "none"]


def test_tokenizer_flag_tokenizes_here_with_the_chat_template(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="--tokenizer needs the optional tokenizers package")
    from atom_kv.proxy.routing.hf_tokenizer import HfTokenizer

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "user": 5, ":": 6, "assistant": 7}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %} {{ m['role'] }} : {{ m['content'] }}{% endfor %}" \
               "{% if add_generation_prompt %} assistant :{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "chat_template": template}))
    hf = HfTokenizer(str(tmp_path))
    assert hf.encode_prompt("hello world") == [1, 3, 4]
    assert hf.encode_chat([{"role": "user", "content": "hello"}]) == [1, 5, 6, 3, 7, 6]
    async def engine(body, rid, auth):
        raise AssertionError("the engine is not asked when --tokenizer answers")

    counted = []
    ids = PromptTokenIds(engine, hf, count=counted.append)
    assert asyncio.run(ids.of({"messages": [{"role": "user", "content": "world"}]}, "r", None)) == [1, 5, 6, 4, 7, 6]
    assert counted == ["tokenizer"]
    no_template = tmp_path / "plain"
    no_template.mkdir()
    tok.save(str(no_template / "tokenizer.json"))
    assert HfTokenizer(str(no_template / "tokenizer.json")).encode_chat([{"role": "user", "content": "x"}]) is None


def test_tokenizer_flag_errors_name_the_flag(tmp_path):
    out = subprocess.run([sys.executable, "-m", "atom_kv.proxy", "--port", "0", "--no-discovery",
                          "--tokenizer", str(tmp_path / "missing")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert out.returncode == 2 and "--tokenizer" in out.stderr and "Traceback" not in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "atom_kv.proxy", "--local-prefill-max-tokens", "-3"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert out.returncode == 2 and "--local-prefill-max-tokens" in out.stderr and ">= 0" in out.stderr
