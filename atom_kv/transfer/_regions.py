"""Registered-region bookkeeping and bulk (numpy) op handling shared by the
tcp and cma backends: region tables, op arrays, vectorised merge and bounds
checks, and the default-config fallback."""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from atom_kv.transfer.base import MAX_REGION_BYTES, ReadFailure, ReadHandle, ReadRefusal, chunk_sizes
from atom_kv.transfer.memory import HOST, MemoryKind

if TYPE_CHECKING:
    from atom_kv.config import KVTransferConfig

__all__ = [
    "RegionTable",
    "as_op_array",
    "merge_op_array",
    "out_of_bounds",
    "resolve_config",
    "split_large",
]

#: columns of an op array, same order as :class:`ReadOp`
LOCAL_REGION, LOCAL_OFFSET, REMOTE_REGION, REMOTE_OFFSET, SIZE = range(5)


def resolve_config(config: Optional["KVTransferConfig"]) -> "KVTransferConfig":
    """The given config, or the defaults when running without one."""
    if config is not None:
        return config
    from atom_kv.config import KVTransferConfig

    return KVTransferConfig(kv_role="kv_producer")


class RegionTable:
    """Registered regions of this process: id -> (address, size, memory), a
    writable memoryview per host region and, for *staged* regions (GPU
    memory, or host memory when staging is forced for tests), a copier and
    the staging pool (``atom_kv.transfer.staging``). Ids are dense, starting
    at 0. ``staging_pairs`` is the pool's number of rings, ``staging_bytes``
    the size of each buffer and ``staging_buffers`` the buffers of a ring
    (``staging.pool_pairs``, ``staging.piece_bytes``, ``staging.ring_buffers``)."""

    def __init__(self, staging_pairs: int = 2, staging_bytes: Optional[int] = None,
                 staging_buffers: Optional[int] = None) -> None:
        self._lock = threading.Lock()
        self.addrs = np.zeros(0, dtype=np.uint64)
        self.sizes = np.zeros(0, dtype=np.uint64)
        self.staged = np.zeros(0, dtype=bool)
        self._views: list[Optional[memoryview]] = []
        self._memory: list[MemoryKind] = []
        self._copiers: dict[int, Any] = {}
        self._staging_pairs = staging_pairs
        self._staging_bytes = staging_bytes
        self._staging_buffers = staging_buffers
        self.pool: Any = None

    def __len__(self) -> int:
        return len(self._views)

    def add(self, ptr: int, size: int, align: int, limit: int = MAX_REGION_BYTES, *,
            memory: MemoryKind = HOST, staged: bool = False, host_copier: Any = None) -> list[int]:
        """Register ``size`` bytes at ``ptr`` as chunks; returns the new ids.
        GPU memory is always staged and never gets a memoryview (its address
        is not a host address). ``host_copier``: the copier of staged host
        memory (a FAKE device copier in tests and the bench), on first use."""
        if not isinstance(ptr, int) or ptr <= 0:
            raise ValueError(f"register_memory: ptr must be a positive address, got {ptr!r}")
        sizes = chunk_sizes(size, align, limit)
        staged = staged or memory.is_gpu
        copier = None
        if staged:
            from atom_kv.transfer.staging import StagingPool, copier_for

            copier = copier_for(memory, self._copiers, host_copier)
            if self.pool is None:
                sized = {} if self._staging_bytes is None else {"nbytes": self._staging_bytes}
                if self._staging_buffers is not None:
                    sized["buffers"] = self._staging_buffers
                self.pool = StagingPool(copier, self._staging_pairs, **sized)
        with self._lock:
            first = len(self._views)
            addrs = []
            off = 0
            for n in sizes:
                addrs.append(ptr + off)
                view = None if memory.is_gpu else memoryview((ctypes.c_char * n).from_address(ptr + off)).cast("B")
                self._views.append(view)
                self._memory.append(memory)
                off += n
            self.addrs = np.concatenate([self.addrs, np.asarray(addrs, dtype=np.uint64)])
            self.sizes = np.concatenate([self.sizes, np.asarray(sizes, dtype=np.uint64)])
            self.staged = np.concatenate([self.staged, np.full(len(sizes), staged)])
            return list(range(first, first + len(sizes)))

    def any_staged(self, regions: np.ndarray) -> bool:
        """Whether any of ``regions`` (bounds-checked ids) goes through staging."""
        return self.pool is not None and bool(self.staged[regions].any())

    def addresses(self, regions: np.ndarray) -> np.ndarray:
        """The address of each of ``regions`` (bounds-checked ids), as int64."""
        return self.addrs.view(np.int64).take(regions)

    def kv_written(self) -> None:
        """Mark the engine's writes so far written, for every copier's gathers."""
        for copier in list(self._copiers.values()):
            copier.kv_written()

    def copier(self, region: int) -> Any:
        from atom_kv.transfer.staging import copier_for

        return copier_for(self._memory[region], self._copiers)

    def view(self, region: int) -> memoryview:
        """The host memoryview of ``region``; staged (GPU) memory has none: its callers go through staging."""
        view = self._views[region]
        if view is None:
            raise RuntimeError(f"region {region} is GPU memory, which has no host view; it is read through staging")
        return view

    def views(self, regions: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> list[memoryview]:
        """Memoryviews of ``[offset, offset+size)`` in each region, in order
        (ranges must already be bounds-checked, and none staged: see :meth:`any_staged`)."""
        starts = offsets.tolist()
        ends = (offsets + sizes).tolist()
        if len(regions) and bool((regions == regions[0]).all()):
            mv = self.view(int(regions[0]))
            return [mv[a:b] for a, b in zip(starts, ends)]
        view = self.view
        return [view(r)[a:b] for r, a, b in zip(regions.tolist(), starts, ends)]

    def spans(self) -> list[tuple[int, int, int]]:
        with self._lock:
            return [(i, int(a), int(s)) for i, (a, s) in enumerate(zip(self.addrs, self.sizes))]

    def clear(self) -> None:
        with self._lock:
            self._views = []
            self._memory = []
            self.staged = np.zeros(0, dtype=bool)
            self.addrs = np.zeros(0, dtype=np.uint64)
            self.sizes = np.zeros(0, dtype=np.uint64)


def as_op_array(ops: Any) -> np.ndarray:
    """``ops`` (a sequence of :class:`ReadOp` or an ``(n, 5)`` integer array
    with the ReadOp columns) as a C-contiguous int64 array of shape (n, 5)."""
    if isinstance(ops, np.ndarray):
        arr = np.ascontiguousarray(ops, dtype=np.int64)
    else:
        arr = np.array(ops, dtype=np.int64) if len(ops) else np.zeros((0, 5), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 5:
        raise ValueError(f"read ops must be ReadOp tuples or an (n, 5) array, got shape {arr.shape}")
    return arr


def merge_op_array(arr: np.ndarray) -> np.ndarray:
    """Vectorised :func:`merge_ops`: drop empty ops, sort, merge ops that are
    contiguous on both sides. Same result as ``merge_ops`` (as an array)."""
    arr = arr[arr[:, SIZE] > 0]
    if len(arr) <= 1:
        return arr.copy()
    arr = arr[_sort_order(arr)]
    prev, nxt = arr[:-1], arr[1:]
    joins = (
        (prev[:, LOCAL_REGION] == nxt[:, LOCAL_REGION])
        & (prev[:, REMOTE_REGION] == nxt[:, REMOTE_REGION])
        & (prev[:, LOCAL_OFFSET] + prev[:, SIZE] == nxt[:, LOCAL_OFFSET])
        & (prev[:, REMOTE_OFFSET] + prev[:, SIZE] == nxt[:, REMOTE_OFFSET])
    )
    if not joins.any():
        return arr
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    out = arr[starts].copy()
    out[:, SIZE] = np.add.reduceat(arr[:, SIZE], starts)
    return out


def _sort_order(arr: np.ndarray) -> np.ndarray:
    """Stable order by (remote region, local region, remote offset, local offset)."""
    lo, hi = int(arr.min()), int(arr.max())
    if lo >= 0 and hi < (1 << 31):
        # pack two 31-bit columns per key: 2 sort keys instead of 4
        regions = (arr[:, REMOTE_REGION] << 32) | arr[:, LOCAL_REGION]
        offsets = (arr[:, REMOTE_OFFSET] << 32) | arr[:, LOCAL_OFFSET]
        if bool((regions == regions[0]).all()):
            if bool((offsets[1:] >= offsets[:-1]).all()):
                return np.arange(len(arr))
            return np.argsort(offsets, kind="stable")
        return np.lexsort((offsets, regions))
    return np.lexsort((arr[:, LOCAL_OFFSET], arr[:, REMOTE_OFFSET], arr[:, LOCAL_REGION], arr[:, REMOTE_REGION]))


def out_of_bounds(regions: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, table_sizes: np.ndarray) -> Optional[int]:
    """Index of the first range not inside its region (or with a negative or
    unknown field), else None. All inputs are int64 arrays except
    ``table_sizes`` (uint64 region sizes)."""
    n_regions = len(table_sizes)
    bad = (regions < 0) | (regions >= n_regions) | (offsets < 0) | (sizes <= 0)
    safe_regions = np.where(bad, 0, regions)
    limit = table_sizes.astype(np.int64)[safe_regions] if n_regions else np.zeros(len(regions), np.int64)
    bad |= offsets + sizes > limit
    bad |= offsets + sizes < offsets  # overflow
    if bad.any():
        return int(np.flatnonzero(bad)[0])
    return None


def split_large(arr: np.ndarray, piece: int) -> np.ndarray:
    """Split every op larger than ``piece`` bytes into ``piece``-sized ops."""
    if len(arr) == 0 or int(arr[:, SIZE].max()) <= piece:
        return arr
    counts = (arr[:, SIZE] + piece - 1) // piece
    rep = np.repeat(np.arange(len(arr)), counts)
    out = arr[rep].copy()
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    within = np.arange(len(out)) - np.repeat(first, counts)
    shift = within * piece
    out[:, LOCAL_OFFSET] += shift
    out[:, REMOTE_OFFSET] += shift
    out[:, SIZE] = np.minimum(arr[rep, SIZE] - shift, piece)
    return out



def begin_read(
    what: str, ops: Any, local_sizes: np.ndarray, *, refusal: Optional[ReadRefusal]
) -> tuple[ReadHandle, Optional[np.ndarray]]:
    """The prologue every host-memory backend's ``read()`` shares: normalise
    and merge ``ops``, make the handle, and finish it at once when ``refusal``
    is set (closed backend, unknown peer), when there is nothing to read, or
    when a local range is outside our registered regions. Returns the merged
    ``(n, 5)`` table, or ``None`` when the handle is already finished."""
    table = merge_op_array(as_op_array(ops))
    handle = ReadHandle(nbytes=int(table[:, 4].sum()) if len(table) else 0, num_ranges=len(table))
    if refusal is not None:
        handle._finish(f"{what}: {refusal.text}", refusal.reason)
        return handle, None
    if len(table) == 0:
        handle._finish(None)
        return handle, None
    bad = out_of_bounds(table[:, 0], table[:, 1], table[:, 4], local_sizes)
    if bad is not None:
        lr, lo, _, _, sz = (int(x) for x in table[bad])
        handle._finish(f"{what}: local range (region {lr}, offset {lo}, size {sz}) is outside the registered regions",
                       ReadFailure.OUT_OF_BOUNDS)
        return handle, None
    return handle, table
