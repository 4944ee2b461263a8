"""Staged transfers: registered memory a socket cannot touch (GPU memory) goes
through host staging buffers, pipelined so device copies overlap the socket.

Two device copies per byte, no more: the serving side copies straight from
the registered ranges into a pinned staging buffer (a *gather*), the reader
straight from its pinned buffer into the destination ranges (a *scatter*).
Both are batched copies by address (:mod:`atom_kv.transfer._device_copy`:
``cuMemcpyBatchAsync`` where the driver has it), with no scratch buffer and
no temporary on the device.

The device work sits behind a small *copier* seam, one per memory kind:

- :class:`HostCopier` runs the whole staging path on host memory (its
  "device copies" are host copies, done at once). The CPU suite uses it
  (``TcpBackend.stage_host_memory``) to cover everything below but the
  device copies themselves; the test scaffolding's fake copier adds a
  FAKE device copier whose fences complete only after a set delay.
- :class:`DeviceCopier` does the same on one GPU into pinned buffers. Its
  gathers wait for the engine's written event (:meth:`DeviceCopier.kv_written`,
  recorded on the engine's stream where its KV counts as written), so they
  never read blocks still being written.

:class:`StagingPool` owns the buffers: allocated once, bounded, leased as
*rings* of ``staging.ring_buffers`` buffers of ``staging.piece_bytes``. A
ring carries, per copier, its own *lane*: a stream and one fence event per
buffer, made once (:class:`DeviceLane`), so one connection's copies never
queue behind another's and no event is made per piece.

- :func:`send_staged` (serving side) gathers up to a ring's worth of pieces
  ahead and sends each once its gather is complete.
- :class:`StagedReceiver` (reading side, one per connection) receives a
  piece into the next buffer of its ring while the pieces before are
  scattered, and waits only when a buffer is about to be reused. It keeps
  its ring from one job to the next: the last pieces of a job are still
  being scattered while the next job's first pieces arrive, and the job is
  reported complete (its ``on_settled``) once they are.

Every region goes through its own copier: a piece that mixes host and GPU
regions, or regions on two GPUs, is gathered (and scattered) by each of
them, and every lane involved is fenced, on every path.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import socket
import time
from typing import Any, Callable, Iterator, Optional, Protocol

import numpy as np

from atom_kv.transfer._batched_copy import cut_pieces
from atom_kv.transfer._device_copy import coalesce, copy_by_address
from atom_kv.transfer._sockio import recv_views, send_views
from atom_kv.transfer.memory import MemoryKind

__all__ = ["DeviceCopier", "DeviceLane", "HostCopier", "HostLane", "RING_BUFFERS", "STAGE_BYTES", "StagedReceiver",
           "StagingPool", "StagingRing", "copier_for", "recv_staged", "send_staged"]

#: bytes per staging buffer (one piece of a request) without a config (``staging.piece_bytes``)
STAGE_BYTES = 1 << 20
#: buffers per ring without a config (``staging.ring_buffers``)
RING_BUFFERS = 4


class _CudaArray:
    """``__cuda_array_interface__`` over registered device bytes, so torch can
    alias them as a uint8 tensor without copying (ROCm builds of torch read it too)."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class HostLane:
    """One ring's copies through the host copier: each is complete when the call returns."""

    def after_written(self) -> None:
        """Order the copies queued next after the engine's written writes (host writes already are)."""

    def gather(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> None:
        """Registered ranges (``src``) into a staging buffer (``dst``), by address."""
        copy_by_address(dst, src, size)

    def scatter(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> None:
        """A staging buffer (``src``) into registered ranges (``dst``), by address."""
        copy_by_address(dst, src, size)

    def fence(self, slot: int) -> Any:
        """A token for the copies queued so far (``slot``: the buffer they fill or empty)."""
        return None

    def query(self, token: Any) -> bool:
        return True

    def wait(self, token: Any) -> None:
        """Block until the copies before ``token`` are complete (they already are)."""


class HostCopier:
    """The copier for host memory: registered bytes and staging buffers are
    host memory and every copy is done when the call returns."""

    device: Optional[int] = None

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def region(self, ptr: int, size: int, view: Optional[memoryview] = None) -> Any:
        """A uint8 tensor aliasing ``size`` registered bytes at ``ptr``."""
        buf = view if view is not None else memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")
        return self._torch.frombuffer(buf, dtype=self._torch.uint8)

    def staging(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8)

    def lane(self) -> Any:
        """A new lane for one ring (see :class:`StagingRing`)."""
        return HostLane()

    def kv_written(self) -> None:
        """The engine's writes so far count as written (host writes already are)."""


class DeviceLane(HostLane):
    """One ring's copies on GPU ``copier.device``: its own stream, one fence
    event per buffer of the ring (made on first use, re-recorded after), and
    batched copies by address (through torch, one copy per range, where the
    driver cannot be loaded)."""

    def __init__(self, copier: "DeviceCopier") -> None:
        torch = copier._torch
        self._torch = torch
        self._copier = copier
        self._device = copier.device
        self._stream = torch.cuda.Stream(copier._device)
        self._handle = int(self._stream.cuda_stream)
        self._events: dict[int, Any] = {}

    def after_written(self) -> None:
        written = self._copier._written
        if written is not None:  # gathers never read blocks the engine's stream is still writing
            self._stream.wait_event(written)

    def gather(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> None:
        self._copy(dst, src, size, dst_host=True)

    def scatter(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> None:
        self._copy(dst, src, size, dst_host=False)

    def _copy(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray, *, dst_host: bool) -> None:
        dst, src, size = coalesce(dst, src, size)
        addresses = self._copier.addresses()
        if addresses is not None:
            addresses.copy(self._handle, self._device, dst, src, size, dst_host=dst_host, src_host=not dst_host)
            return
        torch = self._torch
        device = self._copier._device

        def host(p: int, n: int) -> Any:
            return torch.frombuffer((ctypes.c_char * n).from_address(p), dtype=torch.uint8)

        def gpu(p: int, n: int) -> Any:
            return torch.as_tensor(_CudaArray(p, n), device=device)

        with torch.cuda.stream(self._stream):
            for d, s, n in zip(dst.tolist(), src.tolist(), size.tolist()):
                (host(d, n) if dst_host else gpu(d, n)).copy_(gpu(s, n) if dst_host else host(s, n), non_blocking=True)

    def fence(self, slot: int) -> Any:
        event = self._events.get(slot)
        if event is None:  # a blocking-sync event: a wait on it sleeps, no core spins
            event = self._events[slot] = self._torch.cuda.Event(enable_timing=False, blocking=True)
        event.record(self._stream)
        return event

    def query(self, token: Any) -> bool:
        return bool(token.query())

    def wait(self, token: Any) -> None:
        token.synchronize()


class DeviceCopier(HostCopier):
    """The copier for GPU ``device``: pinned staging buffers, a lane (stream
    and fence events) per ring, and the engine's written event."""

    def __init__(self, device: int) -> None:
        super().__init__()
        torch = self._torch
        self.device = device
        self._device = torch.device("cuda", device)
        self._written: Any = None
        self._addresses: Any = False  # the driver's batched copies (False: not looked for yet)

    def region(self, ptr: int, size: int, view: Optional[memoryview] = None) -> Any:
        return self._torch.as_tensor(_CudaArray(ptr, size), device=self._device)

    def staging(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)

    def lane(self) -> DeviceLane:
        return DeviceLane(self)

    def addresses(self) -> Any:
        if self._addresses is False:
            from atom_kv.transfer._device_copy import AddressCopier, driver_for_torch

            driver = driver_for_torch(self._torch)
            self._addresses = AddressCopier(driver) if driver is not None else None
        return self._addresses

    def kv_written(self) -> None:
        """Record the written event on the engine's current stream of this GPU
        (call from the engine's thread): gathers queued later wait for it. One
        event, re-recorded: a wait takes the event as it is when queued."""
        torch = self._torch
        if self._written is None:
            self._written = torch.cuda.Event(enable_timing=False, blocking=True)
        self._written.record(torch.cuda.current_stream(self._device))


def copier_for(memory: MemoryKind, cache: dict[int, HostCopier], host: Optional[HostCopier] = None) -> HostCopier:
    """The copier of ``memory`` (one per device, kept in ``cache``; ``host``: the one for host memory)."""
    key = memory.device if memory.is_gpu else -1
    copier = cache.get(key)
    if copier is None:
        copier = cache[key] = DeviceCopier(memory.device) if memory.is_gpu else (host or HostCopier())
    return copier


class StagingRing:
    """Owns nothing but its place in the pool: ``buffers`` (host tensors) leased
    together, their addresses, one lane per copier that used them, and per
    buffer the fences of the copies still in flight in it and who waits for
    them. ``waits`` counts the waits that blocked (a fence not yet complete)."""

    def __init__(self, buffers: list[Any]) -> None:
        self.buffers = buffers
        self.addresses = [int(b.data_ptr()) for b in buffers]
        self._lanes: dict[int, tuple[HostCopier, Any]] = {}
        self._fences: list[Optional[list[tuple[Any, Any]]]] = [None] * len(buffers)
        self._owners: list[Optional["_Settling"]] = [None] * len(buffers)
        self.cursor = 0
        self.waits = 0

    def __len__(self) -> int:
        return len(self.buffers)

    def lane(self, copier: HostCopier) -> Any:
        entry = self._lanes.get(id(copier))
        if entry is None:  # the copier is kept with its lane: its id is never reused meanwhile
            entry = self._lanes[id(copier)] = (copier, copier.lane())
        return entry[1]

    def next_slot(self) -> int:
        slot = self.cursor
        self.cursor = (slot + 1) % len(self.buffers)
        return slot

    def hold(self, slot: int, fences: list[tuple[Any, Any]], owner: Optional["_Settling"] = None) -> None:
        """``fences``: the copies now in flight in buffer ``slot``; ``owner`` is told once they are complete."""
        self._fences[slot] = fences
        self._owners[slot] = owner
        if owner is not None:
            owner.holding += 1

    def settle(self, slot: int) -> None:
        """Wait until nothing is in flight in buffer ``slot`` (it is about to be used)."""
        fences = self._fences[slot]
        if fences is None:
            return
        try:
            for lane, token in fences:
                if not lane.query(token):
                    self.waits += 1
                    lane.wait(token)
        finally:
            self._release(slot)

    def poll(self) -> None:
        """Release, without waiting, every buffer whose copies are complete."""
        for slot, fences in enumerate(self._fences):
            if fences is not None and all(lane.query(token) for lane, token in fences):
                self._release(slot)

    def drain(self) -> None:
        """Wait for every copy in flight (before the ring goes back to the pool, or on an error)."""
        for slot in range(len(self.buffers)):
            self.settle(slot)

    def busy(self) -> bool:
        return any(f is not None for f in self._fences)

    def _release(self, slot: int) -> None:
        owner = self._owners[slot]
        self._fences[slot] = self._owners[slot] = None
        if owner is not None:
            owner.released()


class _Settling:
    """One received job whose last scatters may still be in flight: ``on_settled``
    runs once, when it finished receiving and none of its buffers holds a copy."""

    __slots__ = ("holding", "received", "on_settled")

    def __init__(self, on_settled: Callable[[], None]) -> None:
        self.holding = 0
        self.received = False
        self.on_settled: Optional[Callable[[], None]] = on_settled

    def released(self) -> None:
        self.holding -= 1
        self._maybe_done()

    def finish_receiving(self) -> None:
        self.received = True
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self.received and self.holding == 0 and self.on_settled is not None:
            done, self.on_settled = self.on_settled, None
            done()


class StagingPool:
    """Owns ``rings`` rings (the ``pairs`` attribute, after the key
    ``staging.pool_pairs``) of ``buffers`` staging buffers of ``nbytes``
    each, allocated once (pinned when the first staged memory is a GPU's).
    :meth:`lease` hands out one ring, waiting until ``deadline`` for one to
    come back; :meth:`take` / :meth:`give` do the same for a lease that spans
    several jobs (:class:`StagedReceiver`)."""

    def __init__(self, copier: HostCopier, pairs: int, nbytes: int = STAGE_BYTES, buffers: int = RING_BUFFERS) -> None:
        self.nbytes = nbytes
        self.pairs = pairs
        self.buffers = buffers
        self._free: "queue.Queue[StagingRing]" = queue.Queue()
        for _ in range(pairs):
            self._free.put(StagingRing([copier.staging(nbytes) for _ in range(buffers)]))

    def take(self, deadline: float) -> StagingRing:
        try:
            return self._free.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("no staging buffer came free before the deadline") from None

    def give(self, ring: StagingRing) -> None:
        """Take a ring back once nothing is in flight in it."""
        ring.drain()
        self._free.put(ring)

    @contextlib.contextmanager
    def lease(self, deadline: float) -> Iterator[StagingRing]:
        ring = self.take(deadline)
        try:
            yield ring
        finally:
            self.give(ring)


class StagedRegions(Protocol):
    """What staged transfers need of a region table
    (:class:`~atom_kv.transfer._regions.RegionTable`): each region's address
    and copier, and the pool."""

    pool: StagingPool

    def addresses(self, regions: np.ndarray) -> np.ndarray: ...

    def copier(self, region: int) -> HostCopier: ...


def _host_view(buf: Any, n: int) -> memoryview:
    return memoryview(buf[:n].numpy()).cast("B")


def _pieces(regions: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, chunk: int):
    for index, offs, lens in cut_pieces(offsets, sizes, chunk):
        yield regions[index], offs, lens


def _by_copier(staged: StagedRegions, regions: np.ndarray) -> list[tuple[HostCopier, Optional[np.ndarray]]]:
    """The piece's ranges grouped by the copier of their region (a request may
    mix host and GPU regions, or regions on two GPUs): (copier, mask or None for all)."""
    first = int(regions[0])
    if bool((regions == first).all()):
        return [(staged.copier(first), None)]
    out: dict[int, tuple[HostCopier, np.ndarray]] = {}
    for r in np.unique(regions):
        copier = staged.copier(int(r))
        m = regions == r
        out[id(copier)] = (copier, out[id(copier)][1] | m) if id(copier) in out else (copier, m)
    if len(out) == 1:
        return [(next(iter(out.values()))[0], None)]
    return list(out.values())


def _copy_piece(staged: StagedRegions, ring: StagingRing, slot: int, regions: np.ndarray, offsets: np.ndarray,
                sizes: np.ndarray, *, gather: bool) -> list[tuple[Any, Any]]:
    """Gather a piece into buffer ``slot`` (or scatter it from there), each
    region's ranges by its own copier's lane, straight between the buffer and
    the registered ranges; returns a fence of every lane used, made on every
    path (an error waits for what was queued, then raises)."""
    buf = ring.addresses[slot] + (np.cumsum(sizes) - sizes)
    mem = staged.addresses(regions) + offsets
    fences: list[tuple[Any, Any]] = []
    try:
        for copier, mine in _by_copier(staged, regions):
            lane = ring.lane(copier)
            try:
                d, m, n = (buf, mem, sizes) if mine is None else (buf[mine], mem[mine], sizes[mine])
                if gather:
                    lane.after_written()
                    lane.gather(d, m, n)
                else:
                    lane.scatter(m, d, n)
            finally:
                fences.append((lane, lane.fence(slot)))
    except BaseException:
        for lane, token in fences:
            lane.wait(token)
        raise
    return fences


def send_staged(sock: socket.socket, staged: StagedRegions, regions: np.ndarray, offsets: np.ndarray,
                sizes: np.ndarray, deadline: float) -> None:
    """Send the ranges' bytes in order: up to a ring's worth of pieces are
    gathered ahead, and each is sent once its gather is complete."""
    with staged.pool.lease(deadline) as ring:
        pieces = list(_pieces(regions, offsets, sizes, staged.pool.nbytes))
        k = len(ring)

        def start(i: int) -> None:
            regs, offs, lens = pieces[i]
            ring.hold(i % k, _copy_piece(staged, ring, i % k, regs, offs, lens, gather=True))

        for i in range(min(k, len(pieces))):
            start(i)
        for i, (_, _, lens) in enumerate(pieces):
            slot, n = i % k, int(lens.sum())
            ring.settle(slot)  # the gather into it is complete: its bytes can go
            send_views(sock, [_host_view(ring.buffers[slot], n)], np.array([n], dtype=np.int64), deadline)
            if i + k < len(pieces):  # the socket has copied the buffer: it is free for the piece k ahead
                start(i + k)


class StagedReceiver:
    """Owns one reading connection's staging: a ring taken from ``staged``'s
    pool at its first job and kept while jobs keep coming (:meth:`idle` gives
    it back, once nothing is in flight in it)."""

    def __init__(self, staged: StagedRegions) -> None:
        self._staged = staged
        self._ring: Optional[StagingRing] = None

    @property
    def ring(self) -> Optional[StagingRing]:
        return self._ring

    def receive(self, sock: socket.socket, regions: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                deadline: float, should_stop: Optional[Callable[[], bool]] = None,
                on_settled: Optional[Callable[[], None]] = None) -> None:
        """Receive the ranges' bytes in order, each piece into the next buffer
        while the pieces before are scattered. Returns once every byte is
        received; ``on_settled`` runs (maybe before this returns) once the
        last scatter is complete too. On an error, waits for every copy in
        flight, gives the ring back and raises: ``on_settled`` never runs."""
        if self._ring is None:
            self._ring = self._staged.pool.take(deadline)
        ring = self._ring
        job = _Settling(on_settled or (lambda: None))
        try:
            for regs, offs, lens in _pieces(regions, offsets, sizes, self._staged.pool.nbytes):
                slot = ring.next_slot()
                ring.settle(slot)  # its previous piece (maybe a job's before) must be on the device first
                n = int(lens.sum())
                recv_views(sock, [_host_view(ring.buffers[slot], n)], np.array([n], dtype=np.int64), deadline,
                           should_stop)
                ring.hold(slot, _copy_piece(self._staged, ring, slot, regs, offs, lens, gather=False), job)
                ring.poll()  # jobs before whose scatters are complete are settled now, not at the next reuse
        except BaseException:
            job.on_settled = None
            self._give_back()
            raise
        job.finish_receiving()

    def idle(self) -> None:
        """No job waits: wait for the copies in flight (settling their jobs) and give the ring back."""
        self._give_back()

    def _give_back(self) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:
            self._staged.pool.give(ring)


def recv_staged(sock: socket.socket, staged: StagedRegions, regions: np.ndarray, offsets: np.ndarray,
                sizes: np.ndarray, deadline: float, should_stop: Optional[Callable[[], bool]] = None) -> None:
    """Receive one request's bytes through a ring of its own (a
    :class:`StagedReceiver` for one job). Returns (or raises) only once no
    copy is in flight, so the destination is settled either way."""
    receiver = StagedReceiver(staged)
    try:
        receiver.receive(sock, regions, offsets, sizes, deadline, should_stop)
    finally:
        receiver.idle()
