"""kv_aware routing on real reference engines (2 prefill + 2 decode, KV events on) behind three proxies:
A and B (``--policy kv_aware``, replicas over the same engines) and C (the same plus
``--local-prefill-max-tokens``); a colocated engine without a prefix cache gives the reference text.

- A conversation's turn 1 goes through A, turn 2 through B, which never saw turn 1 and knows it only from
  the engines' events: turn 2 lands on the prefill and the decode that hold turn 1, and the decode reads
  only the blocks it lacks. Turn 1 is shorter than the tie-break's leading tokens, so turn 2's tie-break is
  its own: only the index sends it back (two conversations, so a lucky tie-break cannot pass for it).
- Through C, a short turn 3 the decode already holds all but a few tokens of makes no prefill leg at all.
- The same fresh turn through A and B goes to the same prefill and decode.
Texts equal the colocated engine's.
"""

from __future__ import annotations

import json
import re

import pytest

from atom_kv.proxy.routing.kv_aware import TIE_TOKENS
from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json, scrape_metrics
from tests.e2e.helpers import generate

BLOCK = 16  # the engines' default --block-size
LOCAL_MAX = 32
EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
                     "replay_endpoint": "tcp://127.0.0.1:0"})
# (turn 1 under TIE_TOKENS tokens, turn 2 long, turn 3 a few characters)
CONVERSATIONS = [
    ("Q: what does a paged KV cache keep, in short words?",
     " Now say how a prefix of blocks is found again by its chain of token keys.", " Ok?"),
    ("Tell me, briefly, why decode engines read remote KV.",
     " And what does the proxy do when a decode engine already holds most of it?", " Why?"),
]
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    ev = ["--kv-events-config", EVENTS]
    c = Cluster([EngineSpec("P", num_blocks=128, extra_args=ev), EngineSpec("P", num_blocks=128, extra_args=ev),
                 EngineSpec("D", num_blocks=128, extra_args=ev), EngineSpec("D", num_blocks=128, extra_args=ev),
                 EngineSpec("colocated", num_blocks=128, extra_args=["--no-enable-prefix-caching"])],
                proxy_args=["--policy", "kv_aware"],
                extra_proxies=[["--policy", "kv_aware"],
                               ["--policy", "kv_aware", "--local-prefill-max-tokens", str(LOCAL_MAX)]],
                log_dir=str(tmp_path_factory.mktemp("kv-routing")))
    c.start()
    try:
        yield c
    finally:
        c.close()


def _proxies(c: Cluster) -> tuple[str, str, str]:
    a, (b, local) = c.proxy_url, c.extra_proxy_urls
    return a, b, local


def _tokens(url: str, prompt: str) -> list[int]:
    status, body = http_json("POST", url + "/tokenize", {"prompt": prompt})
    assert status == 200, body
    return body["tokens"]


def _routes(proxy: str) -> dict[tuple[str, str, int], float]:
    out = {}
    for key, value in scrape_metrics(proxy + "/metrics").items():
        if key.startswith("atom_kv_proxy_dp_rank_requests_total{"):
            labels = dict(_LABEL.findall(key))
            out[(labels["role"], labels["instance"], int(labels["dp_rank"]))] = value
    return out


def _send(proxy: str, prompt: str) -> tuple[str, dict[str, str]]:
    """One request through ``proxy``: its text and the instance each leg went to."""
    before = _routes(proxy)
    res = generate(proxy, prompt, chat=False, stream=False, max_tokens=10)
    assert res.status == 200 and res.error is None, res
    after = _routes(proxy)
    legs = {role: inst for (role, inst, _), n in after.items() if n - before.get((role, inst, 0), 0.0) >= 1}
    return res.text, legs


def _engine_counter(url: str, name: str) -> float:
    return scrape_metrics(url + "/metrics").get(f'{name}{{dp_rank="0"}}', 0.0)


def _indexed(proxy: str, role: str, instance: str) -> float:
    for key, value in scrape_metrics(proxy + "/metrics").items():
        if key.startswith("atom_kv_proxy_kv_indexed_blocks{") and dict(_LABEL.findall(key)) == {
                "role": role, "instance": instance, "dp_rank": "0"}:
            return value
    return 0.0


def _wait_indexed(proxy: str, role: str, instance: str, blocks: int) -> None:
    """Until ``proxy``'s index holds at least ``blocks`` blocks of ``instance`` (its engine's events came)."""
    wait_until(lambda: _indexed(proxy, role, instance) >= blocks, 20.0,
               what=f"{blocks} blocks of {instance} in {proxy}'s KV index")


