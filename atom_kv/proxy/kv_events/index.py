"""The proxy's KV index: which (instance, DP rank) holds which prompt prefix, from the engines' KV events.

Keyed on the blocks' token content (:mod:`atom_kv.proxy.kv_events.keys`), not on the engines' hashes, so it
does not depend on an engine's hash function or seed and a prompt's keys are computed by the proxy alone.
The engines' hashes are kept only to apply removals.

Layout, chosen for memory (``python -m atom_kv.bench kv-index`` measures the cost per (block, worker) entry):
per worker a set of the chain keys it holds (what a query reads) and an
:class:`~atom_kv.proxy.kv_events.table.EngineHashes` (engine hash -> chain key, 24 bytes an entry once
merged, oldest first). A query walks each worker's set while the prompt's keys are in it: the workers plus
the blocks matched, not the workers times the prompt.

The memory caps (``max_blocks`` all workers together, ``max_blocks_per_worker``) evict oldest-stored first.
They bound a leak (an engine whose removals never arrive); set them above what the engines cache, whose own
``BlockRemoved`` events do the real eviction.

Threads: the writer methods (:meth:`KvIndex.apply`, :meth:`KvIndex.clear`, :meth:`KvIndex.drop`) run on one
thread at a time (the subscriber's). :meth:`KvIndex.longest_prefix` and the counts may run on another (the
event loop): each step is one set or dict read, atomic under the GIL, and a worker's set is replaced, never
emptied in place. :meth:`KvIndex.record` (predictions) runs on the event loop only.
"""

from __future__ import annotations

from itertools import takewhile
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence, Union

from atom_kv.proxy.kv_events.keys import KEY_MASK, ChainKeys
from atom_kv.proxy.kv_events.predict import PredictedBlocks
from atom_kv.proxy.kv_events.stats import KvEventStats
from atom_kv.proxy.kv_events.table import EngineHashes

__all__ = ["DEVICE_MEDIA", "KvIndex", "PromptKeys", "Worker"]

#: (instance, DP rank): whatever hashable id names an instance (the proxy uses ``Instance.key``)
Worker = tuple[Hashable, int]
#: where a block counts as cached: None (no medium said), the device, or received from a producer (ATOM
#: stores those as REMOTE and removes them as GPU); CPU and DISK tiers are not indexed
DEVICE_MEDIA = frozenset((None, "GPU", "REMOTE"))


def _on_device(medium: Optional[str]) -> bool:
    return medium is None or medium.upper() in DEVICE_MEDIA


def _norm(hashes: Sequence[Any]) -> list[int]:
    """Engine hashes as 60-bit ints (ints of either sign, or bytes by their first 8)."""
    try:
        return [h & KEY_MASK for h in hashes]
    except TypeError:
        return [(h if isinstance(h, int) else int.from_bytes(h[:8], "little")) & KEY_MASK for h in hashes]


class _Worker:
    """One (instance, DP rank): the chain keys it holds and its engine hashes."""

    __slots__ = ("key", "block_size", "keys", "hashes")

    def __init__(self, key: Worker) -> None:
        self.key = key
        self.block_size = 0  # learnt from its first consistent run; 0: not yet
        self.keys: set[int] = set()
        self.hashes = EngineHashes()


class PromptKeys:
    """A prompt's chain keys, computed once per block size (a policy queries and records with one)."""

    __slots__ = ("token_ids", "lora", "_chain", "_by_size")

    def __init__(self, chain: ChainKeys, token_ids: Sequence[int], lora: Optional[str] = None) -> None:
        self.token_ids = token_ids
        self.lora = lora
        self._chain = chain
        self._by_size: dict[int, list[int]] = {}

    def keys(self, block_size: int) -> list[int]:
        found = self._by_size.get(block_size)
        if found is None:
            found = self._by_size[block_size] = self._chain.of_tokens(self.token_ids, block_size, self.lora)
        return found


