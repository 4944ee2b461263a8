"""Paged KV cache tensors of one rank."""

from __future__ import annotations

import torch

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """One rank's KV cache: per layer a ``(k, v)`` pair of contiguous tensors
    shaped ``[num_blocks, kv_heads_local, block_size, head_dim]`` ("HND"), on
    the rank's device (host memory, or a GPU's)."""

    def __init__(self, *, num_layers: int, num_blocks: int, kv_heads: int, block_size: int, head_dim: int,
                 device: "torch.device | str" = "cpu") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, kv_heads, block_size, head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=torch.float32, device=device),
             torch.zeros(shape, dtype=torch.float32, device=device))
            for _ in range(num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * 4 + v.numel() * 4 for k, v in self.layers)
