"""vLLM's one-tensor-per-layer KV layouts (``vllm-hnd``, ``vllm-cpu``) through the
real workers: a consumer rank reads exactly the heads it owns from whichever
producer ranks hold them, each layer once, every byte checked; and an engine
with a fused layout and one with separate K and V tensors refuse each other."""

from __future__ import annotations

import pytest
import torch

from atom_kv.connector import ConnectorScheduler, ConsumerWorker, ProducerWorker
from atom_kv.connector.kv_caches import describe_kv_caches
from atom_kv.wire import CompatInfo
from tests.connector.engines import Engine, LocalRank, run_until
from tests.connector.kvutil import BLOCK, HEAD_DIM, HEADS, LAYERS, config, port_range

NB = 16
ROW = 2 * HEAD_DIM  # a token's K and V
BLOCK_ELEMS = BLOCK * ROW


def fused_compat(layout: str) -> CompatInfo:
    return CompatInfo(model_id="tiny", dtype="float32", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=ROW,
                      block_size=BLOCK, layout=layout)


def fused_caches(tp_rank: int, tp_size: int, *, fill: bool) -> list[torch.Tensor]:
    """One ``[blocks, heads, block, K|V]`` tensor per layer; a producer's values say (layer, global head, block)."""
    hl = HEADS // tp_size
    heads = torch.arange(tp_rank * hl, (tp_rank + 1) * hl)
    caches = []
    for layer in range(LAYERS):
        t = torch.full((NB, hl, BLOCK, ROW), -1.0)
        if fill:
            t.copy_(expected(layer, heads, torch.arange(NB)).view(t.shape))
        caches.append(t)
    return caches