class KvIndex:
    """Owns every worker's indexed blocks, bounded by ``max_blocks`` (entries, all workers together) and
    ``max_blocks_per_worker``, and the predictions of recent routing decisions (``predict_ttl_s``, at most
    ``predict_max_blocks``). ``default_block_size`` keys predictions for a worker whose events have not said
    its block size yet."""

    def __init__(self, *, max_blocks: int, max_blocks_per_worker: int, predict_ttl_s: float = 5.0,
                 predict_max_blocks: int = 65536, default_block_size: int = 16,
                 stats: Optional[KvEventStats] = None, chain: Optional[ChainKeys] = None,
                 clock: Optional[Callable[[], float]] = None) -> None:
        for name, value in (("max_blocks", max_blocks), ("max_blocks_per_worker", max_blocks_per_worker),
                            ("default_block_size", default_block_size)):
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value!r}")
        self.max_blocks = max_blocks
        self.max_blocks_per_worker = max_blocks_per_worker
        self.default_block_size = default_block_size
        self.stats = stats if stats is not None else KvEventStats()
        self.chain = chain if chain is not None else ChainKeys()
        self._predicted: PredictedBlocks[Worker] = (PredictedBlocks(predict_ttl_s, predict_max_blocks) if clock is None
                           else PredictedBlocks(predict_ttl_s, predict_max_blocks, clock))
        self._workers: dict[Worker, _Worker] = {}
        self._sizes: tuple[int, ...] = ()  # the block sizes workers have reported
        self.entries = 0  # (block, worker) entries, all workers

    # ------------------------------------------------------------------ reads (any thread)
    @property
    def predicted_entries(self) -> int:
        return len(self._predicted)

    def block_counts(self) -> dict[Worker, int]:
        """Entries per worker."""
        return {key: len(w.keys) for key, w in self._workers.copy().items()}

    def block_size_of(self, instance: Hashable, dp_rank: int) -> int:
        """The block size a worker's events reported (``default_block_size`` before any)."""
        w = self._workers.get((instance, dp_rank))
        return w.block_size if w is not None and w.block_size else self.default_block_size

    def prompt_keys(self, token_ids: Sequence[int], lora: Optional[str] = None) -> PromptKeys:
        """``token_ids``' chain keys, computed on first use per block size and then reused."""
        return PromptKeys(self.chain, token_ids, lora)

    def longest_prefix(self, prompt: Union[PromptKeys, Sequence[int]]) -> dict[Worker, int]:
        """For each worker holding (or predicted to hold) a prefix of the prompt: its length in tokens
        (whole blocks). Workers holding nothing of it are absent."""
        if not isinstance(prompt, PromptKeys):
            prompt = self.prompt_keys(prompt)
        result: dict[Worker, int] = {}
        workers = list(self._workers.values())
        sizes = self._sizes
        for size in sizes if self.default_block_size in sizes else (*sizes, self.default_block_size):
            keys = prompt.keys(size)
            if not keys:
                continue
            first = keys[0]
            for w in workers:
                held = w.keys
                if w.block_size == size and first in held:
                    result[w.key] = size * sum(1 for _ in takewhile(held.__contains__, keys))
            for worker, blocks in self._predicted.match(keys).items():
                if blocks * size > result.get(worker, 0):
                    result[worker] = blocks * size
        return result

    # ------------------------------------------------------------------ predictions (event loop)
    def record(self, instance: Hashable, dp_rank: int, prompt: Union[PromptKeys, Sequence[int]]) -> None:
        """The proxy routed ``prompt`` to ``(instance, dp_rank)``: count its blocks there for the predictions'
        TTL, until their events arrive."""
        if not isinstance(prompt, PromptKeys):
            prompt = self.prompt_keys(prompt)
        self._predicted.record((instance, dp_rank), prompt.keys(self.block_size_of(instance, dp_rank)))

    def forget_predictions(self, instance: Hashable) -> None:
        self._predicted.forget(lambda worker: worker[0] == instance)

    # ------------------------------------------------------------------ writes (one thread)
    def apply(self, instance: Hashable, dp_rank: int, events: Iterable[Any]) -> None:
        """Apply one batch's events (wire Structs, each with a ``kind``) to ``(instance, dp_rank)``."""
        key = (instance, dp_rank)
        counts = self.stats.events
        for ev in events:
            kind = ev.kind
            counts[kind] += 1
            if kind == "BlockStored":
                self._store(key, ev)
            elif kind == "BlockRemoved":
                if _on_device(ev.medium) and ev.group_idx in (None, 0):
                    self._remove(key, ev.block_hashes)
            elif kind == "AllBlocksCleared":
                if _on_device(ev.medium):
                    self.clear(instance, dp_rank, "cleared")
            elif kind == "BlockTransferred":  # off the device (swapped out): gone; onto it: no tokens to key on
                if _on_device(ev.from_medium) and not _on_device(ev.to_medium) and ev.group_idx in (None, 0):
                    self._remove(key, ev.block_hashes)

    def clear(self, instance: Hashable, dp_rank: Optional[int] = None, reason: str = "cleared") -> int:
        """Drop every entry of ``(instance, dp_rank)`` (None: of every rank of ``instance``); the entries dropped."""
        dropped = 0
        for key in self._keys_of(instance, dp_rank):
            dropped += self._clear(self._workers[key])
            self.stats.resets[reason] = self.stats.resets.get(reason, 0) + 1
        return dropped

    def drop(self, instance: Hashable, reason: str = "left") -> None:
        """``instance`` left: its workers and their entries go."""
        for key in self._keys_of(instance, None):
            self._clear(self._workers.pop(key))
            self.stats.resets[reason] = self.stats.resets.get(reason, 0) + 1
        self._sizes_changed()

    def _keys_of(self, instance: Hashable, dp_rank: Optional[int]) -> list[Worker]:
        if dp_rank is not None:
            return [(instance, dp_rank)] if (instance, dp_rank) in self._workers else []
        return [key for key in self._workers if key[0] == instance]

    def _sizes_changed(self) -> None:
        self._sizes = tuple(sorted({w.block_size for w in self._workers.values() if w.block_size}))

    def _clear(self, w: _Worker) -> int:
        count = len(w.keys)
        w.keys = set()  # replaced, not emptied: a query on another thread reads the old one whole
        w.hashes = EngineHashes()
        self.entries -= count
        if w.block_size:
            w.block_size = 0
            self._sizes_changed()
        return count

    def _store(self, key: Worker, ev: Any) -> None:
        skipped = self.stats.skipped_runs
        if ev.group_idx not in (None, 0):
            skipped["group"] += 1
            return
        if not _on_device(ev.medium):
            skipped["medium"] += 1
            return
        hashes = ev.block_hashes
        count = len(hashes)
        if not count:
            return
        size = ev.block_size
        w = self._workers.get(key)
        if w is None:
            w = self._workers[key] = _Worker(key)
        if size < 1 or len(ev.token_ids) != count * size or (w.block_size and size != w.block_size):
            skipped["block_size"] += 1
            return
        if ev.parent_block_hash is None:
            lora = ev.lora_name if ev.lora_name is not None else None if ev.lora_id is None else f"#{ev.lora_id}"
            parent = self.chain.root(size, lora)
        else:
            known_parent = w.hashes.get(_norm((ev.parent_block_hash,))[0])
            if known_parent is None:
                skipped["unknown_parent"] += 1
                return
            parent = known_parent
        try:
            chain_keys = self.chain.chain(parent, ev.token_ids, size, count, ev.extra_keys)
        except (OverflowError, TypeError):  # a token id that is not a uint32
            self.stats.decode_failures["event"] += 1
            return
        if not w.block_size:
            w.block_size = size
            self._sizes_changed()
        held = w.keys
        before = len(held)
        for old in w.hashes.put_many(_norm(hashes), chain_keys):
            held.discard(old)
        held.update(chain_keys)
        self.entries += len(held) - before
        if len(held) > self.max_blocks_per_worker:
            self._evict(w, len(held) - self.max_blocks_per_worker + self.max_blocks_per_worker // 64)
        while self.entries > self.max_blocks:
            largest = max(self._workers.values(), key=lambda x: len(x.keys))
            self._evict(largest, self.entries - self.max_blocks + self.max_blocks // 64)

    def _remove(self, key: Worker, hashes: Sequence[Any]) -> None:
        w = self._workers.get(key)
        if w is None:
            return
        held = w.keys
        before = len(held)
        for chain_key in w.hashes.pop_many(_norm(hashes)):
            held.discard(chain_key)
        self.entries -= before - len(held)

    def _evict(self, w: _Worker, count: int) -> None:
        """Drop ``w``'s ``count`` oldest entries (the memory caps)."""
        held = w.keys
        before = len(held)
        for chain_key in w.hashes.evict_oldest(max(1, count)):
            held.discard(chain_key)
        gone = before - len(held)
        if gone == 0 and held:  # the table had only stale copies: drop from the set directly
            for _ in range(min(count, len(held))):
                held.pop()
            gone = before - len(held)
        self.entries -= gone
        self.stats.evicted_blocks += gone
