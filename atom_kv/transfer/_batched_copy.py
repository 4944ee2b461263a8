"""Helpers over lists of byte ranges, shared by the staged and batched copies.

- :func:`range_rows`: the row indices of ranges given as (start row, row
  count), in order (the host stand-ins' copies by address gather and scatter
  over them);
- :func:`cut_pieces`: a list of ranges cut into pieces of at most ``chunk``
  bytes (splitting ranges exactly at the cut), the unit staged transfers
  move through one staging buffer.

Copies themselves are by address: :mod:`atom_kv.transfer._device_copy`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["cut_pieces", "range_rows"]


def range_rows(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Row indices ``start, start+1, ..., start+count-1`` of every range, in order."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    ends = np.cumsum(counts)
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - (ends - counts), counts)


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
