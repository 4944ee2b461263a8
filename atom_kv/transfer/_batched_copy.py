"""Batched copies of many byte ranges between torch tensors, on any device.

A read names many ranges (blocks, or head slices of blocks). Copying them one
call at a time costs a kernel launch each on a GPU, so :func:`copy_ranges`
views both byte tensors as rows of the ranges' common unit (the gcd of every
offset and size, so usually a block or a head slice) and moves all ranges in
one batched call that reads each byte once and writes it once (a slice copy,
an ``index_select`` straight into consecutive rows, an ``index_copy_``
straight from them, or one ``_foreach_copy_`` over the ranges). The older
gather-then-scatter path stays reachable (``mode="gather"``) so both can be
measured. The same code runs on CPU tensors, which is how the CPU suite
covers it; only the device the tensors live on differs.

:func:`cut_pieces` cuts a list of ranges into pieces of at most ``chunk``
bytes (splitting ranges exactly at the cut), the unit staged transfers move
through one staging buffer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["COPY_MODES", "copy_ranges", "cut_pieces", "range_rows", "row_unit"]

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


#: how :func:`copy_ranges` moves scattered ranges: "direct" reads each byte
#: once, straight from its source range into its destination range;
#: "gather" (the older path, kept to measure against) gathers into a
#: temporary buffer and scatters from it, twice the traffic
COPY_MODES = ("direct", "gather")


def copy_ranges(src: Any, src_offsets: np.ndarray, dst: Any, dst_offsets: np.ndarray, sizes: np.ndarray,
                mode: str = "direct") -> None:
    """Copy ``sizes[i]`` bytes from ``src[src_offsets[i]:]`` to ``dst[dst_offsets[i]:]``
    for every i, in one batched call. ``src``/``dst`` are 1-D uint8 tensors,
    on any devices; ranges must be in bounds (checked by the caller). On a
    GPU the work is queued on the current stream.

    ``mode="direct"`` (:data:`COPY_MODES`): consecutive rows on both sides
    are one slice copy; consecutive destination rows are one
    ``index_select`` written straight into them; consecutive source rows one
    ``index_copy_`` read straight from them; scattered on both sides, one
    ``torch._foreach_copy_`` over the ranges' views. ``mode="gather"``, and
    any copy between two devices with scattered rows: one ``index_select``
    into a temporary on the source's device, one transfer, one
    ``index_copy_`` from it (three launches instead of one copy per range).

    A copy into host memory from a device is never left in flight unless the
    destination is pinned (the caller then fences before reading it): a
    pageable or plain host destination is copied synchronously, so what this
    returns can be read at once."""
    import torch

    if len(sizes) == 0:
        return
    if mode not in COPY_MODES:
        raise ValueError(f"copy mode {mode!r}; allowed: {', '.join(COPY_MODES)}")
    unit = row_unit(src_offsets, dst_offsets, sizes)
    counts = np.asarray(sizes, dtype=np.int64) // unit
    srows = range_rows(np.asarray(src_offsets) // unit, counts)
    drows = range_rows(np.asarray(dst_offsets) // unit, counts)
    width = next(w for w in _WIDTHS if unit % w == 0 and src.data_ptr() % w == 0 and dst.data_ptr() % w == 0)
    s2, d2 = _rows_view(src, unit, width, torch), _rows_view(dst, unit, width, torch)
    # into host memory from a device: asynchronous only into pinned memory (fenced by the caller)
    non_blocking = d2.device.type != "cpu" or (s2.device.type != "cpu" and bool(d2.is_pinned()))
    s_run, d_run = _consecutive(srows), _consecutive(drows)
    if s_run and d_run:
        d2[int(drows[0]) : int(drows[0]) + len(drows)].copy_(s2[int(srows[0]) : int(srows[0]) + len(srows)],
                                                            non_blocking=non_blocking)
        return
    if mode == "direct" and s2.device == d2.device:  # across devices, one transfer of the gathered rows wins
        _copy_direct(torch, s2, srows, s_run, d2, drows, d_run, np.asarray(src_offsets) // unit,
                     np.asarray(dst_offsets) // unit, counts, non_blocking)
        return
    if s_run:
        rows = s2[int(srows[0]) : int(srows[0]) + len(srows)]
    else:
        rows = s2.index_select(0, _index(torch, srows, s2.device))
    if rows.device != d2.device:  # into host memory: a finished copy (index_copy_ reads it at once)
        rows = rows.to(d2.device, non_blocking=d2.device.type != "cpu")
    if d_run:
        d2[int(drows[0]) : int(drows[0]) + len(drows)].copy_(rows, non_blocking=non_blocking)
    else:
        d2.index_copy_(0, _index(torch, drows, d2.device), rows)


def _index(torch: Any, rows: np.ndarray, device: Any) -> Any:
    """Row indices as an int64 tensor on ``device`` (a host-to-device copy
    from pageable memory: torch has copied it out before this returns)."""
    return torch.from_numpy(rows).to(device, non_blocking=True)


def _copy_direct(torch: Any, s2: Any, srows: np.ndarray, s_run: bool, d2: Any, drows: np.ndarray, d_run: bool,
                 s_starts: np.ndarray, d_starts: np.ndarray, counts: np.ndarray, non_blocking: bool) -> None:
    """Every byte read once and written once, on one device: no temporary of the ranges' size."""
    if d_run:
        out = d2[int(drows[0]) : int(drows[0]) + len(drows)]
        torch.index_select(s2, 0, _index(torch, srows, s2.device), out=out)
    elif s_run:
        d2.index_copy_(0, _index(torch, drows, d2.device), s2[int(srows[0]) : int(srows[0]) + len(srows)])
    else:  # scattered on both sides: one batched copy over the ranges' views
        s_list = [s2[a : a + n] for a, n in zip(s_starts.tolist(), counts.tolist())]
        d_list = [d2[a : a + n] for a, n in zip(d_starts.tolist(), counts.tolist())]
        torch._foreach_copy_(d_list, s_list, non_blocking=non_blocking)


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
