"""The reference engine's prefix cache: chained block keys, reference counts, LRU eviction only
under pressure, lent blocks never evicted, only the uncached suffix computed, the decode side
caching what it loaded and telling the connector what it holds, and outputs equal with it off."""

from __future__ import annotations

import queue

import pytest

from atom_kv import engine_hooks
from atom_kv.config import KVTransferConfig
from atom_kv.engine_hooks import KVConnectorOutput
from atom_kv.reference.block_hash import BlockHasher
from atom_kv.reference.block_manager import BlockManager, BlockState
from atom_kv.reference.engine import EngineArgs, EngineCore
from atom_kv.reference.kv_events.events import BlockRemoved, BlockStored
from atom_kv.reference.request import Request
from atom_kv.reference.scheduler import Scheduler

BS = 4


def _keys(tokens, seed=b"s" * 32):
    return BlockHasher(BS, seed).extend([], tokens)


def _sched(num_blocks=16, hooks=None, caching=True, events=False):
    return Scheduler(num_blocks=num_blocks, block_size=BS, max_num_seqs=8, max_model_len=1024,
                     max_num_batched_tokens=4096, hooks=hooks, enable_prefix_caching=caching, record_events=events)


def _req(rid, prompt, max_tokens=2, params=None):
    return Request(request_id=rid, prompt_ids=list(prompt), max_tokens=max_tokens, kv_transfer_params=params)


def _step(s, token=65):
    out = s.schedule()
    return out, s.update_from_output({c.request_id: token for c in out.chunks}, 0.0)


def _finish(s, token=65, limit=50):
    done = []
    for _ in range(limit):
        out, outs = _step(s, token)
        done += [o for o in outs if o.finished]
        if not out.chunks:
            return done
    raise AssertionError("requests did not finish")


# ---------------------------------------------------------------------- keys
def test_keys_chain_over_every_token_before_them_and_depend_on_the_seed():
    a = _keys([1, 2, 3, 4, 5, 6, 7, 8])
    b = _keys([9, 2, 3, 4, 5, 6, 7, 8])  # same second block, different first
    assert len(a) == 2 and a[0] != b[0] and a[1].digest != b[1].digest
    assert _keys([1, 2, 3, 4, 5, 6, 7, 8, 9]) == a  # the partial block has no key
    assert [k.digest for k in _keys([1, 2, 3, 4], seed=b"t" * 32)] != [a[0].digest]
    assert all(0 <= k.external < 2**64 for k in a) and a[1].token_ids == (5, 6, 7, 8)


# ---------------------------------------------------------------------- block manager
def test_shared_blocks_are_counted_and_cached_once_nobody_holds_them():
    bm = BlockManager(8, BS)
    keys = _keys(range(8))
    first = bm.allocate(3)
    assert bm.cache(first, keys, 0) == 2
    hit = bm.match(keys)
    assert hit == first[:2]
    second = bm.allocate(1, hit)
    assert second[:2] == hit and [bm.ref_count(b) for b in hit] == [2, 2]
    bm.free(first)
    assert [bm.state(b) for b in hit] == [BlockState.USED] * 2 and bm.state(first[2]) is BlockState.FREE
    bm.free(second)
    assert [bm.state(b) for b in hit] == [BlockState.CACHED] * 2
    assert bm.num_free == 8 and bm.num_cached == 2 and bm.match(keys) == hit
    with pytest.raises(ValueError):
        bm.free(hit[:1])  # nobody holds it: a double free


def test_cached_blocks_are_evicted_only_when_an_allocation_needs_them_tail_first_least_recent_first():
    bm = BlockManager(6, BS, record_events=True)
    old, new = _keys(range(100, 108)), _keys(range(200, 212))
    a = bm.allocate(2)
    bm.cache(a, old, 0)
    bm.free(a)
    b = bm.allocate(3)
    bm.cache(b, new, 0)
    bm.free(b)
    stored = bm.take_events()
    assert [type(e) for e in stored] == [BlockStored, BlockStored]
    assert bm.num_free == 6 and bm.num_cached == 5
    bm.allocate(1)  # the one free block: nothing evicted
    assert bm.num_cached == 5 and bm.take_events() == []
    bm.allocate(2)  # the least recently freed chain goes, its tail first
    (removed,) = bm.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [old[1].external, old[0].external]
    assert bm.match(old) == [] and len(bm.match(new)) == 3 and bm.evicted == 2


def test_a_block_already_cached_elsewhere_stays_uncached():
    bm = BlockManager(8, BS, record_events=True)
    keys = _keys(range(8))
    a, b = bm.allocate(2), bm.allocate(2)  # two requests computed the same prompt at once
    assert bm.cache(a, keys, 0) == 2 and bm.cache(b, keys, 0) == 0
    assert len(bm.take_events()) == 1
    bm.free(b)
    assert [bm.state(x) for x in b] == [BlockState.FREE] * 2 and bm.match(keys) == a


