"""One ``gpu_ipc`` read planned in one vectorised pass over its ops.

A read names ``(local region, local offset, remote region, remote offset,
size)`` rows. :func:`plan_read` turns them, with a handful of numpy calls
whatever their number, into pointer arrays for one batched copy per pair of
devices (usually one):

- bounds: every row inside its local region and inside the peer's granted
  region (a negative or unknown field is out of bounds);
- pointers: ``local base + offset`` and ``remote base + offset``, as this
  process sees both (the peer's regions are mapped here once, at add_peer);
- runs: rows that continue each other on both sides, in the order given,
  are coalesced into one range (pointers, so consecutive regions of one
  buffer coalesce too); the merge runs only where a row continues the one
  before it. Rows are not sorted: the connector gives blocks in order, and
  a sort of rows that are scattered on both sides finds nothing to merge.

No torch object is made per range, nor per read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

__all__ = ["Batch", "OutOfBounds", "PairTable", "ReadPlan", "Spans", "as_rows", "plan_read"]


@dataclass(frozen=True)
class Spans:
    """The regions of one side as this process addresses them: ``base``,
    ``size`` and ``device`` per region (int64 arrays), and ``device_of_all``
    when every region lives on one device (else None)."""

    base: np.ndarray
    size: np.ndarray
    device: np.ndarray
    device_of_all: Optional[int]

    @classmethod
    def of(cls, bases: Sequence[int], sizes: Sequence[int], devices: Sequence[int]) -> "Spans":
        device = np.asarray(devices, dtype=np.int64)
        one = int(device[0]) if len(device) and bool((device == device[0]).all()) else None
        return cls(np.asarray(bases, dtype=np.int64), np.asarray(sizes, dtype=np.int64), device,
                   one if len(device) else None)

    def __len__(self) -> int:
        return len(self.base)


@dataclass(frozen=True)
class Batch:
    """One batched copy from ``src_device`` to ``dst_device``: ``dst``,
    ``src`` and ``size`` per range (int64 arrays of addresses and bytes,
    possibly strided views: a seam that needs them packed packs them)."""

    dst_device: int
    src_device: int
    dst: np.ndarray
    src: np.ndarray
    size: np.ndarray


@dataclass(frozen=True)
class OutOfBounds:
    """The first row outside its region: which side, and the row's fields."""

    local: bool
    row: tuple[int, int, int, int, int]

    def message(self, what: str, peer_id: str) -> str:
        lr, lo, rr, ro, sz = self.row
        if self.local:
            return f"{what}: local range (region {lr}, offset {lo}, size {sz}) is outside the registered regions"
        return (f"{what}: remote range (region {rr}, offset {ro}, size {sz}) is outside the regions peer "
                f"{peer_id} registered")


@dataclass(frozen=True)
class ReadPlan:
    """What one read copies: its batches (one per device pair), its bytes and its ranges after coalescing."""

    batches: list[Batch]
    nbytes: int
    ranges: int