def _reference(c: Cluster, prompt: str) -> str:
    res = generate(c.engine_url(c.index_of("colocated")), prompt, chat=False, stream=False, max_tokens=10)
    assert res.status == 200 and res.error is None, res
    return res.text


@pytest.fixture(scope="module")
def turns(fleet):
    """Each conversation's turns 1 (through A) and 2 (through B): prompts, texts, routes, decode counters."""
    a, b, _ = _proxies(fleet)
    d_url = {fleet.engine_url(i): i for i in (fleet.index_of("D", 0), fleet.index_of("D", 1))}
    out = []
    for first, second, _ in CONVERSATIONS:
        p1 = first
        assert len(_tokens(fleet.engine_url(0), p1)) < TIE_TOKENS
        text1, legs1 = _send(a, p1)
        p2 = p1 + text1 + second
        held_d = (len(_tokens(fleet.engine_url(0), p1 + text1)) - 1) // BLOCK  # its answer's KV but the last token
        _wait_indexed(b, "prefill", legs1["prefill"], len(_tokens(fleet.engine_url(0), p1)) // BLOCK)
        _wait_indexed(b, "decode", legs1["decode"], held_d)
        d = legs1["decode"]
        before = [_engine_counter(d, n) for n in ("atom_kv_kv_load_blocks_total", "atom_kv_prefix_cache_hits_total")]
        text2, legs2 = _send(b, p2)
        after = [_engine_counter(d, n) for n in ("atom_kv_kv_load_blocks_total", "atom_kv_prefix_cache_hits_total")]
        assert d in d_url
        out.append({"p1": p1, "text1": text1, "legs1": legs1, "p2": p2, "text2": text2, "legs2": legs2,
                    "loaded": after[0] - before[0], "hits": after[1] - before[1], "held_d": held_d})
    return out


def test_turn_two_goes_to_the_prefill_and_decode_holding_turn_one_and_reads_only_what_the_decode_lacks(fleet, turns):
    for t in turns:
        assert t["legs2"] == t["legs1"], t  # B knew turn 1 only from the engines' events
        n2 = -(-len(_tokens(fleet.engine_url(0), t["p2"])) // BLOCK)
        assert t["hits"] >= t["held_d"] * BLOCK > 0, t  # the decode found turn 1 (and its answer) in its cache
        assert t["loaded"] == n2 - t["hits"] // BLOCK < n2, t  # and read only the blocks it lacked
        assert t["text1"] == _reference(fleet, t["p1"]) and t["text2"] == _reference(fleet, t["p2"])


def test_a_short_turn_three_with_local_prefill_makes_no_prefill_leg(fleet, turns):
    _, _, local = _proxies(fleet)
    prefills = [fleet.engine_url(fleet.index_of("P", n)) for n in range(2)]
    for t, (_, _, third) in zip(turns, CONVERSATIONS):
        p3 = t["p2"] + t["text2"] + third
        d = t["legs2"]["decode"]
        _wait_indexed(local, "decode", d, (len(_tokens(d, t["p2"] + t["text2"])) - 1) // BLOCK)
        assert len(_tokens(d, p3)) - (len(_tokens(d, t["p2"] + t["text2"])) - 1) // BLOCK * BLOCK <= LOCAL_MAX
        queried = [_engine_counter(u, "atom_kv_prefix_cache_queries_total") for u in prefills]
        local_before = scrape_metrics(local + "/metrics").get("atom_kv_proxy_local_prefills_total", 0.0)
        hits_before = _engine_counter(d, "atom_kv_prefix_cache_hits_total")
        text3, legs3 = _send(local, p3)
        assert legs3 == {"decode": d}  # no prefill leg was routed at all
        assert [_engine_counter(u, "atom_kv_prefix_cache_queries_total") for u in prefills] == queried
        assert scrape_metrics(local + "/metrics").get("atom_kv_proxy_local_prefills_total", 0.0) == local_before + 1
        assert _engine_counter(d, "atom_kv_prefix_cache_hits_total") > hits_before  # it computed only the rest
        assert text3 == _reference(fleet, p3)


def test_two_proxy_replicas_route_the_same_turn_to_the_same_instances(fleet, turns):
    a, b, _ = _proxies(fleet)
    for n in range(3):
        prompt = f"Fresh question number {n}: " + "which engine should serve a prompt nobody has sent yet? " * 2
        text_a, legs_a = _send(a, prompt)
        text_b, legs_b = _send(b, prompt)
        assert legs_a == legs_b and set(legs_a) == {"prefill", "decode"}, (legs_a, legs_b)
        assert text_a == text_b == _reference(fleet, prompt)
