"""The block manager: which KV cache blocks are free, shared or cached (torch-free).

Every block is one record (:class:`BlockState`): ``FREE`` (no content),
``USED`` (``ref_count`` requests or lenders hold it) or ``CACHED`` (nobody
holds it, its content is kept under its :class:`~atom_kv.reference.block_hash.BlockKey`
until an allocation needs the block). Cached blocks are evicted least
recently freed first; a request frees its blocks tail first, so a chain's
first blocks, the ones other prompts share, stay longest. A block held for a
remote reader is ``USED``: it is neither evicted nor reused until released.

With ``record_events``, every change of what the cache holds is recorded as
a vLLM KV event (``BlockStored``, ``BlockRemoved``; :meth:`take_events`).
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from atom_kv.reference.block_hash import BlockKey
from atom_kv.reference.kv_events.events import FULL_ATTENTION, MEDIUM_GPU, BlockRemoved, BlockStored, KVEvent

__all__ = ["BlockManager", "BlockState", "OutOfBlocks"]


class OutOfBlocks(RuntimeError):
    """Not enough free blocks right now."""


class BlockState(enum.Enum):
    FREE = "free"
    USED = "used"
    CACHED = "cached"


@dataclass(slots=True)
class _Block:
    state: BlockState = BlockState.FREE
    ref_count: int = 0
    key: Optional[BlockKey] = None


class BlockManager:
    """Owns every KV block's state: the free list, reference counts, the prefix index
    (digest -> block) and the LRU order of cached blocks nobody holds.

    Freeing a block nobody holds raises, so double frees surface as bugs.
    ``caching=False``: no block is ever kept for reuse (no index, no events)."""

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True,
                 record_events: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # CACHED blocks, least recently freed first
        self._index: dict[bytes, int] = {}  # digest -> the block holding it (USED or CACHED)
        self._events: Optional[list[KVEvent]] = [] if record_events and caching else None
        self.evicted = 0  # cached blocks given to another allocation

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks whose content is indexed (held or not)."""
        return len(self._index)

    def state(self, block: int) -> BlockState:
        return self._blocks[block].state

    def ref_count(self, block: int) -> int:
        return self._blocks[block].ref_count

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ------------------------------------------------------------------ prefix hits
    def match(self, keys: Sequence[BlockKey]) -> list[int]:
        """The blocks holding the longest prefix of ``keys`` (nothing is taken: see :meth:`allocate`)."""
        if not self.caching:
            return []
        hit = []
        for key in keys:
            block = self._index.get(key.digest)
            if block is None:
                break
            hit.append(block)
        return hit

    def can_allocate(self, n: int, reuse: Sequence[int] = ()) -> bool:
        """Whether :meth:`allocate` of ``n`` new blocks plus the cached ``reuse`` would succeed now."""
        return n + sum(1 for b in reuse if self._blocks[b].state is BlockState.CACHED) <= self.num_free

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int, reuse: Sequence[int] = ()) -> list[int]:
        """Take a reference on the cached blocks ``reuse`` (a :meth:`match`), then ``n`` new blocks:
        free ones first, then cached ones nobody holds, least recently freed first (evicted: a
        ``BlockRemoved``). Returns ``reuse`` followed by the new blocks."""
        if not self.can_allocate(n, reuse):
            raise OutOfBlocks(f"need {n} blocks (and {len(reuse)} cached), {self.num_free} free")
        for b in reuse:
            self._take(b)
        new: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._lru.popitem(last=False)
                evicted.append(self._forget(b))
            self._take(b)
            new.append(b)
        if evicted:
            self.evicted += len(evicted)
            if self._events is not None:
                self._events.append(BlockRemoved(block_hashes=evicted, medium=MEDIUM_GPU, group_idx=0))
        return [*reuse, *new]

    def _take(self, b: int) -> None:
        block = self._blocks[b]
        if block.state is BlockState.CACHED:
            del self._lru[b]
        block.state = BlockState.USED
        block.ref_count += 1

    def _forget(self, b: int) -> int:
        """Drop cached block ``b``'s content from the index; returns its hash for the event."""
        block = self._blocks[b]
        assert block.key is not None
        del self._index[block.key.digest]
        external = block.key.external
        block.key = None
        block.state = BlockState.FREE
        return external

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each of ``blocks`` (a request's, in order); a block nobody holds
        any more is cached if it has content (the tail first: evicted first), else free."""
        blocks = list(blocks)
        for b in blocks:
            if self._blocks[b].state is not BlockState.USED:
                raise ValueError(f"block {b} freed but not allocated")
        for b in reversed(blocks):
            block = self._blocks[b]
            block.ref_count -= 1
            if block.ref_count:
                continue
            if block.key is not None:
                block.state = BlockState.CACHED
                self._lru[b] = None
            else:
                block.state = BlockState.FREE
                self._free.append(b)

    # ------------------------------------------------------------------ caching
    def cache(self, block_ids: Sequence[int], keys: Sequence[BlockKey], start: int) -> int:
        """Index the full blocks ``block_ids[i]`` holding ``keys[i]``, for ``i`` from ``start`` on
        (``keys`` is the whole chain; their KV is written). A block already indexed stays as
        it is; a key another block holds already (two requests computed the same prefix) is
        skipped, that block staying uncached. Records one ``BlockStored`` per run of newly
        cached blocks. Returns how many blocks were cached."""
        if not self.caching:
            return 0
        stored = 0
        run: list[int] = []
        for i in range(start, len(keys)):
            block, key = self._blocks[block_ids[i]], keys[i]
            if block.state is not BlockState.USED:
                raise ValueError(f"block {block_ids[i]} cached but not allocated")
            if block.key is not None or key.digest in self._index:
                self._store_run(run, keys)
                run = []
                continue
            block.key = key
            self._index[key.digest] = block_ids[i]
            run.append(i)
            stored += 1
        self._store_run(run, keys)
        return stored

    def _store_run(self, run: list[int], keys: Sequence[BlockKey]) -> None:
        if not run or self._events is None:
            return
        first = run[0]
        tokens = [t for i in run for t in keys[i].token_ids]
        self._events.append(BlockStored(
            block_hashes=[keys[i].external for i in run],
            parent_block_hash=keys[first - 1].external if first else None,
            token_ids=tokens, block_size=self.block_size, lora_id=None, medium=MEDIUM_GPU, lora_name=None,
            group_idx=0, kv_cache_spec_kind=FULL_ATTENTION))

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call (empty without ``record_events``)."""
        if not self._events:
            return []
        out, self._events = self._events, []
        return out
