"""The prefix cache and its KV events on real reference engine processes (127.0.0.1).

A multi-turn conversation on a colocated engine gives the same greedy text with the cache on
and off, reports ``cached_tokens`` (JSON and the streamed usage chunk) and counts them in
``/metrics``; a SUB hears the prompt's blocks as ``BlockStored``. Through a proxy, a prefill
and a decode engine: turn 2 on the same decode engine reads only the blocks it lacks (its own
counter of blocks read, and its connector's bytes), because the decode engine cached what
it loaded in turn 1.
"""

from __future__ import annotations

import json

import pytest

from atom_kv.reference.kv_events.events import BlockStored
from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.kv_event_reader import KVEventReader
from atom_kv.testing.web import http_json, scrape_metrics
from tests.e2e.helpers import generate, get_json

BLOCK = 16  # the engines' default --block-size
EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
                     "replay_endpoint": "tcp://127.0.0.1:0"})
SYSTEM = "You are a careful assistant of the paged KV cache team; answer in one short line. " * 2
TURNS = ["What is a block?", " And a prefix?", " Say it once more, briefly."]


@pytest.fixture(scope="module")
def colocated_pair(tmp_path_factory):
    c = Cluster([EngineSpec("colocated", num_blocks=96, extra_args=["--kv-events-config", EVENTS]),
                 EngineSpec("colocated", num_blocks=96, extra_args=["--no-enable-prefix-caching"])],
                with_proxy=False, log_dir=str(tmp_path_factory.mktemp("prefix-colocated")))
    c.start()
    try:
        yield c
    finally:
        c.close()


def _tokens(url: str, prompt: str) -> list[int]:
    status, body = http_json("POST", url + "/tokenize", {"prompt": prompt})
    assert status == 200, body
    return body["tokens"]


def _conversation(url: str, *, stream_last: bool = True) -> list[tuple[str, str, dict]]:
    """Each turn's prompt (the earlier turns, their answers and the new line), answer and usage."""
    out, prompt = [], SYSTEM
    for i, turn in enumerate(TURNS):
        prompt += turn
        stream = stream_last and i == len(TURNS) - 1
        extra = {"stream_options": {"include_usage": True}} if stream else None
        res = generate(url, prompt, chat=False, stream=stream, max_tokens=10, extra=extra)
        assert res.status == 200 and res.error is None, res
        out.append((prompt, res.text, res.usage))
        prompt += res.text
    return out


def _metric(url: str, name: str) -> float:
    return scrape_metrics(url + "/metrics").get(f'{name}{{dp_rank="0"}}', 0.0)


def test_a_conversation_equals_the_engine_without_a_cache_and_reports_its_cached_tokens(colocated_pair):
    on, off = colocated_pair.engine_url(0), colocated_pair.engine_url(1)
    before = {n: _metric(on, n) for n in ("atom_kv_prefix_cache_queries_total", "atom_kv_prefix_cache_hits_total")}
    with_cache, without = _conversation(on), _conversation(off)
    assert [t for _, t, _ in with_cache] == [t for _, t, _ in without]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for _, _, u in with_cache]
    assert [u["prompt_tokens_details"]["cached_tokens"] for _, _, u in without] == [0, 0, 0]
    assert cached[0] == 0 and all(n > 0 and n % BLOCK == 0 for n in cached[1:]), cached  # the last is streamed
    # turn 2 found at least turn 1's whole blocks (its prompt, and its answer's KV but the last token's)
    prompt1, answer1, _ = with_cache[0]
    assert cached[1] >= (len(_tokens(on, prompt1 + answer1)) - 1) // BLOCK * BLOCK
    prompts = [u["prompt_tokens"] for _, _, u in with_cache]
    assert _metric(on, "atom_kv_prefix_cache_queries_total") - before["atom_kv_prefix_cache_queries_total"] == sum(
        prompts)
    assert _metric(on, "atom_kv_prefix_cache_hits_total") - before["atom_kv_prefix_cache_hits_total"] == sum(cached)
    assert _metric(off, "atom_kv_prefix_cache_hits_total") == 0


