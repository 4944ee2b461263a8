"""Every supported KV layout keeps one (unit, head) slice one contiguous byte run,
and the read planner moves exactly the owned heads in each of them.

Tensors are numpy arrays filled through the layout's own indexing, so the
checks are about real memory order, not about the formulas under test.
"""

import numpy as np
import pytest

from atom_kv.connector.cache_layouts import (
    KINDS,
    KVLayout,
    LayoutMismatch,
    describe_tensor,
    detect_layout,
)
from atom_kv.connector.layout import ReadPlanner, TensorLayout, block_runs, head_overlaps
from atom_kv.transfer.base import ChunkedRegion

DTYPE = np.uint16  # 2-byte elements: AITER packs x = 8
X = 8
HEAD_DIM = 16


def _shape(layout: KVLayout, kind: str, blocks: int, heads: int, block_size: int) -> tuple[int, ...]:
    r = layout.block_ratio
    P, p, d = blocks * r, block_size // r, HEAD_DIM
    if kind.endswith("_scale"):
        return (P, heads, p)
    if layout.name == "hnd":
        return (P, heads, p, d)
    if layout.is_fused:
        return (P, heads, p, 2 * d)  # a token's K and V (vllm-hnd), or K rows then V rows (vllm-cpu)
    if kind == "k":
        return (P, heads, d // X, p, X)
    return (P, heads, d, p) if layout.name == "aiter" else (P, heads, p // X, d, X)


def _tagged(layout: KVLayout, kind: str, blocks: int, heads: int, block_size: int, *, seed: int) -> np.ndarray:
    """A cache whose every element says which (physical block, global head) it belongs to."""
    shape = _shape(layout, kind, blocks, heads, block_size)
    t = np.empty(shape, dtype=DTYPE)
    for pb in range(shape[0]):
        for h in range(heads):
            t[pb, h] = seed * 1000 + pb * 10 + h
    return t


def _kinds(name: str) -> tuple[str, ...]:
    return KINDS[name] if name != "mla" else ("latent",)


@pytest.mark.parametrize("name", ["hnd", "aiter", "aiter-shuffle", "vllm-hnd", "vllm-cpu"])
@pytest.mark.parametrize("ratio", [1, 2])
def test_every_unit_head_slice_is_one_contiguous_run(name, ratio):
    layout = KVLayout(name, ratio)
    blocks, heads, bs = 3, 4, 16
    for kind in _kinds(name):
        t = _tagged(layout, kind, blocks, heads, bs, seed=1)
        g = describe_tensor(layout, kind, t.shape, t.itemsize, block_size=bs, heads=heads)
        assert (g.num_blocks, g.units, g.heads) == (blocks, ratio, heads)
        assert g.block_bytes * g.num_blocks == t.nbytes
        raw = t.reshape(-1).view(np.uint8)
        unit = g.block_bytes // g.units
        head = unit // heads
        for pb in range(blocks * ratio):
            for h in range(heads):
                run = raw[pb * unit + h * head:pb * unit + (h + 1) * head].view(DTYPE)
                assert (run == 1000 + pb * 10 + h).all(), (kind, pb, h)


def test_detect_atom_layouts():
    # ATOM main: K [P, h, d/x, p, x], V [P, h, p/x, d, x]; block 16 stored as 16-token physical blocks
    assert detect_layout((10, 2, 16, 16, 8), (10, 2, 2, 128, 8), 16) == KVLayout("aiter-shuffle", 1)
    # ATOM 0c982ea92: V [P, h, d, p]; block 256 as 16-token physical blocks
    assert detect_layout((160, 2, 16, 16, 8), (160, 2, 128, 16), 256) == KVLayout("aiter", 16)
    assert detect_layout((640, 1, 576), None, 16).is_mla
    with pytest.raises(LayoutMismatch, match="no supported KV layout"):
        detect_layout((10, 2, 16, 8), (10, 2, 16), 16)
    with pytest.raises(LayoutMismatch, match="do not divide the block size 16"):
        detect_layout((10, 2, 16, 24, 8), (10, 2, 128, 24), 16)


def test_wrong_shapes_name_the_expected_one():
    layout = KVLayout("aiter-shuffle")
    with pytest.raises(LayoutMismatch, match=r"v cache has shape \[4, 2, 16, 2, 8\], expected \[4, 2, 2, 16, 8\] "
                                             r"\[blocks, heads, block/x, head_dim, x\] for layout aiter-shuffle"):
        describe_tensor(layout, "v", (4, 2, 16, 2, 8), 2, block_size=16, heads=2, head_dim=16)
    with pytest.raises(LayoutMismatch, match="has no 'latent' tensor"):
        describe_tensor(layout, "latent", (4, 16, 8), 2, block_size=16, heads=2)
    with pytest.raises(LayoutMismatch, match="not whole 16-token blocks"):
        describe_tensor(KVLayout("mla"), "latent", (40, 1, 576), 2, block_size=16, heads=1)


def test_labels_name_layout_and_ratio():
    assert KVLayout("aiter-shuffle").label == "aiter-shuffle"
    assert KVLayout("aiter", 16).label == "aiter/ratio=16"
    assert KVLayout("mla", 16).label == "mla"  # token major: the ratio does not change the bytes
    assert KVLayout.parse("aiter/ratio=16") == KVLayout("aiter", 16)
    with pytest.raises(ValueError, match="unknown KV layout 'nhd'"):
        KVLayout("nhd")


def test_mla_as_atom_allocates_it_is_one_run_per_block():
    # ATOM main: [P*p, 1, 576] with p = 1 physical token per row; 4 blocks of 16 tokens
    g = describe_tensor(KVLayout("mla", 16), "latent", (64, 1, 576), 2, block_size=16, heads=1)
    assert (g.num_blocks, g.block_bytes, g.units, g.heads, g.head_dim) == (4, 16 * 576 * 2, 1, 1, 576)
    # the same bytes viewed as [blocks, block_size, L]
    assert describe_tensor(KVLayout("mla"), "latent", (4, 16, 576), 2, block_size=16, heads=1) == g


def _layouts(tensors: dict, layout: KVLayout, heads: int, bs: int, base_id: int) -> list[TensorLayout]:
    out = []
    for i, ((layer, kind), t) in enumerate(sorted(tensors.items())):
        g = describe_tensor(layout, kind, t.shape, t.itemsize, block_size=bs, heads=heads)
        out.append(TensorLayout(layer, kind, ChunkedRegion((base_id + i,), t.nbytes, t.nbytes), g.block_bytes,
                                g.num_blocks, g.units))
    return out


def _execute(ops, local: dict[int, np.ndarray], remote: dict[int, np.ndarray]) -> None:
    for op in ops:
        lid, loff, rid, roff, size = (int(v) for v in op)
        dst = local[lid].reshape(-1).view(np.uint8)
        src = remote[rid].reshape(-1).view(np.uint8)
        dst[loff:loff + size] = src[roff:roff + size]


@pytest.mark.parametrize("name,ratio", [("aiter-shuffle", 2), ("aiter", 4), ("hnd", 1), ("vllm-hnd", 1),
                                        ("vllm-cpu", 2)])
@pytest.mark.parametrize("local_tp,local_rank,remote_tp", [(2, 1, 1), (1, 0, 2), (2, 0, 2)])
def test_heterogeneous_tp_reads_move_exactly_the_owned_heads(name, ratio, local_tp, local_rank, remote_tp):
    total_heads, bs, blocks = 4, 16, 6
    layout = KVLayout(name, ratio)
    kinds = _kinds(name)
    lh, rh = total_heads // local_tp, total_heads // remote_tp
    local = {(0, kind): _tagged(layout, kind, blocks, lh, bs, seed=9) for kind in kinds}
    locals_by_id = {}
    local_layouts = _layouts(local, layout, lh, bs, 100)
    for tl, t in zip(local_layouts, (local[k] for k in sorted(local))):
        locals_by_id[tl.region.region_ids[0]] = t
    before = {k: t.copy() for k, t in local.items()}
    remotes = {}
    for rank in range(remote_tp):
        # every remote element: seed 2 + rank, and its *global* head in the tag
        rt = {}
        for kind in kinds:
            t = _tagged(layout, kind, blocks, rh, bs, seed=2 + rank)
            rt[(0, kind)] = t
        remotes[rank] = rt
    local_blocks, remote_blocks = [4, 5, 1], [0, 1, 3]
    runs = block_runs(local_blocks, remote_blocks)
    for ov in head_overlaps(total_heads, local_tp, local_rank, remote_tp):
        rt = remotes[ov.remote_rank]
        remote_layouts = _layouts(rt, layout, rh, bs, 500 + 50 * ov.remote_rank)
        by_id = {tl.region.region_ids[0]: rt[k] for tl, k in zip(remote_layouts, sorted(rt))}
        planner = ReadPlanner(local_layouts, remote_layouts, ov, local_heads=lh, remote_heads=rh)
        assert sorted(tuple(o) for o in planner.plan(runs)) == sorted(
            tuple(int(v) for v in row) for row in planner.plan_array(runs))
        _execute(planner.plan(runs), locals_by_id, by_id)
    r = ratio
    for kind in kinds:
        got, old = local[(0, kind)], before[(0, kind)]
        for lb in range(blocks):
            for u in range(r):
                for h in range(lh):
                    cell = got[lb * r + u, h]
                    if lb in local_blocks:
                        rb = remote_blocks[local_blocks.index(lb)]
                        g = local_rank * lh + h                  # global head
                        src_rank, src_h = divmod(g, rh)
                        assert (cell == (2 + src_rank) * 1000 + (rb * r + u) * 10 + src_h).all(), (kind, lb, u, h)
                    else:
                        assert (cell == old[lb * r + u, h]).all()


def test_planner_refuses_tensors_with_mixed_sub_blocks():
    region = ChunkedRegion((1,), 64, 64)
    local = [TensorLayout(0, "k", region, 32, 2, 2), TensorLayout(0, "v", region, 32, 2, 1)]
    with pytest.raises(Exception, match="mix"):
        ReadPlanner(local, local, head_overlaps(2, 1, 0, 1)[0], local_heads=2, remote_heads=2)


def test_vllm_fused_layouts_one_kv_tensor_per_layer():
    # vLLM 0.32: [blocks, kv_heads, block_size, K|V], float32 K and V of 16 each
    for name in ("vllm-hnd", "vllm-cpu"):
        g = describe_tensor(KVLayout(name), "kv", (8, 2, 16, 32), 4, block_size=16, heads=2)
        assert (g.num_blocks, g.block_bytes, g.units, g.heads, g.head_dim) == (8, 2 * 16 * 32 * 4, 1, 2, 32)
        with pytest.raises(LayoutMismatch, match="has no 'k' tensor"):
            describe_tensor(KVLayout(name), "k", (8, 2, 16, 32), 4, block_size=16, heads=2)
    with pytest.raises(LayoutMismatch, match=r"expected \[8, 2, 16, 32\] \[blocks, heads, block, K\|V\] "
                                             r"for layout vllm-hnd"):
        describe_tensor(KVLayout("vllm-hnd"), "kv", (8, 4, 16, 16), 4, block_size=16, heads=2, head_dim=32)
    with pytest.raises(LayoutMismatch, match="vllm-cpu keeps a block's K rows and V rows at equal widths"):
        describe_tensor(KVLayout("vllm-cpu"), "kv", (8, 2, 16, 33), 4, block_size=16, heads=2)
    # the same shape in two byte orders: two labels, so the handshake tells them apart
    assert KVLayout("vllm-hnd").label != KVLayout("vllm-cpu").label
    assert KVLayout.parse("vllm-cpu/ratio=2") == KVLayout("vllm-cpu", 2)
