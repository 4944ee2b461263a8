"""FAKE ``atom.config``: the per-layer KV cache record ATOM gives connectors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class KVCacheTensor:
    layer_num: int
    k_cache: Any = None
    v_cache: Any = None
    k_scale: Any = None
    v_scale: Any = None
    index_cache: Any = None