def expected(layer: int, heads: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``[len(blocks), len(heads), block * row]``, unique per element and exact in float32."""
    base = (layer * HEADS + heads.view(1, -1)) * NB + blocks.view(-1, 1)
    return (base.unsqueeze(-1) * BLOCK_ELEMS + torch.arange(BLOCK_ELEMS).view(1, 1, -1)).to(torch.float32)


class FusedPair:
    """A producer and a consumer engine of ``p_tp`` and ``d_tp`` in-process ranks; closes them."""

    def __init__(self, p_tp: int, d_tp: int, *, p_compat: CompatInfo, d_compat: CompatInfo, d_caches=None) -> None:
        base = port_range(p_tp)
        self.pcfg = config("kv_producer", base, backend="tcp")
        self.ccfg = config("kv_consumer", port_range(d_tp), backend="tcp")
        self.pws = [ProducerWorker(self.pcfg, engine_id="P", host="127.0.0.1", tp_rank=r, tp_size=p_tp,
                                   compat=p_compat, bind_host="127.0.0.1") for r in range(p_tp)]
        self.cws = [ConsumerWorker(self.ccfg, engine_id="D", host="127.0.0.1", tp_rank=r, tp_size=d_tp,
                                   compat=d_compat) for r in range(d_tp)]
        for r, pw in enumerate(self.pws):
            pw.register_kv_caches(fused_caches(r, p_tp, fill=True))
        self.dcaches = d_caches if d_caches is not None else [fused_caches(r, d_tp, fill=False) for r in range(d_tp)]
        for cw, caches in zip(self.cws, self.dcaches):
            cw.register_kv_caches(caches)
        self.P = Engine(ConnectorScheduler(self.pcfg, engine_id="P", host="127.0.0.1", tp_size=p_tp,
                                           block_size=BLOCK), [LocalRank(w) for w in self.pws], NB)
        self.D = Engine(ConnectorScheduler(self.ccfg, engine_id="D", host="127.0.0.1", tp_size=d_tp,
                                           block_size=BLOCK), [LocalRank(w) for w in self.cws], NB)

    def close(self) -> None:
        for w in (*self.pws, *self.cws):
            w.close()
        self.P.sched.close()
        self.D.sched.close()


@pytest.mark.parametrize("layout,p_tp,d_tp", [("vllm-hnd", 1, 2), ("vllm-hnd", 2, 1), ("vllm-cpu", 2, 2)])
def test_fused_layers_move_exactly_the_owned_heads_each_layer_once(layout, p_tp, d_tp):
    pair = FusedPair(p_tp, d_tp, p_compat=fused_compat(layout), d_compat=fused_compat(layout))
    try:
        P, D = pair.P, pair.D
        P.pool.alloc("offset", 3)  # producer and consumer blocks differ
        params = P.prefill("r1", 40)
        blocks = D.admit("d1", 40, params)
        run_until([P, D], lambda: "d1" in D.ready and "r1" in P.freed)
        local, remote = torch.tensor(blocks), torch.tensor(params["remote_block_ids"])
        hl = HEADS // d_tp
        for r, caches in enumerate(pair.dcaches):
            heads = torch.arange(r * hl, (r + 1) * hl)
            for layer, t in enumerate(caches):
                assert torch.equal(t[local].reshape(len(blocks), hl, -1), expected(layer, heads, remote)), (r, layer)
                others = [b for b in range(NB) if b not in blocks]
                assert bool((t[others] == -1.0).all()), "a block outside the load was written"
        # every consumer rank read its own heads of the three blocks once per layer, nothing more
        per_rank = 3 * hl * BLOCK_ELEMS * 4 * LAYERS
        assert [cw.stats()["bytes"] for cw in pair.cws] == [per_rank] * d_tp
    finally:
        pair.close()


def test_a_fused_layout_and_separate_k_and_v_refuse_each_other():
    """Same model, dtype, layers, heads, row width and block size: only the layout differs, and without it
    in the handshake these two would exchange bytes of different meaning. Refused in one line; nothing read."""
    hnd = CompatInfo(**{**{f: getattr(fused_compat("vllm-hnd"), f) for f in CompatInfo.__struct_fields__},
                        "layout": "hnd"})
    d_caches = [[tuple(torch.full((NB, HEADS, BLOCK, ROW), -1.0) for _ in "kv") for _ in range(LAYERS)]]
    pair = FusedPair(1, 1, p_compat=fused_compat("vllm-hnd"), d_compat=hnd, d_caches=d_caches)
    try:
        P, D = pair.P, pair.D
        params = P.prefill("r1", 40)
        D.admit("d1", 40, params)
        run_until([D], lambda: "d1" in D.failed)
        assert D.failed["d1"].endswith("KV layout mismatch: layout 'vllm-hnd' (prefill) vs 'hnd' (decode)"), \
            D.failed["d1"]
        assert "\n" not in D.failed["d1"]
        assert all(bool((t == -1.0).all()) for layer in d_caches[0] for t in layer)
        assert pair.cws[0].stats()["bytes"] == 0
    finally:
        pair.close()


def test_describe_kv_caches_takes_one_tensor_per_layer_for_a_fused_layout():
    caches = fused_caches(0, 2, fill=False)
    described = describe_kv_caches(caches, fused_compat("vllm-cpu"), 2)
    assert [(t.layer, t.kind, t.num_blocks, t.block_bytes) for t in described] == [
        (layer, "kv", NB, (HEADS // 2) * BLOCK_ELEMS * 4) for layer in range(LAYERS)]
    assert describe_kv_caches([{"kv": t} for t in caches], fused_compat("vllm-cpu"), 2) == described
    with pytest.raises(ValueError, match="layer 0: layout vllm-hnd keeps K and V in one tensor per layer, "
                                         "got 2 tensors"):
        describe_kv_caches([(t, t) for t in caches], fused_compat("vllm-hnd"), 2)
    with pytest.raises(ValueError, match=r"layer 0 kv cache has shape \[16, 2, 16, 32\], expected \[16, 4, 16, 32\]"):
        describe_kv_caches(caches, fused_compat("vllm-hnd"), 1)  # TP 1 holds all four heads
