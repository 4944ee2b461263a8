"""Which blocks a bench read moves, and the read ops for them.

- ``contiguous``: local block i from remote block i (one run: one copy);
- ``permuted``: local block i from remote block ``perm[i]``, a permutation of
  the first n remote blocks (sorted by the remote side it is contiguous
  there, scattered here);
- ``subset``: n blocks chosen from twice as many remote ones, into a
  permutation of the local ones: scattered on both sides, the KV case (a
  request's blocks, wherever the two block managers put them).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["PATTERNS", "block_pairs", "ops_for", "source_blocks"]

PATTERNS = ("contiguous", "permuted", "subset")


def source_blocks(n: int) -> int:
    """Remote blocks a read of ``n`` blocks needs to choose from (``subset`` picks from 2n)."""
    return 2 * n


def block_pairs(pattern: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(local blocks, remote blocks): local block ``local[i]`` receives remote block ``remote[i]``."""
    rng = np.random.default_rng(seed)
    if pattern == "contiguous":
        return np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)
    if pattern == "permuted":
        return np.arange(n, dtype=np.int64), rng.permutation(n).astype(np.int64)
    if pattern == "subset":
        return rng.permutation(n).astype(np.int64), rng.choice(source_blocks(n), n, replace=False).astype(np.int64)
    raise ValueError(f"pattern {pattern!r}; allowed: {', '.join(PATTERNS)}")


def ops_for(local: np.ndarray, remote: np.ndarray, block: int, local_ids: Sequence[int], local_chunk: int,
            remote_ids: Sequence[int], remote_chunk: int, local_offset: int = 0) -> np.ndarray:
    """The ``(n, 5)`` read ops moving ``remote`` blocks into ``local`` ones, over
    regions registered as chunks (a block never straddles two: chunks are
    multiples of the largest block). ``local_offset``: bytes into the local buffer."""
    loff = local_offset + local * block
    roff = remote * block
    ops = np.empty((len(local), 5), dtype=np.int64)
    ops[:, 0] = np.asarray(local_ids, dtype=np.int64)[loff // local_chunk]
    ops[:, 1] = loff % local_chunk
    ops[:, 2] = np.asarray(remote_ids, dtype=np.int64)[roff // remote_chunk]
    ops[:, 3] = roff % remote_chunk
    ops[:, 4] = block
    return ops
