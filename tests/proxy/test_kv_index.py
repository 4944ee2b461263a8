"""The KV index: longest prefix per worker from token content, removals, clears, the skip counters, the
memory caps, predictions; and the compact engine-hash table under it."""

from __future__ import annotations

import pytest

from atom_kv.proxy.kv_events.index import KvIndex
from atom_kv.proxy.kv_events.keys import ChainKeys
from atom_kv.proxy.kv_events.table import MERGE_MIN, EngineHashes
from atom_kv.proxy.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, BlockTransferred

BS = 16
A, B = ("D", "http://a"), ("D", "http://b")
PROMPT = [(i * 37 + 11) % 32000 for i in range(8 * BS)]  # eight blocks


def stored(hashes, tokens, parent=None, **kw):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens), block_size=BS,
                       **kw)


def blocks(first, count, tokens=PROMPT):
    return tokens[first * BS:(first + count) * BS]


@pytest.fixture
def index() -> KvIndex:
    return KvIndex(max_blocks=10_000, max_blocks_per_worker=10_000)


def test_longest_prefix_per_worker_from_token_content(index):
    # A holds blocks 0-3 in two runs (the second chained on the first's last hash); B holds 0-1 under other
    # hashes (another seed): the index keys on content, so both match, each as far as it holds
    index.apply(A, 0, [stored([11, 12], blocks(0, 2))])
    index.apply(A, 0, [stored([13, 14], blocks(2, 2), parent=12)])
    index.apply(B, 1, [stored([(1 << 64) - 1, (1 << 63) + 5], blocks(0, 2))])
    assert index.longest_prefix(PROMPT) == {(A, 0): 4 * BS, (B, 1): 2 * BS}
    assert index.longest_prefix(PROMPT[:3 * BS + 5]) == {(A, 0): 3 * BS, (B, 1): 2 * BS}  # whole blocks only
    other = [t + 1 for t in PROMPT]
    assert index.longest_prefix(other) == {}
    assert index.longest_prefix(PROMPT[:BS] + other[BS:]) == {(A, 0): BS, (B, 1): BS}  # diverges after block 0
    assert index.entries == 6 and index.block_counts() == {(A, 0): 4, (B, 1): 2}
    keys = index.prompt_keys(PROMPT)  # computed once, reused
    assert index.longest_prefix(keys) == index.longest_prefix(PROMPT)


def test_a_block_is_its_whole_prefix_not_its_own_tokens(index):
    # the same 16 tokens after a different first block is a different block
    index.apply(A, 0, [stored([1, 2], blocks(0, 2))])
    shifted = [t + 1 for t in PROMPT[:BS]] + PROMPT[BS:2 * BS]
    assert index.longest_prefix(shifted) == {}


def test_removals_apply_by_engine_hash(index):
    index.apply(A, 0, [stored([1, 2, 3, 4], blocks(0, 4))])
    index.apply(A, 0, [BlockRemoved(block_hashes=[3, 999])])  # an unknown hash is ignored
    assert index.longest_prefix(PROMPT) == {(A, 0): 2 * BS}
    index.apply(A, 0, [BlockRemoved(block_hashes=[1])])
    assert index.longest_prefix(PROMPT) == {}
    assert index.entries == 2  # blocks 1 (hash 2) and 3 (hash 4) are still held, unreachable from the root


def test_all_blocks_cleared_and_its_medium(index):
    index.apply(A, 0, [stored([1, 2], blocks(0, 2))])
    index.apply(A, 1, [stored([1, 2], blocks(0, 2))])
    index.apply(A, 0, [AllBlocksCleared(medium="CPU")])  # ATOM: only the CPU tier, which is not indexed
    assert index.longest_prefix(PROMPT) == {(A, 0): 2 * BS, (A, 1): 2 * BS}
    index.apply(A, 0, [AllBlocksCleared()])
    assert index.longest_prefix(PROMPT) == {(A, 1): 2 * BS}
    assert index.stats.resets["cleared"] == 1 and index.stats.events["AllBlocksCleared"] == 2


