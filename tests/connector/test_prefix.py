"""A consumer with a local prefix-cache hit reads only the blocks it lacks,
over real tcp reads between two in-process engines; its cached blocks are
never written. A hit on the whole prompt reads nothing and lets the
producer free its blocks at once (not after abort_timeout_s)."""

from __future__ import annotations

import torch

from tests.conftest import free_port
from tests.connector.engines import run_until
from tests.connector.inproc import NB, consumer_engine, producer_engine
from tests.connector.kvutil import BLOCK, check_blocks

SENTINEL = 12345.0


def _fill(caches, blocks: list[int], value: float) -> None:
    idx = torch.tensor(blocks, dtype=torch.long)
    for k, v in caches:
        k[idx] = value
        v[idx] = value


def _hold(caches, blocks: list[int], value: float) -> bool:
    idx = torch.tensor(blocks, dtype=torch.long)
    return all(bool((t[idx] == value).all()) for pair in caches for t in pair)


def test_prefix_hit_reads_only_the_uncached_blocks_and_leaves_the_cached_ones():
    port = free_port()
    P, pw, _ = producer_engine(port)
    D, dw, dcache = consumer_engine(port)
    try:
        P.pool.alloc("offset", 3)  # producer and consumer block ids differ
        tokens, cached_blocks = 5 * BLOCK + 3, 3
        params = P.prefill("r1", tokens)
        # the engine allocates all prompt blocks; the first three hold its own cached prefix
        blocks = D.pool.free_ids[-1:-7:-1]
        _fill(dcache, blocks[:cached_blocks], SENTINEL)
        assert D.admit("d1", tokens, params, num_computed=cached_blocks * BLOCK) == blocks
        run_until([P, D], lambda: "d1" in D.ready and "r1" in P.freed, timeout_s=10)
        assert D.failed == {}
        pairs = list(zip(blocks, params["remote_block_ids"]))
        assert check_blocks(dcache, pairs[cached_blocks:], 0, 1, NB) == ""  # the rest arrived
        assert _hold(dcache, blocks[:cached_blocks], SENTINEL)  # the cached prefix was not overwritten
        assert dw.stats()["bytes"] == 3 * 2 * 2 * dcache[0][0][0].numel() * 4  # 3 blocks x K,V x 2 layers
    finally:
        pw.close()
        dw.close()


def test_whole_prompt_cached_reads_nothing_and_releases_the_producer_at_once():
    port = free_port()
    P, pw, _ = producer_engine(port)  # abort_timeout_s is 30 s: a lease expiry would not come in time
    D, dw, dcache = consumer_engine(port)
    try:
        tokens = 2 * BLOCK
        params = P.prefill("r1", tokens)
        blocks = D.admit("d1", tokens, params, num_computed=tokens)
        _fill(dcache, blocks, SENTINEL)
        run_until([P, D], lambda: "r1" in P.freed, timeout_s=10)
        assert D.ready == [] and D.failed == {}  # no load was started
        assert dw.stats()["transfers"] == 0 and dw.num_loading() == 0
        assert _hold(dcache, blocks, SENTINEL)
        assert pw.stats()["releases_received"] == 1 and pw.stats()["done_received"] == 0
        D.finish("d1")
        assert D.pool.held == {} and not D.sched.has_pending()
    finally:
        pw.close()
        dw.close()
