"""Batched copies of many byte ranges between torch tensors, on any device.

A read names many ranges (blocks, or head slices of blocks). Copying them one
call at a time costs a kernel launch each on a GPU, so :func:`copy_ranges`
views both byte tensors as rows of the ranges' common unit (the gcd of every
offset and size, so usually a block or a head slice) and moves all ranges
with one ``index_select`` and one ``index_copy_`` (a plain slice copy when the
rows are consecutive). The same code runs on CPU tensors, which is how the
CPU suite covers it; only the device the tensors live on differs.

:func:`cut_pieces` cuts a list of ranges into pieces of at most ``chunk``
bytes (splitting ranges exactly at the cut), the unit staged transfers move
through one staging buffer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["copy_ranges", "cut_pieces", "range_rows", "row_unit"]

#: widest element used to move rows (bytes): 8-byte elements move 8x fewer items than bytes
_WIDTHS = (8, 4, 2, 1)


def row_unit(*columns: np.ndarray) -> int:
    """The largest unit dividing every offset and size given (at least 1)."""
    values = np.concatenate([np.asarray(c, dtype=np.int64).ravel() for c in columns])
    g = int(np.gcd.reduce(values)) if len(values) else 1
    return max(g, 1)


def range_rows(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Row indices ``start, start+1, ..., start+count-1`` of every range, in order."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    ends = np.cumsum(counts)
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - (ends - counts), counts)


def _rows_view(t: Any, unit: int, width: int, torch: Any) -> Any:
    """``t`` (1-D uint8) as ``(rows, unit)`` rows of ``width``-byte elements."""
    rows = t.numel() // unit
    flat = t[: rows * unit]
    if width > 1:
        flat = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[width])
    return flat.view(rows, unit // width)


def _consecutive(rows: np.ndarray) -> bool:
    return len(rows) == 0 or int(rows[-1]) - int(rows[0]) == len(rows) - 1 and bool((np.diff(rows) == 1).all())


def copy_ranges(src: Any, src_offsets: np.ndarray, dst: Any, dst_offsets: np.ndarray, sizes: np.ndarray) -> None:
    """Copy ``sizes[i]`` bytes from ``src[src_offsets[i]:]`` to ``dst[dst_offsets[i]:]``
    for every i, in one batched gather and one batched scatter (or one slice
    copy when both sides are consecutive rows). ``src``/``dst`` are 1-D uint8
    tensors, on any devices; ranges must be in bounds (checked by the caller).
    On a GPU the work is queued on the current stream."""
    import torch

    if len(sizes) == 0:
        return
    unit = row_unit(src_offsets, dst_offsets, sizes)
    counts = np.asarray(sizes, dtype=np.int64) // unit
    srows = range_rows(np.asarray(src_offsets) // unit, counts)
    drows = range_rows(np.asarray(dst_offsets) // unit, counts)
    width = next(w for w in _WIDTHS if unit % w == 0 and src.data_ptr() % w == 0 and dst.data_ptr() % w == 0)
    s2, d2 = _rows_view(src, unit, width, torch), _rows_view(dst, unit, width, torch)
    if _consecutive(srows):
        rows = s2[int(srows[0]) : int(srows[0]) + len(srows)]
    else:
        rows = s2.index_select(0, torch.from_numpy(srows).to(s2.device, non_blocking=True))
    if rows.device != d2.device:
        rows = rows.to(d2.device, non_blocking=True)
    if _consecutive(drows):
        d2[int(drows[0]) : int(drows[0]) + len(drows)].copy_(rows, non_blocking=True)
    else:
        d2.index_copy_(0, torch.from_numpy(drows).to(d2.device, non_blocking=True), rows)


def cut_pieces(offsets: np.ndarray, sizes: np.ndarray, chunk: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Cut ranges (in stream order) into pieces of at most ``chunk`` bytes,
    splitting a range exactly where the byte stream crosses a multiple of
    ``chunk``. Returns ``(index, offset, size)`` arrays per piece: ``index``
    names the original range each sub-range came from."""
    offsets = np.asarray(offsets, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    first = starts // chunk
    last = (starts + sizes - 1) // chunk
    counts = last - first + 1
    rep = np.repeat(np.arange(len(sizes)), counts)
    k = np.repeat(first, counts) + range_rows(np.zeros(len(sizes), np.int64), counts)
    seg_start = np.maximum(starts[rep], k * chunk)
    seg_end = np.minimum(starts[rep] + sizes[rep], (k + 1) * chunk)
    sub_off = offsets[rep] + (seg_start - starts[rep])
    sub_size = seg_end - seg_start
    cuts = np.flatnonzero(np.diff(k)) + 1
    return [(i, o, s) for i, o, s in zip(np.split(rep, cuts), np.split(sub_off, cuts), np.split(sub_size, cuts))]
