"""Pure address planning: which bytes of which remote rank land where.

Every supported KV layout (``atom_kv.connector.cache_layouts``) is block
major, and inside a block ``units`` sub-blocks (ATOM's physical blocks when
its ``block_ratio`` > 1, else 1), each head major: one head's slice of one
unit is one contiguous ``head_bytes`` run, and a run of heads owned by one
rank is contiguous too. How the bytes are arranged inside that run (HND,
AITER's K/V shuffles) does not matter here; the handshake only lets engines
with the same layout exchange them. A consumer rank reads, for every layer
and kind (k, v, their scales, or an MLA latent), the heads it owns from
whichever producer rank holds them: whole blocks when it owns all of that
rank's heads, else one run per (unit, head range).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from atom_kv.transfer.base import ChunkedRegion, ReadOp, merge_ops, split_pair

__all__ = [
    "LayoutError",
    "TensorLayout",
    "HeadOverlap",
    "head_range",
    "head_overlaps",
    "block_runs",
    "plan_reads",
    "ReadPlanner",
]


class LayoutError(ValueError):
    """Two engines' KV layouts cannot be mapped onto each other (one line)."""


@dataclass(frozen=True)
class TensorLayout:
    """One registered KV tensor of a rank: where its blocks are.

    ``units`` is how many head-major sub-blocks one block holds (1 unless the
    engine stores a block as several physical blocks); a block is ``units``
    runs of ``block_bytes // units`` bytes, each holding every head of the
    rank in turn.
    """

    layer: int
    kind: str  # "k", "v", "k_scale", "v_scale", "kv", "latent" or "index"
    region: ChunkedRegion
    block_bytes: int
    num_blocks: int
    units: int = 1


@dataclass(frozen=True)
class HeadOverlap:
    """Heads ``[local_first, local_first+count)`` here are ``[remote_first, ...)`` on ``remote_rank``."""

    remote_rank: int
    local_first: int
    remote_first: int
    count: int