def test_block_stored_carries_its_run_its_parent_and_its_tokens():
    bm = BlockManager(8, BS, record_events=True)
    keys = _keys(range(12))
    blocks = bm.allocate(3)
    bm.cache(blocks, keys[:1], 0)
    bm.cache(blocks, keys, 1)
    first, rest = bm.take_events()
    assert first.parent_block_hash is None and first.token_ids == [0, 1, 2, 3]
    assert rest.block_hashes == [keys[1].external, keys[2].external]
    assert rest.parent_block_hash == keys[0].external and rest.token_ids == list(range(4, 12))
    assert rest.block_size == BS and rest.medium == "GPU"


# ---------------------------------------------------------------------- scheduler
def test_a_repeated_prompt_computes_only_its_uncached_suffix_and_counts_tokens():
    s = _sched()
    prompt = list(range(1, 12))  # 2 full blocks and 3 tokens
    s.add(_req("a", prompt))
    _finish(s)
    s.add(_req("b", prompt))
    chunk = s.schedule().chunks[0]
    assert (chunk.start_pos, chunk.token_ids) == (8, prompt[8:])
    (out,) = s.update_from_output({"b": 65}, 0.0)
    assert out.num_cached_tokens == 8
    assert (s.stats.queries, s.stats.hits) == (22, 8)


def test_a_prompt_of_whole_cached_blocks_still_computes_its_last_block():
    s = _sched()
    prompt = list(range(1, 9))  # exactly 2 blocks
    s.add(_req("a", prompt))
    _finish(s)
    s.add(_req("b", prompt))
    chunk = s.schedule().chunks[0]
    assert (chunk.start_pos, chunk.token_ids) == (4, prompt[4:])  # logits need a computed token


def test_blocks_filled_by_output_tokens_are_cached_for_the_next_turn():
    s = _sched()
    prompt = list(range(1, 7))
    s.add(_req("a", prompt, max_tokens=5))
    _finish(s, token=70)
    # turn 2: the prompt, the answer (the last token's KV was never computed), more
    s.add(_req("b", prompt + [70] * 5 + [9, 9, 9]))
    chunk = s.schedule().chunks[0]
    assert chunk.start_pos == 8  # tokens 0..7 (prompt + 2 output tokens) were computed and cached


def test_with_caching_off_nothing_is_reused():
    s = _sched(caching=False)
    s.add(_req("a", range(1, 12)))
    _finish(s)
    s.add(_req("b", range(1, 12)))
    assert s.schedule().chunks[0].start_pos == 0 and s.blocks.num_cached == 0 and s.stats.hits == 0


def test_cached_blocks_make_room_for_a_request_and_lent_blocks_never_do():
    cfg = KVTransferConfig(kv_role="kv_producer", abort_timeout_s=30.0)
    hooks = engine_hooks.build_scheduler_hooks(cfg, engine_id="p", host="127.0.0.1", tp_size=1, block_size=BS)
    try:
        s = _sched(num_blocks=6, hooks=hooks)
        s.add(_req("lent", range(1, 9), max_tokens=1, params={"do_remote_decode": True}))
        _finish(s)
        held = s.held["lent"]
        assert len(held) == 2 and all(s.blocks.state(b) is BlockState.USED for b in held)
        s.add(_req("free", range(20, 28), max_tokens=1))
        _finish(s)
        assert s.blocks.num_cached == 4 and s.blocks.num_free == 4
        # 4 blocks: the two cached ones of "free" are evicted, the lent ones are not touched
        s.add(_req("big", range(40, 52), max_tokens=4))
        _step(s)
        assert not set(held) & set(s.running["big"].block_ids)
        assert all(s.blocks.state(b) is BlockState.USED for b in held) and s.blocks.evicted == 2
        s.add(_req("more", range(60, 64), max_tokens=1))
        out, _ = _step(s)
        assert [c.request_id for c in out.chunks] == ["big"]  # "more" waits: no block to take
        assert [r.request_id for r in s.waiting] == ["more"]
    finally:
        hooks.close()


def _consumer_hooks(**extra):
    cfg = KVTransferConfig(kv_role="kv_consumer", abort_timeout_s=5.0, **extra)
    return engine_hooks.build_scheduler_hooks(cfg, engine_id="d", host="127.0.0.1", tp_size=1, block_size=BS)


def _params(n_blocks, tid):
    return {"do_remote_prefill": True, "remote_block_ids": list(range(100, 100 + n_blocks)),
            "remote_engine_id": "p", "remote_host": "127.0.0.1", "remote_port": 7000, "transfer_id": tid,
            "remote_tp_size": 1}


