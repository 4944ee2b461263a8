"""The KV cache events the reference engine publishes, exactly as vLLM's
``vllm.distributed.kv_events`` encodes them since vLLM PR #42892: every
event a msgpack map whose ``"type"`` key is the class name, fields left out
when they equal their default (``omit_defaults``), and the batch a map of
``ts``, ``events`` and ``data_parallel_rank``.

Hashes are unsigned 64-bit ints (:class:`~atom_kv.reference.block_hash.BlockKey.external`).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

__all__ = ["MEDIUM_GPU", "FULL_ATTENTION", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent",
           "KVEvent", "KVEventBatch"]

#: vLLM's medium of the engine's own KV cache (on every device: its CPU build says "GPU" too)
MEDIUM_GPU = "GPU"
#: vLLM's ``KVCacheSpecKind`` of a full-attention cache group
FULL_ATTENTION = "full_attention"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to the engine's prefix cache (the base of vLLM's event union)."""


class BlockStored(KVCacheEvent):
    """Full blocks that entered the cache: a run of one chain, ``parent_block_hash`` the block before
    the first of them (None: the run starts the chain), ``token_ids`` every token of the run."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks that left the cache (evicted to make room)."""

    block_hashes: list[int]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    """The cache holds nothing (the engine started, or its cache was reset)."""


#: an event as published and decoded: one of the concrete events (the base alone has no tag peers know)
KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """The events of one engine step (one ZeroMQ message), with the DP rank that published them."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: Optional[int] = None