def test_only_device_blocks_are_indexed(index):
    index.apply(A, 0, [stored([1], blocks(0, 1), medium="CPU")])
    assert index.longest_prefix(PROMPT) == {} and index.stats.skipped_runs["medium"] == 1
    # ATOM stores received blocks as REMOTE and removes them as GPU
    index.apply(A, 0, [stored([1, 2], blocks(0, 2), medium="REMOTE")])
    index.apply(A, 0, [BlockRemoved(block_hashes=[2], medium="GPU")])
    assert index.longest_prefix(PROMPT) == {(A, 0): BS}
    index.apply(A, 0, [BlockRemoved(block_hashes=[1], medium="CPU")])  # another tier's copy left
    assert index.longest_prefix(PROMPT) == {(A, 0): BS}
    index.apply(A, 0, [BlockTransferred(block_hashes=[1], from_medium="GPU", to_medium="REMOTE")])  # sent: kept
    assert index.longest_prefix(PROMPT) == {(A, 0): BS}
    index.apply(A, 0, [BlockTransferred(block_hashes=[1], from_medium="GPU", to_medium="CPU")])  # swapped out
    assert index.longest_prefix(PROMPT) == {}
    assert index.stats.events["BlockTransferred"] == 2


def test_block_size_mismatch_is_skipped_and_counted(index):
    # 2 hashes but 48 tokens: not 16 a block
    index.apply(A, 0, [BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=PROMPT[:48],
                                   block_size=BS)])
    assert index.stats.skipped_runs["block_size"] == 1 and index.entries == 0
    # consistent, but not the block size this worker reported before
    index.apply(A, 0, [stored([1], blocks(0, 1))])
    index.apply(A, 0, [BlockStored(block_hashes=[5], parent_block_hash=1, token_ids=PROMPT[16:48], block_size=32)])
    assert index.stats.skipped_runs["block_size"] == 2
    assert index.longest_prefix(PROMPT) == {(A, 0): BS}


def test_other_block_sizes_are_keyed_on_their_own_blocks(index):
    index.apply(B, 0, [BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=PROMPT[:64],
                                   block_size=32)])
    index.apply(A, 0, [stored([1], blocks(0, 1))])
    assert index.longest_prefix(PROMPT) == {(B, 0): 64, (A, 0): BS}
    assert index.block_size_of(B, 0) == 32 and index.block_size_of(A, 3) == 16


def test_a_run_whose_parent_is_unknown_is_skipped_and_counted(index):
    index.apply(A, 0, [stored([13, 14], blocks(2, 2), parent=12)])  # the router restarted: 12 was never seen
    assert index.stats.skipped_runs["unknown_parent"] == 1 and index.entries == 0
    index.apply(A, 0, [stored([11, 12], blocks(0, 2))])
    index.apply(A, 0, [stored([13, 14], blocks(2, 2), parent=12)])
    assert index.longest_prefix(PROMPT) == {(A, 0): 4 * BS}


def test_kv_cache_groups_and_adapters(index):
    index.apply(A, 0, [stored([1], blocks(0, 1), group_idx=1)])  # a sliding-window group of a hybrid model
    assert index.stats.skipped_runs["group"] == 1 and index.entries == 0
    index.apply(A, 0, [stored([1], blocks(0, 1), lora_name="sql-adapter")])
    assert index.longest_prefix(PROMPT) == {}  # keyed under its adapter
    assert index.longest_prefix(index.prompt_keys(PROMPT, lora="sql-adapter")) == {(A, 0): BS}
    index.apply(B, 0, [stored([1], blocks(0, 1), extra_keys=[("image", "abc")])])  # multimodal: never a text hit
    assert index.longest_prefix(PROMPT) == {}


def test_a_token_id_that_is_not_a_uint32_is_a_bad_event(index):
    index.apply(A, 0, [BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[-1] * BS, block_size=BS)])
    assert index.entries == 0 and index.stats.decode_failures["event"] == 1
    assert index.longest_prefix([1 << 40] * BS) == {}  # a prompt like that matches nothing, raises nothing


def test_drop_forgets_a_worker_entirely(index):
    index.apply(A, 0, [stored([1, 2], blocks(0, 2))])
    index.apply(A, 1, [stored([1, 2], blocks(0, 2))])
    index.apply(B, 0, [stored([1, 2], blocks(0, 2))])
    index.drop(A)
    assert index.longest_prefix(PROMPT) == {(B, 0): 2 * BS}
    assert index.entries == 2 and index.stats.resets["left"] == 2 and set(index.block_counts()) == {(B, 0)}


def test_the_per_worker_cap_evicts_oldest_first():
    index = KvIndex(max_blocks=10_000, max_blocks_per_worker=64)
    prompts = [[p * 1000 + i for i in range(4 * BS)] for p in range(20)]  # 20 prompts of 4 blocks
    for p, tokens in enumerate(prompts):
        index.apply(A, 0, [stored(range(p * 10, p * 10 + 4), tokens)])
    assert index.entries <= 64 and index.stats.evicted_blocks == 80 - index.entries
    assert index.longest_prefix(prompts[-1]) == {(A, 0): 4 * BS}  # the newest stay
    assert index.longest_prefix(prompts[0]) == {}  # the oldest went