def as_rows(ops: Any) -> np.ndarray:
    """``ops`` (ReadOps or an ``(n, 5)`` integer array) as an int64 ``(n, 5)`` array."""
    if isinstance(ops, np.ndarray):
        arr = ops if ops.dtype == np.int64 and ops.flags.c_contiguous else np.ascontiguousarray(ops, dtype=np.int64)
    else:
        arr = np.array(ops, dtype=np.int64) if len(ops) else np.zeros((0, 5), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 5:
        raise ValueError(f"read ops must be ReadOp tuples or an (n, 5) array, got shape {arr.shape}")
    return arr


class PairTable:
    """What a read between this process and one peer looks up: both sides'
    :class:`Spans`, and for each side the size all its regions share (the
    bounds check is then one maximum per side, no lookup per row), or None."""

    __slots__ = ("local", "remote", "local_size", "remote_size")

    def __init__(self, local: Spans, remote: Spans) -> None:
        self.local, self.remote = local, remote
        self.local_size, self.remote_size = _shared_size(local), _shared_size(remote)


def _shared_size(spans: Spans) -> Optional[int]:
    if len(spans) and bool((spans.size == spans.size[0]).all()):
        return int(spans.size[0])
    return None


def _outside(regions: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, spans: Spans) -> np.ndarray:
    """Per row: not inside its region (a negative or unknown region, a negative offset, past the end)."""
    bad = (regions < 0) | (regions >= len(spans)) | (offsets < 0)
    limit = spans.size.take(regions, mode="clip") - sizes  # the largest offset that still fits
    bad |= offsets > limit
    return bad


def _first_outside(cols: np.ndarray, table: PairTable) -> Optional[OutOfBounds]:
    """The first row out of bounds, local side first (the slow path, for a read refused)."""
    sz = cols[4]
    for is_local, regions, offsets, spans in ((True, cols[0], cols[1], table.local),
                                              (False, cols[2], cols[3], table.remote)):
        bad = _outside(regions, offsets, sz, spans)
        if bad.any():
            i = int(bad.argmax())
            lr, lo, rr, ro, size = (int(x) for x in cols[:, i])
            return OutOfBounds(is_local, (lr, lo, rr, ro, size))
    return None


def plan_read(ops: Any, table: PairTable) -> tuple[Optional[ReadPlan], Optional[OutOfBounds]]:
    """The plan of a read of ``ops`` between the two sides of ``table`` (see the module's
    docstring), or the first row out of bounds. Rows of size 0 or less carry nothing and
    are dropped. About a dozen numpy calls on contiguous rows, whatever the number of ops."""
    arr = as_rows(ops)
    if len(arr) == 0:
        return ReadPlan([], 0, 0), None
    cols = arr.T.copy()  # one row per field: every call below runs over contiguous memory
    low = cols.min(axis=1).tolist()
    if low[4] <= 0:  # rows that carry nothing are dropped
        cols = cols[:, cols[4] > 0]
        if cols.shape[1] == 0:
            return ReadPlan([], 0, 0), None
        low = cols.min(axis=1).tolist()
    lr, lo, rr, ro, size = cols
    local, remote = table.local, table.remote
    if min(low[:4]) < 0:
        return None, _first_outside(cols, table)
    try:  # an unknown region id raises here (negative ones were refused above)
        dst = local.base.take(lr)
        src = remote.base.take(rr)
    except IndexError:
        return None, _first_outside(cols, table)
    # the end of every row, as unsigned: offset + size of two non-negative int64 never wraps there
    ends = cols[1:4:2].view(np.uint64) + size.view(np.uint64)
    if table.local_size is not None and table.remote_size is not None:  # one maximum per side
        end_local, end_remote = ends.max(axis=1).tolist()
        inside = end_local <= table.local_size and end_remote <= table.remote_size
    else:
        inside = bool((ends[0] <= local.size.take(lr).view(np.uint64)).all()) and \
            bool((ends[1] <= remote.size.take(rr).view(np.uint64)).all())
    if not inside:
        return None, _first_outside(cols, table)
    dst += lo
    src += ro
    starts = _run_starts(dst, src, size) if len(size) > 1 else None
    if starts is None:
        nbytes = int(size.sum())
    elif len(starts) == 1:  # one run: contiguous on both sides
        nbytes = int(size.sum())
        dst, src, size = dst[:1], src[:1], np.array([nbytes], dtype=np.int64)
    else:
        dst, src, size = dst[starts], src[starts], np.add.reduceat(size, starts)
        nbytes = int(size.sum())
    if local.device_of_all is not None and remote.device_of_all is not None:
        batches = [Batch(local.device_of_all, remote.device_of_all, dst, src, size)]
    else:  # regions on several GPUs: the devices of each run's first row (a run never crosses devices)
        dst_dev, src_dev = local.device.take(lr), remote.device.take(rr)
        if starts is not None:
            dst_dev, src_dev = dst_dev[starts], src_dev[starts]
        batches = _by_devices(dst, src, size, dst_dev, src_dev)
    return ReadPlan(batches, nbytes, len(size)), None


def _run_starts(dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> Optional[np.ndarray]:
    """Where each run starts, a run being rows that continue the row before on both sides (in
    the order given); None when no row continues the one before it (nothing to merge)."""
    head = size[:-1]
    joins = (dst[:-1] + head) == dst[1:]
    if not joins.any():  # scattered destinations: nothing merges, the source is not looked at
        return None
    joins &= (src[:-1] + head) == src[1:]
    if joins.all():
        return _FIRST
    if not joins.any():
        return None
    return np.flatnonzero(np.concatenate(([True], ~joins)))


_FIRST = np.zeros(1, dtype=np.int64)  # one run, starting at row 0 (never written)


def _by_devices(dst: np.ndarray, src: np.ndarray, size: np.ndarray, dst_dev: np.ndarray,
                src_dev: np.ndarray) -> list[Batch]:
    """Ranges grouped by (destination device, source device): one batch each."""
    key = dst_dev * (1 << 32) + src_dev
    out = []
    for k in np.unique(key):
        m = key == k
        out.append(Batch(int(k >> 32), int(k & 0xFFFFFFFF), dst[m], src[m], size[m]))
    return out
