"""FAKE ``atom.model_engine.block_manager``: a free list, no prefix caching."""

from __future__ import annotations

from typing import Any


class _Pool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)


class BlockManager:
    def __init__(self, config: Any) -> None:
        self.block_size = config.kv_cache_block_size
        assert config.num_kvcache_blocks > 0
        self.kv = _Pool(config.num_kvcache_blocks)

    def _blocks_for(self, n_tokens: int) -> int:
        return (n_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, seq: Any) -> int:
        return 0 if len(self.kv.free) >= self._blocks_for(len(seq)) else -1

    def allocate(self, seq: Any, num_cached_blocks: int = 0) -> None:
        assert not seq.block_table  # ATOM's own assertion: a request is admitted with no blocks
        for _ in range(self._blocks_for(len(seq))):
            seq.block_table.append(self.kv.free.pop(0))
        seq.num_cached_tokens = 0

    def deallocate(self, seq: Any) -> None:
        for block in reversed(seq.block_table):
            assert block not in self.kv.free, f"block {block} freed twice"
            self.kv.free.append(block)
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    def can_append(self, seq: Any, num_new_tokens: int = 1) -> bool:
        return len(self.kv.free) >= max(0, self._blocks_for(len(seq) + num_new_tokens) - len(seq.block_table))

    def may_append(self, seq: Any, num_new_tokens: int = 1) -> None:
        while len(seq.block_table) < self._blocks_for(len(seq)):
            seq.block_table.append(self.kv.free.pop(0))
