"""The model's paged attention against a dense reference, and TP=2 against TP=1."""

import math
import multiprocessing as mp

import pytest
import torch

from atom_kv.reference.kv_cache import PagedKVCache
from atom_kv.reference.model import ModelConfig, SeqChunk, TinyLlama

CFG = ModelConfig(num_layers=2, seed=3)


def _cache(num_blocks=32, kv_heads=2, block_size=4):
    return PagedKVCache(num_layers=CFG.num_layers, num_blocks=num_blocks, kv_heads=kv_heads,
                        block_size=block_size, head_dim=CFG.head_dim)


def _dense_forward(model: TinyLlama, tokens: list[int]) -> torch.Tensor:
    """Plain causal transformer over the whole sequence (no cache), last-token logits."""
    w, cfg = model.w, model.cfg
    n, d = len(tokens), cfg.head_dim
    pos = torch.arange(n)
    x = w["embed"][torch.tensor(tokens)]
    for layer in range(cfg.num_layers):
        p = f"l{layer}."
        h = model._rms(x, w[p + "attn_norm"])
        q = model._rope((h @ w[p + "wq"].T).view(n, cfg.num_heads, d), pos)
        k = model._rope((h @ w[p + "wk"].T).view(n, cfg.num_kv_heads, d), pos)
        v = (h @ w[p + "wv"].T).view(n, cfg.num_kv_heads, d)
        g = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).reshape(n, -1)
        x = x + attn @ w[p + "wo"].T
        h = model._rms(x, w[p + "mlp_norm"])
        x = x + (torch.nn.functional.silu(h @ w[p + "w_gate"].T) * (h @ w[p + "w_up"].T)) @ w[p + "w_down"].T
    return model._rms(x[-1:], w["final_norm"]) @ w["lm_head"].T


def test_paged_attention_matches_dense_attention():
    model = TinyLlama(CFG)
    tokens = [(i * 37 + 11) % 256 for i in range(23)]
    cache = _cache()
    blocks = [7, 2, 19, 4, 11, 30]  # scattered, non-contiguous
    paged = model.forward([SeqChunk(tokens, 0, blocks)], cache)
    dense = _dense_forward(model, tokens)
    torch.testing.assert_close(paged, dense, rtol=1e-4, atol=1e-4)


def test_incremental_decode_matches_full_prefill():
    """Prefill n-1 tokens then one token over the cache == prefill of all n tokens."""
    model = TinyLlama(CFG)
    tokens = [(i * 13 + 5) % 256 for i in range(18)]
    c1, c2 = _cache(), _cache()
    full = model.forward([SeqChunk(tokens, 0, [0, 1, 2, 3, 4])], c1)
    model.forward([SeqChunk(tokens[:-1], 0, [5, 6, 7, 8, 9])], c2)
    step = model.forward([SeqChunk(tokens[-1:], len(tokens) - 1, [5, 6, 7, 8, 9])], c2)
    torch.testing.assert_close(full, step, rtol=1e-4, atol=1e-4)


def test_batched_sequences_match_separate_runs():
    model = TinyLlama(CFG)
    a = [(i * 3) % 256 for i in range(9)]
    b = [(i * 7 + 1) % 256 for i in range(14)]
    batched = model.forward([SeqChunk(a, 0, [0, 1, 2]), SeqChunk(b, 0, [3, 4, 5, 6])], _cache())
    sep_a = model.forward([SeqChunk(a, 0, [0, 1, 2])], _cache())
    sep_b = model.forward([SeqChunk(b, 0, [3, 4, 5, 6])], _cache())
    torch.testing.assert_close(batched, torch.cat([sep_a, sep_b]), rtol=1e-4, atol=1e-4)


def test_weights_are_deterministic_per_seed():
    a, b = TinyLlama(CFG), TinyLlama(CFG)
    c = TinyLlama(ModelConfig(num_layers=2, seed=4))
    assert torch.equal(a.w["l0.wq"], b.w["l0.wq"])
    assert not torch.equal(a.w["l0.wq"], c.w["l0.wq"])


def _tp_rank(rank: int, ports: "mp.Queue", tokens: list[int], out: "mp.Queue") -> None:
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    if rank == 0:  # the rendezvous store takes a port from the OS and tells rank 1
        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timeout, wait_for_workers=False)
        ports.put(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", ports.get(timeout=60), 2, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    model = TinyLlama(CFG, tp_rank=rank, tp_size=2, all_reduce=lambda t: dist.all_reduce(t))
    cache = _cache(kv_heads=1)
    logits = model.forward([SeqChunk(tokens, 0, [0, 1, 2, 3, 4, 5])], cache)
    generated = []
    pos = len(tokens)
    for _ in range(6):
        tok = int(logits[0].argmax())
        generated.append(tok)
        logits = model.forward([SeqChunk([tok], pos, [0, 1, 2, 3, 4, 5])], cache)
        pos += 1
    if rank == 0:
        out.put((logits.numpy().tolist(), generated))
    dist.destroy_process_group()


def test_tp2_matches_tp1():
    tokens = [(i * 29 + 3) % 256 for i in range(15)]
    model = TinyLlama(CFG)
    cache = _cache()
    logits = model.forward([SeqChunk(tokens, 0, [0, 1, 2, 3, 4, 5])], cache)
    generated = []
    pos = len(tokens)
    for _ in range(6):
        tok = int(logits[0].argmax())
        generated.append(tok)
        logits = model.forward([SeqChunk([tok], pos, [0, 1, 2, 3, 4, 5])], cache)
        pos += 1
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    q, ports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, ports, tokens, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        tp_logits, tp_generated = q.get(timeout=60)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert tp_generated == generated
    torch.testing.assert_close(torch.tensor(tp_logits), logits, rtol=1e-3, atol=1e-3)


def test_tp_must_divide_kv_heads():
    with pytest.raises(ValueError, match="must divide num_kv_heads"):
        TinyLlama(CFG, tp_rank=0, tp_size=4)


def test_context_gather_reuses_one_workspace():
    """Decode steps gather the context into one buffer kept by the model, never a fresh
    context-sized allocation per step (whose cost depended on the allocator's history and
    made decode engines slower than colocated ones)."""
    model = TinyLlama(CFG)
    cache = _cache(num_blocks=16)
    for k, v in cache.layers:
        k.normal_()
        v.normal_()
    k_cache, v_cache = cache.layers[0]
    blocks = [9, 3, 14, 0, 7]
    k, v = model._gather_context(k_cache, v_cache, blocks, 18)
    # the same values a fresh gather gives: [nb, Hkv, bs, D] -> [Hkv, ctx, D]
    expect_k = k_cache[torch.tensor(blocks)].transpose(0, 1).reshape(2, 20, -1)[:, :18]
    expect_v = v_cache[torch.tensor(blocks)].transpose(0, 1).reshape(2, 20, -1)[:, :18]
    assert torch.equal(k, expect_k) and torch.equal(v, expect_v)
    workspace = model._workspace.data_ptr()
    tokens = [(i * 5 + 1) % 256 for i in range(40)]
    model.forward([SeqChunk(tokens, 0, list(range(10)))], cache)  # a longer context, then decode steps
    for pos in range(40, 44):
        model.forward([SeqChunk([65], pos, list(range(11)))], cache)
    assert model._workspace.data_ptr() == workspace