def test_a_decode_engine_caches_what_it_loaded_and_reads_only_the_blocks_it_lacks_next_turn():
    hooks = _consumer_hooks()
    try:
        s = _sched(hooks=hooks, events=True)
        turn1 = list(range(1, 11))  # 2 full blocks + 2
        s.add(_req("t1", turn1, max_tokens=1, params=_params(3, "p-1")))
        s.schedule()
        (load,) = hooks.build_connector_meta().loads
        assert load.remote_block_ids == [100, 101, 102] and len(load.block_ids) == 3
        s.apply_events(hooks.update_connector_output(KVConnectorOutput(finished_recving=["t1"])))
        (stored,) = s.blocks.take_events()  # the loaded full blocks entered the cache
        assert isinstance(stored, BlockStored) and stored.token_ids == turn1[:8]
        assert s.stats.loaded_blocks == 3
        _finish(s)
        turn2 = turn1 + [65, 7, 7, 7, 7, 7]  # 16 tokens: 4 blocks
        s.add(_req("t2", turn2, max_tokens=1, params=_params(4, "p-2")))
        s.schedule()
        (load,) = hooks.build_connector_meta().loads
        # turn 1's two full blocks are here: only the last two are read
        assert load.remote_block_ids == [102, 103] and load.remote_block_offset == 2
        assert load.block_ids == s.waiting_remote["t2"].block_ids[2:4]
        assert s.waiting_remote["t2"].block_ids[:2] == s.blocks.match(s.waiting_remote["t2"].block_keys[:2])
        s.apply_events(hooks.update_connector_output(KVConnectorOutput(finished_recving=["t2"])))
        assert s.stats.loaded_blocks == 3 + 2
        chunk = s.schedule().chunks[0]
        assert (chunk.start_pos, chunk.token_ids) == (15, [7])  # only the last prompt token for the logits
        (out,) = s.update_from_output({"t2": 66}, 0.0)
        assert out.num_cached_tokens == 8
    finally:
        hooks.close()


def test_a_failed_load_recomputes_only_past_the_cached_prefix():
    hooks = _consumer_hooks(load_failure_policy="recompute")
    try:
        s = _sched(hooks=hooks)
        prompt = list(range(1, 11))
        s.add(_req("local", prompt, max_tokens=1))
        _finish(s)
        s.add(_req("d", prompt + [3, 3, 3, 3], max_tokens=1, params=_params(4, "p-3")))
        s.schedule()
        hooks.build_connector_meta()
        events = hooks.update_connector_output(KVConnectorOutput(failed_recving={"d": "peer gone"}))
        assert events.recompute == ["d"]
        s.apply_events(events)
        chunk = s.schedule().chunks[0]
        assert (chunk.start_pos, len(chunk.token_ids)) == (8, 6)
    finally:
        hooks.close()


# ---------------------------------------------------------------------- the engine
class _Collector:
    def __init__(self):
        self.q: "queue.Queue" = queue.Queue()

    def __call__(self, out):
        self.q.put(out)

    def run(self, engine, req, timeout=30):
        engine.submit(req)
        tokens = []
        while True:
            out = self.q.get(timeout=timeout)
            assert out.error is None, out.error
            tokens += out.new_token_ids
            if out.finished:
                return tokens, out


def test_greedy_outputs_with_the_cache_on_equal_outputs_with_it_off():
    system = [256] + [(i * 37) % 200 + 30 for i in range(45)]
    turns = [system + [(i * 11 + j) % 90 + 32 for j in range(3 + 4 * i)] for i in range(4)]
    results = {}
    for caching in (True, False):
        c = _Collector()
        e = EngineCore(EngineArgs(num_layers=2, num_blocks=64, block_size=BS, enable_prefix_caching=caching), None, c)
        e.start()
        try:
            texts, cached, history = [], [], []
            for i, prompt in enumerate(turns):
                prompt = history + prompt if i % 2 else prompt  # odd turns extend the previous answer too
                tokens, out = c.run(e, Request(request_id=f"r{i}", prompt_ids=prompt, max_tokens=7))
                history = prompt + tokens
                texts.append(tokens)
                cached.append(out.num_cached_tokens)
            results[caching] = (texts, cached, e.counters["prompt_tokens"], e.scheduler.stats.hits)
        finally:
            e.close()
    (on, on_cached, on_computed, hits), (off, off_cached, off_computed, off_hits) = results[True], results[False]
    assert on == off
    assert on_cached[0] == 0 and all(n >= 44 for n in on_cached[1:]) and off_cached == [0] * 4
    assert on_computed == off_computed - hits and off_hits == 0


def test_a_decode_engine_with_a_cached_prefix_still_continues_from_the_prefills_token():
    hooks = _consumer_hooks()
    try:
        s = _sched(hooks=hooks)
        prompt = list(range(1, 11))
        s.add(_req("local", prompt, max_tokens=1))
        _finish(s)
        s.add(_req("d", prompt + [3, 3], max_tokens=3, params={**_params(3, "p-4"), "first_token_ids": [70]}))
        s.schedule()
        hooks.build_connector_meta()
        (first,) = s.apply_events(hooks.update_connector_output(KVConnectorOutput(finished_recving=["d"])))
        assert first.new_token_ids == [70] and first.num_cached_tokens == 8
        chunk = s.schedule().chunks[0]
        assert (chunk.start_pos, chunk.token_ids) == (12, [70])  # nothing of the prompt is computed again
    finally:
        hooks.close()