def test_the_engine_publishes_the_blocks_of_a_prompt_it_computed(colocated_pair):
    url = colocated_pair.engine_url(0)
    status, health = get_json(url + "/health")
    where = health["dp_ranks"][0]["kv_events"]
    assert status == 200 and where["endpoint"].startswith("tcp://127.0.0.1:")
    reader = KVEventReader(where["endpoint"], where["replay_endpoint"])
    try:
        prompt = "A prompt nobody sent before, long enough for three blocks of sixteen tokens each."
        assert generate(url, prompt, chat=False, stream=False, max_tokens=2).error is None
        tokens = _tokens(url, prompt)
        full = tokens[: len(tokens) // BLOCK * BLOCK]
        stored = reader.events_until(lambda seen: any(isinstance(x, BlockStored) and x.token_ids == full
                                                      for x in seen))
        (mine,) = [x for x in stored if isinstance(x, BlockStored) and x.token_ids == full]
        assert mine.parent_block_hash is None and len(mine.block_hashes) == len(full) // BLOCK
        assert _metric(url, "atom_kv_kv_events_batches_dropped_total") == 0
    finally:
        reader.close()


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    c = Cluster([EngineSpec("P", num_blocks=128),
                 EngineSpec("D", num_blocks=128, extra_args=["--kv-events-config", EVENTS])],
                log_dir=str(tmp_path_factory.mktemp("prefix-pd")))
    c.start()
    try:
        yield c
    finally:
        c.close()


def _decode_counters(url: str) -> tuple[float, float, float]:
    m = scrape_metrics(url + "/metrics")
    return (m.get('atom_kv_kv_load_blocks_total{dp_rank="0"}', 0.0), m.get("atom_kv_transfer_bytes", 0.0),
            m.get('atom_kv_prefix_cache_hits_total{dp_rank="0"}', 0.0))


def test_turn_two_on_the_same_decode_engine_reads_only_the_blocks_it_lacks(pd, colocated_pair):
    d = pd.engine_url(pd.index_of("D"))
    where = get_json(d + "/health")[1]["dp_ranks"][0]["kv_events"]
    reader = KVEventReader(where["endpoint"], where["replay_endpoint"])
    try:
        reference = _conversation(colocated_pair.engine_url(1), stream_last=False)  # no cache at all
        seen, prompt = [], SYSTEM
        for i, turn in enumerate(TURNS[:2]):
            prompt += turn
            before = _decode_counters(d)
            res = generate(pd.proxy_url, prompt, chat=False, stream=False, max_tokens=10)
            assert res.status == 200 and res.error is None, res
            after = _decode_counters(d)
            assert res.text == reference[i][1]
            n_blocks = -(-len(_tokens(d, prompt)) // BLOCK)
            blocks, nbytes, hits = (a - b for a, b in zip(after, before))
            seen.append((n_blocks, blocks, nbytes, hits, res.usage["prompt_tokens_details"]["cached_tokens"]))
            prompt += res.text
        (n1, blocks1, bytes1, hits1, cached1), (n2, blocks2, bytes2, hits2, cached2) = seen
        assert (blocks1, hits1, cached1) == (n1, 0, 0) and bytes1 > 0  # turn 1: every block came from P
        per_block = bytes1 / blocks1
        assert hits2 == cached2 >= len(_tokens(d, SYSTEM + TURNS[0])) // BLOCK * BLOCK > 0
        assert blocks2 == n2 - hits2 // BLOCK < n2  # turn 2: only what the decode engine lacked
        assert bytes2 == blocks2 * per_block
        # the decode engine announced the blocks it loaded in turn 1 as stored
        turn1 = _tokens(d, SYSTEM + TURNS[0])
        reader.events_until(lambda ev: any(isinstance(x, BlockStored) and x.parent_block_hash is None
                                           and x.token_ids[:BLOCK] == turn1[:BLOCK] for x in ev))
    finally:
        reader.close()
