"""FAKE ``atom.model_engine.block_manager``: a free list, no prefix caching; ATOM's KV event log, with
``record_remote_store`` (ATOM main's ``BlockManager.record_remote_store``) as the one event it records."""

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
        events = getattr(config, "kv_events_config", None)
        self._event_log: list | None = [] if events is not None and events.enable else None

    # -- ATOM's KV event API (block_manager.py, "KV event API") ---------------
    @property
    def kv_events_enabled(self) -> bool:
        return self._event_log is not None

    def take_events(self) -> list:
        if not self._event_log:
            return []
        events, self._event_log = self._event_log, []
        return events

    def record_remote_store(self, block_hashes: list[int], token_ids: list[int],
                            parent_block_hash: int | None = None) -> None:
        """ATOM's BlockStored(medium=REMOTE) for blocks received from a producer, as a plain record."""
        if self._event_log is None or not block_hashes:
            return
        self._event_log.append({"type": "BlockStored", "medium": "REMOTE", "block_hashes": list(block_hashes),
                                "token_ids": list(token_ids), "parent_block_hash": parent_block_hash,
                                "block_size": self.block_size})

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