def head_range(num_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """The global KV heads ``[lo, hi)`` TP rank ``rank`` of ``tp_size`` owns."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise LayoutError(f"TP rank {rank} is outside a TP size of {tp_size}")
    if num_heads % tp_size:
        raise LayoutError(f"num_kv_heads {num_heads} is not divisible by TP size {tp_size}")
    per = num_heads // tp_size
    return rank * per, (rank + 1) * per


def head_overlaps(num_heads: int, local_tp: int, local_rank: int, remote_tp: int, *, is_mla: bool = False) -> list[HeadOverlap]:
    """For each remote rank holding some of this rank's heads, the contiguous overlap.

    MLA caches are replicated: read the whole latent from rank ``local_rank % remote_tp``.
    """
    if is_mla:
        if remote_tp < 1:
            raise LayoutError(f"remote TP size must be >= 1, got {remote_tp}")
        return [HeadOverlap(local_rank % remote_tp, 0, 0, 1)]
    lo, hi = head_range(num_heads, local_tp, local_rank)
    if num_heads % remote_tp:
        raise LayoutError(f"num_kv_heads {num_heads} is not divisible by the remote TP size {remote_tp}")
    per_remote = num_heads // remote_tp
    out = []
    for p in range(lo // per_remote, (hi - 1) // per_remote + 1):
        r_lo, r_hi = p * per_remote, (p + 1) * per_remote
        a, b = max(lo, r_lo), min(hi, r_hi)
        out.append(HeadOverlap(p, a - lo, a - r_lo, b - a))
    return out


def block_runs(local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(local_start, remote_start, n)`` runs consecutive on both sides."""
    if len(local_blocks) != len(remote_blocks):
        raise LayoutError(f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote blocks")
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local_blocks, remote_blocks):
        if runs:
            l0, r0, n = runs[-1]
            if lb == l0 + n and rb == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((lb, rb, 1))
    return runs


class ReadPlanner:
    """Validated tensor pairing between this rank and one remote rank for one
    head overlap; :meth:`plan` turns block runs into :class:`ReadOp` lists.

    ``local``/``remote`` are matched by ``(layer, kind)``; ``*_heads`` are the
    heads per unit on each side (1 for MLA). Every local tensor must have the
    same ``units``; the peer's are taken to be the same (the handshake's
    layout check guarantees it). Raises :class:`LayoutError` for missing
    tensors, mixed sub-block counts or inconsistent head sizes.

    Internally blocks become units: a block run ``(lb, rb, n)`` is the unit
    run ``(lb*u, rb*u, n*u)`` and every offset is a unit stride, so one code
    path serves every layout.
    """

    def __init__(self, local: Sequence[TensorLayout], remote: Sequence[TensorLayout], overlap: HeadOverlap,
                 *, local_heads: int, remote_heads: int) -> None:
        by_key = {(t.layer, t.kind): t for t in remote}
        unit_counts = {t.units for t in local}
        if len(unit_counts) > 1:
            raise LayoutError(f"this rank's tensors mix {sorted(unit_counts)} sub-blocks per block")
        self.units = unit_counts.pop() if unit_counts else 1
        if self.units < 1:
            raise LayoutError(f"a block must hold at least one sub-block, got {self.units}")
        u = self.units
        # (local tensor, remote tensor, bytes per read, local/remote byte offset in a unit, unit strides)
        self._pairs: list[tuple[TensorLayout, TensorLayout, int, int, int, int, int]] = []
        self.full = overlap.count == local_heads == remote_heads
        self.single = True
        for lt in local:
            rt = by_key.get((lt.layer, lt.kind))
            if rt is None:
                raise LayoutError(f"the remote rank has no {lt.kind} cache for layer {lt.layer}")
            if lt.block_bytes % (u * local_heads):
                raise LayoutError(f"layer {lt.layer} {lt.kind}: a {lt.block_bytes}-byte block does not split into "
                                  f"{u} sub-blocks of {local_heads} heads")
            head_bytes = lt.block_bytes // (u * local_heads)
            if rt.block_bytes != head_bytes * remote_heads * u:
                raise LayoutError(
                    f"layer {lt.layer} {lt.kind}: remote block is {rt.block_bytes} bytes, expected "
                    f"{head_bytes * remote_heads * u} ({remote_heads} heads of {head_bytes} bytes"
                    + (f" in each of {u} sub-blocks)" if u > 1 else ")")
                )
            size = overlap.count * head_bytes
            self._pairs.append((lt, rt, size, overlap.local_first * head_bytes, overlap.remote_first * head_bytes,
                                lt.block_bytes // u, rt.block_bytes // u))
            self.single = self.single and len(lt.region.region_ids) == 1 and len(rt.region.region_ids) == 1
        self._local_blocks = min((t.num_blocks for t in local), default=0)
        self._remote_blocks = min((p[1].num_blocks for p in self._pairs), default=0)
        self._fast = [(lt.region.region_ids[0], lus, rt.region.region_ids[0], rus, size, le, re)
                      for lt, rt, size, le, re, lus, rus in self._pairs] if self.single else []
        # columns of _fast as int64 vectors, for plan_array
        self._cols = np.array(self._fast, dtype=np.int64).reshape(-1, 7).T if self.single else None
        # the same columns shaped (pairs, 1), ready to broadcast against runs
        self._colv = tuple(c[:, None] for c in self._cols) if self._cols is not None else ()

    def _check_blocks(self, runs: Sequence[tuple[int, int, int]]) -> None:
        for lb, rb, n in runs:
            if lb < 0 or lb + n > self._local_blocks:
                raise LayoutError(f"local block {lb + n - 1} is outside this rank's {self._local_blocks} blocks")
            if rb < 0 or rb + n > self._remote_blocks:
                raise LayoutError(f"remote block {rb + n - 1} is outside the producer's {self._remote_blocks} blocks")

    def _unit_runs(self, runs: Sequence[tuple[int, int, int]]) -> Sequence[tuple[int, int, int]]:
        u = self.units
        return runs if u == 1 else [(lb * u, rb * u, n * u) for lb, rb, n in runs]

    def plan(self, runs: Sequence[tuple[int, int, int]]) -> list[ReadOp]:
        """The :class:`ReadOp` list for ``runs``; raises :class:`LayoutError` for out-of-range blocks."""
        self._check_blocks(runs)
        runs = self._unit_runs(runs)
        if self.single:
            # one region per tensor and maximal runs: ops are final as built (nothing can merge)
            mk = tuple.__new__  # ReadOp(...) without the NamedTuple constructor's overhead
            if self.full:
                return [mk(ReadOp, (lid, lb * lus, rid, rb * rus, n * size))
                        for lid, lus, rid, rus, size, _, _ in self._fast for lb, rb, n in runs]
            return [mk(ReadOp, (lid, (lb + j) * lus + le, rid, (rb + j) * rus + re, size))
                    for lid, lus, rid, rus, size, le, re in self._fast for lb, rb, n in runs for j in range(n)]
        return self._plan_chunked(runs)

    def num_ops(self, runs: Sequence[tuple[int, int, int]]) -> int:
        """How many ops :meth:`plan` returns for ``runs`` (before chunk splits)."""
        per = len(runs) if self.full else sum(n for _, _, n in runs) * self.units
        return per * len(self._pairs)

    def plan_array(self, runs: Sequence[tuple[int, int, int]]) -> np.ndarray:
        """Like :meth:`plan`, as an ``(n, 5)`` int64 array in :class:`ReadOp` column order
        (vectorised: the fast path for backends that take op arrays)."""
        if not self.single or self._cols is None:
            return np.array(self.plan(runs), dtype=np.int64).reshape(-1, 5)
        r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
        lb, rb, n = r[:, 0], r[:, 1], r[:, 2]
        if len(r) <= 16:  # a few runs: plain Python is cheaper than numpy reductions
            for a_lb, a_rb, a_n in runs:
                if a_lb < 0 or a_lb + a_n > self._local_blocks:
                    raise LayoutError(f"a local block is outside this rank's {self._local_blocks} blocks")
                if a_rb < 0 or a_rb + a_n > self._remote_blocks:
                    raise LayoutError(f"a remote block is outside the producer's {self._remote_blocks} blocks")
        else:
            if lb.min() < 0 or (lb + n).max() > self._local_blocks:
                raise LayoutError(f"a local block is outside this rank's {self._local_blocks} blocks")
            if rb.min() < 0 or (rb + n).max() > self._remote_blocks:
                raise LayoutError(f"a remote block is outside the producer's {self._remote_blocks} blocks")
        if self.units > 1:
            lb, rb, n = lb * self.units, rb * self.units, n * self.units
        lid, lus, rid, rus, size, le, re = self._colv
        if self.full:
            # the common case (whole heads, one region per tensor): fill the
            # (pairs, runs, 5) table in place, pair-major like plan()
            out = np.empty((len(self._pairs), len(r), 5), dtype=np.int64)
            out[:, :, 0] = lid
            np.multiply(lus, lb, out=out[:, :, 1])
            out[:, :, 2] = rid
            np.multiply(rus, rb, out=out[:, :, 3])
            np.multiply(size, n, out=out[:, :, 4])
            return out.reshape(-1, 5)
        # expand unit runs into single units
        starts = np.repeat(np.cumsum(n) - n, n)
        j = np.arange(int(n.sum()), dtype=np.int64) - starts
        lu, ru = np.repeat(lb, n) + j, np.repeat(rb, n) + j
        cols = (lid + 0 * lu, lu * lus + le, rid + 0 * ru, ru * rus + re, size + 0 * lu)
        return np.stack([c.ravel() for c in cols], axis=1)

    def _plan_chunked(self, runs: Sequence[tuple[int, int, int]]) -> list[ReadOp]:
        ops: list[ReadOp] = []
        for lt, rt, size, le, re, lus, rus in self._pairs:
            for lb, rb, n in runs:
                if self.full:
                    ops.extend(split_pair(lt.region, lb * lus, rt.region, rb * rus, n * size))
                    continue
                for j in range(n):
                    ops.extend(split_pair(lt.region, (lb + j) * lus + le, rt.region, (rb + j) * rus + re, size))
        return merge_ops(ops)


def plan_reads(
    local: Sequence[TensorLayout],
    remote: Sequence[TensorLayout],
    overlap: HeadOverlap,
    runs: Sequence[tuple[int, int, int]],
    *,
    local_heads: int,
    remote_heads: int,
) -> list[ReadOp]:
    """The merged :class:`ReadOp` list pulling ``overlap`` of every tensor for ``runs`` (see :class:`ReadPlanner`)."""
    return ReadPlanner(local, remote, overlap, local_heads=local_heads, remote_heads=remote_heads).plan(runs)
