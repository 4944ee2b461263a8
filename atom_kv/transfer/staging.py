"""Staged transfers: registered memory a socket cannot touch (GPU memory) goes
through host staging buffers, pipelined so device copies overlap the socket.

The device work sits behind a small *copier* seam:

- :class:`HostCopier` runs the whole staging path on CPU tensors (its
  "device copies" are plain CPU copies, done at once). The CPU suite uses it
  (``TcpBackend.stage_host_memory``) to cover everything below but the
  device copies themselves.
- :class:`DeviceCopier` does the same on one GPU, on its own stream, into
  pinned host buffers; :meth:`fence` records a blocking-sync event that
  :meth:`wait` sleeps on. Its gathers wait for the engine's written event
  (:meth:`DeviceCopier.kv_written`, recorded on the engine's stream where
  its KV counts as written), so they never read blocks still being written.

Every region goes through its own copier: a piece that mixes host and GPU
regions, or regions on two GPUs, is gathered (and scattered) by each of them,
and every copier involved is fenced, on every path.

:class:`StagingPool` owns the buffers: allocated once, bounded, leased in
pairs (double buffering), so no user ever holds one and waits for another.
:func:`send_staged` (serving side) gathers each piece into a buffer while the
previous one is on the socket; :func:`recv_staged` (reading side) receives a
piece while the previous one is copied to the device.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import time
from typing import Any, Callable, Iterator, Optional, Protocol

import numpy as np

from atom_kv.transfer._batched_copy import copy_ranges, cut_pieces
from atom_kv.transfer._sockio import recv_views, send_views
from atom_kv.transfer.memory import MemoryKind

__all__ = ["DeviceCopier", "HostCopier", "STAGE_BYTES", "StagingPool", "copier_for", "recv_staged", "send_staged"]

#: bytes per staging buffer (one piece of a request) without a config (``staging_piece_bytes``)
STAGE_BYTES = 4 << 20


class _CudaArray:
    """``__cuda_array_interface__`` over registered device bytes, so torch can
    alias them as a uint8 tensor without copying (ROCm builds of torch read it too)."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class HostCopier:
    """The copier for host memory: registered bytes and staging buffers are
    CPU tensors and every copy is done when the call returns."""

    device: Optional[int] = None

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def region(self, ptr: int, size: int, view: Optional[memoryview] = None) -> Any:
        """A uint8 tensor aliasing ``size`` registered bytes at ``ptr``."""
        import ctypes

        buf = view if view is not None else memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")
        return self._torch.frombuffer(buf, dtype=self._torch.uint8)

    def staging(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8)

    def stream(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def scratch(self, buf: Any, n: int) -> Any:
        """Where a piece is assembled: the staging buffer itself on the host."""
        return buf[:n]

    def download(self, scratch: Any, buf: Any, n: int) -> None:
        """Move an assembled piece into the staging buffer (nothing to do here)."""

    def packed(self, n: int) -> Any:
        """Where this copier packs its share of a piece that mixes copiers."""
        return self._torch.empty(n, dtype=self._torch.uint8)

    def download_ranges(self, scratch: Any, packed: np.ndarray, buf: Any, positions: np.ndarray,
                        sizes: np.ndarray) -> None:
        """Move a packed share of a mixed piece to its places in the staging buffer."""
        copy_ranges(scratch, packed, buf, positions, sizes)

    def kv_written(self) -> None:
        """The engine's writes so far count as written (host writes already are)."""

    def after_written(self) -> None:
        """Order the work queued next after the engine's written writes (nothing to order here)."""

    def upload(self, buf: Any, n: int) -> Any:
        """The received piece where the scatter reads it from."""
        return buf[:n]

    def fence(self) -> Any:
        return None

    def wait(self, token: Any) -> None:
        """Block until the copies before ``token`` finished (they already have)."""


class DeviceCopier(HostCopier):
    """The copier for GPU ``device``: its own stream, pinned staging buffers,
    an event per piece."""

    def __init__(self, device: int) -> None:
        super().__init__()
        torch = self._torch
        self.device = device
        self._device = torch.device("cuda", device)
        self._stream = torch.cuda.Stream(self._device)
        self._written: Any = None

    def region(self, ptr: int, size: int, view: Optional[memoryview] = None) -> Any:
        return self._torch.as_tensor(_CudaArray(ptr, size), device=self._device)

    def staging(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)

    def stream(self) -> contextlib.AbstractContextManager:
        return self._torch.cuda.stream(self._stream)

    def scratch(self, buf: Any, n: int) -> Any:
        return self._torch.empty(n, dtype=self._torch.uint8, device=self._device)

    def packed(self, n: int) -> Any:
        return self._torch.empty(n, dtype=self._torch.uint8, device=self._device)

    def kv_written(self) -> None:
        """Record the written event on the engine's current stream of this GPU
        (call from the engine's thread): gathers queued later wait for it."""
        event = self._torch.cuda.Event(blocking=True)
        event.record(self._torch.cuda.current_stream(self._device))
        self._written = event

    def after_written(self) -> None:
        """This copier's stream waits for the last written event (gathers
        never read blocks the engine's stream is still writing)."""
        written = self._written
        if written is not None:
            self._stream.wait_event(written)

    def download(self, scratch: Any, buf: Any, n: int) -> None:
        buf[:n].copy_(scratch, non_blocking=True)

    def upload(self, buf: Any, n: int) -> Any:
        return buf[:n].to(self._device, non_blocking=True)

    def fence(self) -> Any:
        event = self._torch.cuda.Event(blocking=True)  # a wait on it sleeps, no core spins
        event.record(self._stream)
        return event

    def wait(self, token: Any) -> None:
        if token is not None:
            token.synchronize()


def copier_for(memory: MemoryKind, cache: dict[int, HostCopier]) -> HostCopier:
    """The copier of ``memory`` (one per device, kept in ``cache``)."""
    key = memory.device if memory.is_gpu else -1
    copier = cache.get(key)
    if copier is None:
        copier = cache[key] = DeviceCopier(memory.device) if memory.is_gpu else HostCopier()
    return copier


class StagingPool:
    """Owns ``pairs`` pairs of ``nbytes`` staging buffers, allocated once
    (pinned when a GPU is involved). :meth:`lease` hands out one pair,
    waiting until ``deadline`` for one to come back."""

    def __init__(self, copier: HostCopier, pairs: int, nbytes: int = STAGE_BYTES) -> None:
        self.nbytes = nbytes
        self.pairs = pairs
        self._free: "queue.Queue[tuple[Any, Any]]" = queue.Queue()
        for _ in range(pairs):
            self._free.put((copier.staging(nbytes), copier.staging(nbytes)))

    @contextlib.contextmanager
    def lease(self, deadline: float) -> Iterator[tuple[Any, Any]]:
        try:
            pair = self._free.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("no staging buffer came free before the deadline") from None
        try:
            yield pair
        finally:
            self._free.put(pair)


class StagedRegions(Protocol):
    """What staged transfers need of a region table
    (:class:`~atom_kv.transfer._regions.RegionTable`): each region's tensor
    alias and copier, and the pool."""

    pool: StagingPool

    def tensor(self, region: int) -> Any: ...

    def copier(self, region: int) -> HostCopier: ...


def _host_view(buf: Any, n: int) -> memoryview:
    return memoryview(buf[:n].numpy()).cast("B")


def _pieces(regions: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, chunk: int):
    for index, offs, lens in cut_pieces(offsets, sizes, chunk):
        yield regions[index], offs, lens


def _by_copier(staged: StagedRegions, regions: np.ndarray) -> list[tuple[HostCopier, np.ndarray]]:
    """The piece's ranges grouped by the copier of their region (a request may
    mix host and GPU regions, or regions on two GPUs): (copier, mask) each."""
    out: dict[int, tuple[HostCopier, np.ndarray]] = {}
    for r in np.unique(regions):
        copier = staged.copier(int(r))
        m = regions == r
        if id(copier) in out:
            out[id(copier)] = (copier, out[id(copier)][1] | m)
        else:
            out[id(copier)] = (copier, m)
    return list(out.values())


def _assemble(staged: StagedRegions, regions: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
              buf: Any) -> list[tuple[HostCopier, Any]]:
    """Gather one piece into ``buf``, each region by its own copier (one
    batched copy per region); returns a fence of every copier involved."""
    n = int(sizes.sum())
    positions = np.cumsum(sizes) - sizes
    fences: list[tuple[HostCopier, Any]] = []
    with _settle_on_error(fences):
        for copier, mine in _by_copier(staged, regions):
            with copier.stream(), _fenced(copier, fences):
                copier.after_written()
                _gather(staged, copier, mine, regions, offsets, sizes, positions, buf, n)
    return fences


def _gather(staged: StagedRegions, copier: HostCopier, mine: np.ndarray, regions: np.ndarray, offsets: np.ndarray,
            sizes: np.ndarray, positions: np.ndarray, buf: Any, n: int) -> None:
    """One copier's share of :func:`_assemble`."""
    if mine.all():  # the common case: one copier, assembled in its scratch, moved in one copy
        scratch = copier.scratch(buf, n)
        for r in np.unique(regions):
            m = regions == r
            copy_ranges(staged.tensor(int(r)), offsets[m], scratch, positions[m], sizes[m])
        copier.download(scratch, buf, n)
    else:  # a mixed piece: this copier's ranges, packed, then to their places in the buffer
        packed = np.cumsum(sizes[mine]) - sizes[mine]
        scratch = copier.packed(int(sizes[mine].sum()))
        regs, offs, lens = regions[mine], offsets[mine], sizes[mine]
        for r in np.unique(regs):
            m = regs == r
            copy_ranges(staged.tensor(int(r)), offs[m], scratch, packed[m], lens[m])
        copier.download_ranges(scratch, packed, buf, positions[mine], lens)


def _spread(staged: StagedRegions, regions: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
            buf: Any) -> list[tuple[HostCopier, Any]]:
    """Scatter one received piece from ``buf`` to its regions, each region by
    its own copier; returns a fence of every copier involved."""
    n = int(sizes.sum())
    positions = np.cumsum(sizes) - sizes
    fences: list[tuple[HostCopier, Any]] = []
    with _settle_on_error(fences):
        for copier, mine in _by_copier(staged, regions):
            with copier.stream(), _fenced(copier, fences):
                src = copier.upload(buf, n)
                regs, offs, lens, pos = regions[mine], offsets[mine], sizes[mine], positions[mine]
                for r in np.unique(regs):
                    m = regs == r
                    copy_ranges(src, pos[m], staged.tensor(int(r)), offs[m], lens[m])
    return fences


@contextlib.contextmanager
def _fenced(copier: HostCopier, fences: list[tuple[HostCopier, Any]]) -> Iterator[None]:
    """Whatever happens inside, a fence after the copier's queued work."""
    try:
        yield
    finally:
        fences.append((copier, copier.fence()))


@contextlib.contextmanager
def _settle_on_error(fences: list[tuple[HostCopier, Any]]) -> Iterator[None]:
    """On an error, wait for the copies already queued before raising: the
    buffer goes back to the pool only once no device still touches it."""
    try:
        yield
    except BaseException:
        _wait_all(fences)
        raise


def _wait_all(fences: list[tuple[HostCopier, Any]]) -> None:
    for copier, token in fences:
        copier.wait(token)


def send_staged(sock: socket.socket, staged: StagedRegions, regions: np.ndarray, offsets: np.ndarray,
                sizes: np.ndarray, deadline: float) -> None:
    """Send the ranges' bytes in order, gathering piece i+1 while piece i is on the socket."""
    with staged.pool.lease(deadline) as pair:
        pending: Optional[tuple[Any, Any, int]] = None  # assembled (maybe still on the device), not yet sent
        try:
            for i, (regs, offs, lens) in enumerate(_pieces(regions, offsets, sizes, staged.pool.nbytes)):
                buf = pair[i % 2]  # its previous piece (i - 2) is on the socket already
                previous, pending = pending, (buf, _assemble(staged, regs, offs, lens, buf), int(lens.sum()))
                if previous is not None:
                    _send_piece(sock, previous, deadline)
            last, pending = pending, None
            if last is not None:
                _send_piece(sock, last, deadline)
        finally:
            if pending is not None:  # an error: the buffer goes back only once the device let go of it
                _wait_all(pending[1])


def _send_piece(sock: socket.socket, piece: tuple[Any, Any, int], deadline: float) -> None:
    buf, fences, n = piece
    _wait_all(fences)
    send_views(sock, [_host_view(buf, n)], np.array([n], dtype=np.int64), deadline)


def recv_staged(sock: socket.socket, staged: StagedRegions, regions: np.ndarray, offsets: np.ndarray,
                sizes: np.ndarray, deadline: float, should_stop: Optional[Callable[[], bool]] = None) -> None:
    """Receive the ranges' bytes in order, receiving piece i+1 while piece i is
    copied to its regions. Returns (or raises) only once no copy is in
    flight, so the destination is settled either way."""
    with staged.pool.lease(deadline) as pair:
        fences: list[Any] = []
        try:
            for i, (regs, offs, lens) in enumerate(_pieces(regions, offsets, sizes, staged.pool.nbytes)):
                buf = pair[i % 2]
                if len(fences) == 2:  # this buffer's previous piece must be on the device before it is reused
                    _wait_all(fences.pop(0))
                n = int(lens.sum())
                recv_views(sock, [_host_view(buf, n)], np.array([n], dtype=np.int64), deadline, should_stop)
                fences.append(_spread(staged, regs, offs, lens, buf))
        finally:
            for piece in fences:
                _wait_all(piece)
