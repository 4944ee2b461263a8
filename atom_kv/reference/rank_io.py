"""What crosses the boundary between the engine core and its TP ranks (picklable, torch-free).

Keeping these out of ``runner`` lets the engine core of a TP>1 engine run
without importing torch: only the rank processes load the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from atom_kv.engine_hooks import KVConnectorOutput, RouteReport
from atom_kv.reference.model_config import ModelConfig

__all__ = ["RankSpec", "StepResult", "ChunkTuple"]

#: One step's work for the ranks: ``(token_ids, start_pos, block_ids)`` per sequence.
ChunkTuple = tuple[list[int], int, list[int]]


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build itself (sent to worker processes)."""

    model: ModelConfig
    model_id: str
    num_blocks: int
    block_size: int
    tp_rank: int
    tp_size: int
    engine_id: str
    host: str  # advertised to peers
    kv_config_json: Optional[str] = None
    bind_host: Optional[str] = None  # the listeners' address (None: host)
    dp_rank: int = 0
    dp_size: int = 1
    device: str = "cpu"  # "cpu" or "cuda" (also ROCm builds of torch): the model and its KV cache
    kv_checksum_dir: Optional[str] = None  # --kv-checksums: per-block checksums of lent and loaded KV


@dataclass
class StepResult:
    """One rank's answer to a step: logits (rank 0 only), finished transfers, stats."""

    logits: Optional[np.ndarray]
    kv_output: KVConnectorOutput
    stats: dict[str, float]
    #: the rank's peer routes, only when they changed since its last step
    routes: Optional[RouteReport] = None
