"""The shape of the reference model (torch-free, so the engine core can use it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the model; ``kv_bytes_per_token`` is what one token's KV costs in total."""

    vocab_size: int = 260
    hidden: int = 512
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 1024
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4
