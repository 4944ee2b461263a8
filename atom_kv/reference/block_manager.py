"""The block manager: which KV cache blocks are free (torch-free)."""

from __future__ import annotations

from collections import deque
from typing import Iterable

__all__ = ["BlockManager", "OutOfBlocks"]


class OutOfBlocks(RuntimeError):
    """Not enough free blocks right now."""


class BlockManager:
    """Owns which KV blocks are free: a FIFO free list plus used/free counts.

    Freeing a block that is not allocated raises, so double frees surface as bugs.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} freed but not allocated")
        for b in blocks:
            self._used.discard(b)
            self._free.append(b)
