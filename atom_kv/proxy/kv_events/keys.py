"""Chain keys: what the proxy's KV index is keyed on, computed from token ids alone.

A block's key is a keyed 64-bit hash of (parent key, its token ids as uint32 bytes), cut to 60 bits, and the
first block's parent is a root key made from the index's seed, the block size and the LoRA adapter. So a
key names a block's whole prefix, equal for every engine whatever its own hash function or seed, and a
prompt's keys are computed the same way (:meth:`ChainKeys.of_tokens`). A key is never 0.

The hash is Python's own ``hash()`` of that pair: the bytes' SipHash-1-3, under a key drawn at random in
each process (unless ``PYTHONHASHSEED`` fixes it), mixed with the parent key by the tuple hash; three
times as fast as ``blake2b(digest_size=8)`` here, and keyed by this process, so an engine cannot aim
collisions at it. Keys therefore differ between proxy processes, which is fine: each proxy keys its own
index and its own prompts. 60 bits keep every key a 32-byte Python int (64 would take 36); two different
prefixes meet with odds of about n^2 / 2^61.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any, Optional, Sequence

import msgspec

__all__ = ["KEY_MASK", "ChainKeys"]

KEY_MASK = (1 << 60) - 1


class ChainKeys:
    """The chain-key function of one index; its ``seed`` (bytes) goes into every root key."""

    __slots__ = ("_seed", "_roots", "_extra")

    def __init__(self, seed: bytes = b"atom-kv chain keys v1") -> None:
        self._seed = seed
        self._roots: dict[tuple[int, Optional[str]], int] = {}
        self._extra = msgspec.msgpack.Encoder()

    def root(self, block_size: int, lora: Optional[str] = None) -> int:
        """The parent key of a prompt's first block (per block size and LoRA adapter)."""
        key = (block_size, lora)
        found = self._roots.get(key)
        if found is None:
            adapter = b"\x00" if lora is None else b"\x01" + lora.encode()
            text = self._seed + block_size.to_bytes(4, "little") + adapter
            found = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & KEY_MASK or 1
            if len(self._roots) < 4096:  # a few block sizes and adapters; never grows without bound
                self._roots[key] = found
        return found

    def chain(self, parent: int, token_ids: Sequence[int], block_size: int, count: int,
              extra_keys: Optional[list[Any]] = None) -> list[int]:
        """The keys of ``count`` full blocks of ``token_ids`` after ``parent`` (raises OverflowError for a token
        id outside uint32, TypeError for one that is not an int). ``extra_keys[i]``, when not None, is folded
        into block i's key (multimodal inputs, cache salts: such blocks never match a plain prompt)."""
        data = array("I", token_ids).tobytes()
        step = 4 * block_size
        keys: list[int] = []
        append, mask = keys.append, KEY_MASK
        key = parent
        if extra_keys is None:
            for start in range(0, count * step, step):
                key = hash((key, data[start:start + step])) & mask or 1  # never 0 (the tables' "removed")
                append(key)
            return keys
        for i, start in enumerate(range(0, count * step, step)):
            chunk = data[start:start + step]
            if i < len(extra_keys) and extra_keys[i] is not None:
                chunk += b"\xff" + self._extra.encode(extra_keys[i])
            key = hash((key, chunk)) & mask or 1
            append(key)
        return keys

    def of_tokens(self, token_ids: Sequence[int], block_size: int, lora: Optional[str] = None) -> list[int]:
        """The keys of a prompt's full blocks (a partial last block has none): ``[]`` when a token id is not
        a uint32."""
        try:
            return self.chain(self.root(block_size, lora), token_ids, block_size, len(token_ids) // block_size)
        except (OverflowError, TypeError):
            return []