def test_the_total_cap_evicts_from_the_largest_worker():
    index = KvIndex(max_blocks=100, max_blocks_per_worker=1000)
    big = [[p * 1000 + i for i in range(4 * BS)] for p in range(20)]
    for p, tokens in enumerate(big):
        index.apply(A, 0, [stored(range(p * 10, p * 10 + 4), tokens)])
    small = [[7_000_000 + i for i in range(4 * BS)]]
    index.apply(B, 0, [stored(range(4), small[0])])
    for p in range(20, 30):
        index.apply(A, 0, [stored(range(p * 10, p * 10 + 4), [p * 1000 + i for i in range(4 * BS)])])
    assert index.entries <= 100
    assert index.longest_prefix(small[0]) == {(B, 0): 4 * BS}  # the small worker kept its blocks
    assert index.block_counts()[(A, 0)] == index.entries - 4


def test_predictions_count_until_their_ttl():
    now = [100.0]
    index = KvIndex(max_blocks=100, max_blocks_per_worker=100, predict_ttl_s=5.0, clock=lambda: now[0])
    index.record(A, 2, PROMPT[:3 * BS + 4])
    index.apply(B, 0, [stored([1], blocks(0, 1))])
    assert index.longest_prefix(PROMPT) == {(A, 2): 3 * BS, (B, 0): BS}
    assert index.predicted_entries == 3
    now[0] += 4.9
    index.record(A, 2, PROMPT[:BS])  # renewed for block 0 only
    now[0] += 0.2
    assert index.longest_prefix(PROMPT) == {(A, 2): BS, (B, 0): BS}
    now[0] += 5.0
    assert index.longest_prefix(PROMPT) == {(B, 0): BS} and index.predicted_entries == 0
    index.record(A, 2, PROMPT)
    index.forget_predictions(A)
    assert index.longest_prefix(PROMPT) == {(B, 0): BS}


def test_predictions_are_bounded():
    index = KvIndex(max_blocks=100, max_blocks_per_worker=100, predict_max_blocks=10)
    for p in range(10):
        index.record(A, 0, [p * 1000 + i for i in range(4 * BS)])
    assert index.predicted_entries <= 10
    assert index.longest_prefix([9000 + i for i in range(4 * BS)]) == {(A, 0): 4 * BS}  # the newest kept
    assert index.longest_prefix([0 + i for i in range(4 * BS)]) == {}


def test_chain_keys_depend_on_the_seed_and_never_are_zero():
    one, two = ChainKeys(b"one"), ChainKeys(b"two")
    assert one.of_tokens(PROMPT, BS) != two.of_tokens(PROMPT, BS)
    assert one.of_tokens(PROMPT, BS) == ChainKeys(b"one").of_tokens(PROMPT, BS)
    assert len(one.of_tokens(PROMPT[:40], BS)) == 2 and 0 not in one.of_tokens(PROMPT, BS)
    assert one.of_tokens(["x"] * BS, BS) == []


# ---------------------------------------------------------------------- the engine-hash table
def test_engine_hashes_across_merges():
    table = EngineHashes()
    n = 3 * MERGE_MIN + 17
    assert table.put_many(list(range(n)), [k + 1_000_000 for k in range(n)]) == []
    assert len(table) == n and table.get(5) == 1_000_005 and table.get(n - 1) == 1_000_000 + n - 1
    assert table.get(n + 5) is None
    assert sorted(table.pop_many([5, 6, n + 5, 5])) == [1_000_005, 1_000_006]
    assert len(table) == n - 2 and table.get(5) is None
    # stored again with other content: the old chain key is reported once
    assert table.put_many([7], [42]) == [] and table.get(7) == 42
    assert table.put_many([7], [43]) == [42]
    assert sorted(table.pop_many([7])) == [43, 1_000_007]  # the dict's entry and the arrays' older copy
    assert table.get(7) is None


def test_engine_hashes_evict_oldest_first_through_the_arrays_and_the_dict():
    table = EngineHashes()
    n = 2 * MERGE_MIN
    table.put_many(list(range(n)), [k + 1 for k in range(n)])
    table.put_many([0], [1])  # stored again: the newest now; its old copy in the arrays is the oldest
    evicted = table.evict_oldest(10)
    assert sorted(evicted) == list(range(2, 11))  # hashes 1..9: the old copy of 0 went unreported
    assert table.get(0) == 1 and table.get(1) is None and table.get(10) == 11
    rest = table.evict_oldest(10 * n)
    assert sorted(rest) == sorted({k + 1 for k in range(n)} - set(range(2, 11)))  # the dict's 0 last
    assert len(table) == 0 and table.get(0) is None
