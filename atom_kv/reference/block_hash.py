"""Prefix-cache block hashes: a chain over token ids, seeded per engine.

A full block's key is ``sha256(parent's digest, or the engine's seed for the
first block ‖ the block's token ids)``: two blocks have the same key only
when every token up to and including theirs is the same. The cache keys on
the whole 32-byte digest; events carry its first 8 bytes as an unsigned
64-bit int (vLLM's ``ExternalBlockHash``). The seed is random per engine
unless given, so nobody outside the engine can compute its hashes (a router
keys on the blocks' tokens instead).
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["BlockHasher", "BlockKey"]


@dataclass(frozen=True, slots=True)
class BlockKey:
    """One full block's place in a token chain: its digest, its 64-bit hash for events, its tokens."""

    digest: bytes
    external: int
    token_ids: tuple[int, ...]


class BlockHasher:
    """Owns the engine's hash seed; turns token ids into the chained keys of their full blocks."""

    def __init__(self, block_size: int, seed: Optional[bytes] = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._seed = os.urandom(32) if seed is None else bytes(seed)

    def key(self, parent: Optional[BlockKey], token_ids: Sequence[int]) -> BlockKey:
        """The key of a full block of ``token_ids`` after ``parent`` (None: the first block)."""
        tokens = tuple(token_ids)
        if len(tokens) != self.block_size:
            raise ValueError(f"a block holds {self.block_size} tokens, got {len(tokens)}")
        h = hashlib.sha256(self._seed if parent is None else parent.digest)
        h.update(struct.pack(f"<{len(tokens)}Q", *tokens))
        digest = h.digest()
        return BlockKey(digest, int.from_bytes(digest[:8], "big"), tokens)

    def extend(self, keys: list[BlockKey], token_ids: Sequence[int]) -> list[BlockKey]:
        """Append to ``keys`` (the keys of ``token_ids``' first full blocks) those of the full blocks
        that follow; returns ``keys``."""
        bs = self.block_size
        for start in range(len(keys) * bs, len(token_ids) - bs + 1, bs):
            keys.append(self.key(keys[-1] if keys else None, token_ids[start:start + bs]))
        return keys
