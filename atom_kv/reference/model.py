"""A tiny Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) that attends over a paged KV cache.

Weights are deterministic random values derived from a seed; nothing is
downloaded. One :class:`TinyLlama` holds one tensor-parallel rank's slice of
the weights (attention heads, KV heads and the MLP's intermediate dimension);
the caller passes an ``all_reduce`` that sums partial outputs across ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from atom_kv.reference.kv_cache import PagedKVCache
from atom_kv.reference.model_config import ModelConfig

__all__ = ["ModelConfig", "SeqChunk", "TinyLlama"]

_sdpa = torch.nn.functional.scaled_dot_product_attention


@dataclass
class SeqChunk:
    """Tokens of one sequence to run this step, starting at position ``start_pos``."""

    token_ids: list[int]
    start_pos: int
    block_ids: list[int]


def _full_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """All weights at full (TP=1) size, generated in a fixed order from ``cfg.seed``."""
    gen = torch.Generator().manual_seed(cfg.seed)

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, dtype=torch.float32) * std

    h, d = cfg.hidden, cfg.head_dim
    weights: dict[str, torch.Tensor] = {"embed": normal(cfg.vocab_size, h, 1.0)}
    for layer in range(cfg.num_layers):
        p = f"l{layer}."
        weights[p + "wq"] = normal(cfg.num_heads * d, h, 1 / math.sqrt(h))
        weights[p + "wk"] = normal(cfg.num_kv_heads * d, h, 1 / math.sqrt(h))
        weights[p + "wv"] = normal(cfg.num_kv_heads * d, h, 1 / math.sqrt(h))
        weights[p + "wo"] = normal(h, cfg.num_heads * d, 1 / math.sqrt(cfg.num_heads * d))
        weights[p + "w_gate"] = normal(cfg.intermediate, h, 1 / math.sqrt(h))
        weights[p + "w_up"] = normal(cfg.intermediate, h, 1 / math.sqrt(h))
        weights[p + "w_down"] = normal(h, cfg.intermediate, 1 / math.sqrt(cfg.intermediate))
        weights[p + "attn_norm"] = torch.ones(h) + 0.1 * normal(1, h, 1.0)[0]
        weights[p + "mlp_norm"] = torch.ones(h) + 0.1 * normal(1, h, 1.0)[0]
    weights["final_norm"] = torch.ones(h)
    # A wide logit spread keeps greedy choices far from ties.
    weights["lm_head"] = normal(cfg.vocab_size, h, 4.0 / math.sqrt(h))
    return weights


class TinyLlama:
    """One TP rank's slice of the model; runs a batch of :class:`SeqChunk` against a paged cache."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: Optional[Callable[[torch.Tensor], None]] = None,
        device: "torch.device | str" = "cpu",
    ) -> None:
        if cfg.num_kv_heads % tp_size or cfg.num_heads % tp_size or cfg.intermediate % tp_size:
            raise ValueError(
                f"--tp {tp_size} must divide num_kv_heads={cfg.num_kv_heads}, "
                f"num_heads={cfg.num_heads} and intermediate={cfg.intermediate}"
            )
        self.cfg = cfg
        self.device = torch.device(device)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.heads = cfg.num_heads // tp_size
        self.kv_heads = cfg.num_kv_heads // tp_size
        self._all_reduce = all_reduce if tp_size > 1 else None
        full = _full_weights(cfg)
        d = cfg.head_dim
        q0, q1 = tp_rank * self.heads * d, (tp_rank + 1) * self.heads * d
        k0, k1 = tp_rank * self.kv_heads * d, (tp_rank + 1) * self.kv_heads * d
        inter = cfg.intermediate // tp_size
        m0, m1 = tp_rank * inter, (tp_rank + 1) * inter
        self.w: dict[str, torch.Tensor] = {
            "embed": full["embed"],
            "final_norm": full["final_norm"],
            "lm_head": full["lm_head"],
        }
        for layer in range(cfg.num_layers):
            p = f"l{layer}."
            self.w[p + "wq"] = full[p + "wq"][q0:q1].contiguous()
            self.w[p + "wk"] = full[p + "wk"][k0:k1].contiguous()
            self.w[p + "wv"] = full[p + "wv"][k0:k1].contiguous()
            self.w[p + "wo"] = full[p + "wo"][:, q0:q1].contiguous()
            self.w[p + "w_gate"] = full[p + "w_gate"][m0:m1].contiguous()
            self.w[p + "w_up"] = full[p + "w_up"][m0:m1].contiguous()
            self.w[p + "w_down"] = full[p + "w_down"][:, m0:m1].contiguous()
            self.w[p + "attn_norm"] = full[p + "attn_norm"]
            self.w[p + "mlp_norm"] = full[p + "mlp_norm"]
        # weights are generated on the CPU (the same numbers on every device), then moved
        self.w = {name: t.to(self.device) for name, t in self.w.items()}
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self._inv_freq = inv_freq.to(self.device)
        self._workspace = torch.empty(0, device=self.device)  # K/V gather space of paged attention, see _gather_context

    # ------------------------------------------------------------------ pieces
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, H, D]`` by its positions (half-split RoPE)."""
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self._all_reduce is not None:
            self._all_reduce(t)
        return t

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk], cache: PagedKVCache) -> torch.Tensor:
        """Write each chunk's K/V into ``cache``, attend over the cache, and return
        the logits of each chunk's last token: ``[len(chunks), vocab]``."""
        cfg = self.cfg
        bs = cache.block_size
        d = cfg.head_dim
        tokens: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        offsets: list[int] = []
        for c in chunks:
            for i, tok in enumerate(c.token_ids):
                pos = c.start_pos + i
                tokens.append(tok)
                positions.append(pos)
                blocks.append(c.block_ids[pos // bs])
                offsets.append(pos % bs)
        dev = self.device
        tok_t = torch.tensor(tokens, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        blk_t = torch.tensor(blocks, dtype=torch.long, device=dev)
        off_t = torch.tensor(offsets, dtype=torch.long, device=dev)
        n = tok_t.shape[0]
        x = self.w["embed"][tok_t]
        scale = 1.0 / math.sqrt(d)
        for layer in range(cfg.num_layers):
            p = f"l{layer}."
            h = self._rms(x, self.w[p + "attn_norm"])
            q = self._rope((h @ self.w[p + "wq"].T).view(n, self.heads, d), pos_t)
            k = self._rope((h @ self.w[p + "wk"].T).view(n, self.kv_heads, d), pos_t)
            v = (h @ self.w[p + "wv"].T).view(n, self.kv_heads, d)
            k_cache, v_cache = cache.layers[layer]
            k_cache[blk_t, :, off_t, :] = k
            v_cache[blk_t, :, off_t, :] = v
            attn = torch.empty(n, self.heads * d, device=dev)
            row = 0
            for c in chunks:
                t = len(c.token_ids)
                attn[row : row + t] = self._paged_attention(
                    q[row : row + t], k_cache, v_cache, c, scale
                )
                row += t
            x = x + self._reduce(attn @ self.w[p + "wo"].T)
            h = self._rms(x, self.w[p + "mlp_norm"])
            gated = torch.nn.functional.silu(h @ self.w[p + "w_gate"].T) * (h @ self.w[p + "w_up"].T)
            x = x + self._reduce(gated @ self.w[p + "w_down"].T)
        ends = []
        row = 0
        for c in chunks:
            row += len(c.token_ids)
            ends.append(row - 1)
        last = self._rms(x[torch.tensor(ends, dtype=torch.long, device=dev)], self.w["final_norm"])
        return last @ self.w["lm_head"].T

    def _gather_context(self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: list[int],
                        ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``ctx`` positions of a sequence's K and V as ``[Hkv, ctx, D]`` views.

        The blocks are gathered into a workspace this model keeps (room for
        every block of the cache, allocated once), so a decode step allocates
        nothing the size of its context. Fresh multi-MiB buffers on every step
        made the step's cost depend on the allocator's history: glibc hands
        the freed buffers of a thread's arena back to the kernel until some
        larger allocation raises its thresholds, so an engine that never ran a
        long prefill (a decode engine) page-faulted through its whole context
        on every step and decoded up to a third slower than a colocated one."""
        blocks_total, hkv, bs, d = k_cache.shape
        nb = (ctx + bs - 1) // bs
        layer = k_cache.numel()
        if self._workspace.numel() < 3 * layer:
            self._workspace = torch.empty(3 * layer, dtype=k_cache.dtype, device=self.device)
        n = nb * hkv * bs * d
        idx = torch.tensor(block_ids[:nb], dtype=torch.long, device=self.device)
        staged = self._workspace[:n].view(nb, hkv, bs, d)
        out = []
        for i, cache in enumerate((k_cache, v_cache)):
            torch.index_select(cache, 0, idx, out=staged)  # [nb, Hkv, bs, D]
            dst = self._workspace[(i + 1) * layer : (i + 1) * layer + n].view(hkv, nb, bs, d)
            dst.copy_(staged.transpose(0, 1))  # head-major: [Hkv, nb, bs, D]
            out.append(dst.view(hkv, nb * bs, d)[:, :ctx])
        return out[0], out[1]

    def _paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk: SeqChunk,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``q`` ``[t, H, D]`` over the chunk's cached context."""
        t = q.shape[0]
        ctx = chunk.start_pos + t
        k, v = self._gather_context(k_cache, v_cache, chunk.block_ids, ctx)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, t, D]
        kh, vh = k.unsqueeze(0), v.unsqueeze(0)  # [1, Hkv, ctx, D]
        if t == 1:
            out = _sdpa(qh, kh, vh, scale=scale, enable_gqa=True)
        elif chunk.start_pos == 0:
            out = _sdpa(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        else:  # queries sit at the end of the context: bottom-right aligned causal mask
            q_pos = torch.arange(chunk.start_pos, ctx, device=self.device)[:, None]
            mask = torch.arange(ctx, device=self.device)[None, :] <= q_pos
            out = _sdpa(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(t, -1)
