"""``gpu_ipc`` backend: one-sided GPU-to-GPU reads between processes of one
node, through CUDA IPC memory handles (HIP IPC on ROCm builds of torch).

- Serving: each registered GPU region gets an exporter
  (:mod:`atom_kv.transfer.gpu_ipc.handles`); every grant is one send of each
  region, with its own reference counter. Handles are capabilities: whoever
  holds one can read and write that GPU memory. So they never travel in the
  descriptor; a reader gets them from the grant endpoint
  (:mod:`atom_kv.transfer._grant`), and only after proving the
  ``auth_token`` there (challenge-response, purpose ``gpu-ipc-grant``).
  Memory that cannot be shared refuses the grant, so ``auto`` falls back.
- Producer order: :meth:`GpuIpcBackend.kv_written` records this process's
  written event (one interprocess event per GPU) on the engine's current
  stream; a reader's copies wait on it, so they never start before the
  engine's writes queued up to that call are complete on the device
  (docs/integrating.md says where an engine calls it).
- Reading: ``add_peer`` maps the peer's regions once (per peer, not per
  read), opens its written events, and makes one copy stream per
  (peer, local GPU) with its ordering event. ``read`` plans in one
  vectorised pass (:mod:`~atom_kv.transfer.gpu_ipc.plan`: bounds on both
  sides, pointer arrays, runs coalesced, no torch object per range), then
  per stream: an order after the producer's written event and the
  consumer's current stream (the stream's ordering event, re-recorded), one
  batched copy (``cuMemcpyBatchAsync`` where the driver has it), and a fence
  from a pool of reused events, recorded on every path. No event is made
  per read once the pool is warm.
- Completion (:mod:`~atom_kv.transfer.gpu_ipc.completion`): ``done()``
  queries the fences; ``wait()`` queries them for a bounded spin
  (``gpu_ipc.wait_spin_us``), then blocks while the settling thread waits
  on them (blocking-sync events: it sleeps). A handle finishes, and
  *settles*, only once the copies are complete on the device, so the
  consumer's next step after it saw the handle finish is ordered after them;
  a read failed by its deadline is settled by that thread once its copies
  are, so ``wait_settled`` keeps its meaning.
- A peer that exited is noticed through its pidfd (``poll``, any fd
  number): reads from it fail.

Every device call goes through a seam (:mod:`atom_kv.transfer.gpu_ipc.cuda_seam`);
the CPU suite runs this whole module between real processes over a host
stand-in of it (:mod:`atom_kv.transfer.gpu_ipc.host_seam`, tests only).

Two processes on one GPU and two GPUs of one node with peer access both work.
torch is imported lazily; without a GPU the constructor raises
:class:`BackendUnavailable` in one line.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from atom_kv import wire
from atom_kv.transfer._grant import GrantedBackend, GrantServer
from atom_kv.transfer._trust import PURPOSE_GPU_IPC_GRANT
from atom_kv.transfer.base import BackendUnavailable, ReadFailure, ReadHandle, ReadOp, TransferError, chunk_sizes
from atom_kv.transfer.gpu_ipc.completion import Completions, EventPool
from atom_kv.transfer.gpu_ipc.plan import PairTable, Spans, plan_read
from atom_kv.transfer.memory import HOST, MemoryKind, check_memory

if TYPE_CHECKING:
    from atom_kv.config import KVTransferConfig

__all__ = ["GpuIpcBackend", "pid_exited"]

log = logging.getLogger(__name__)


def pid_exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` exited (``poll``: works for any fd
    number, where ``select`` fails from fd 1024 on)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


class _Lane:
    """One (peer, local device) copy lane: its stream, its ordering event (re-recorded
    on the consumer's current stream by each read) and the device's fence pool.
    ``lock``: one read at a time orders, copies and fences on it."""

    __slots__ = ("stream", "ordering", "pool", "lock")

    def __init__(self, seam: Any, device: int, pool: EventPool) -> None:
        self.stream = seam.stream(device)
        self.ordering = seam.event(device)
        self.pool = pool
        self.lock = threading.Lock()


@dataclass
class _Peer:
    """A granted peer: its regions mapped here, their sizes, its written
    events (per region, None when none), what the seam opened for it, where
    its regions are (``spans``) and its copy lanes (one per local device)."""

    pid: int
    tensors: list[Any]
    sizes: np.ndarray
    pidfd: Optional[int]
    written: list[Any] = field(default_factory=list)
    mapped: Any = None
    spans: Optional[Spans] = None
    written_of: dict[int, list[Any]] = field(default_factory=dict)  # source device -> its written events
    lanes: dict[int, _Lane] = field(default_factory=dict)
    table: Optional[PairTable] = None  # with the local spans it was made with
    _poller: Any = None

    def gone(self) -> bool:
        if self.pidfd is None:
            return False
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.pidfd, select.POLLIN)
        return bool(self._poller.poll(0))

    def pair(self, local: Spans) -> PairTable:
        table = self.table
        if table is None or table.local is not local:
            assert self.spans is not None
            table = self.table = PairTable(local, self.spans)
        return table

    def close(self) -> None:
        self.tensors, self.written, self.written_of, self.lanes = [], [], {}, {}
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
        if self.pidfd is not None:
            if self._poller is not None:
                self._poller.unregister(self.pidfd)
                self._poller = None
            os.close(self.pidfd)
            self.pidfd = None


class GpuIpcBackend(GrantedBackend):
    """Owns this process's exporters and written events, the grant endpoint,
    the mapped peers and their copy lanes, the fence pools and the reads in
    flight with their settling thread (:class:`Completions`) (see
    :class:`ServedBackend` for the addresses it listens on and advertises).

    ``_seam``: every device call (tests pass the host stand-in,
    :mod:`atom_kv.transfer.gpu_ipc.host_seam`); the other keywords are
    :class:`ServedBackend`'s."""

    name = "gpu_ipc"
    accepts_op_arrays = True
    memory_kinds = frozenset({"gpu"})
    purpose = PURPOSE_GPU_IPC_GRANT

    def __init__(self, config: Optional["KVTransferConfig"] = None, *, _seam: Any = None, **where: Any) -> None:
        if _seam is None:
            from atom_kv.transfer.memory import gpu_unavailable_reason

            reason = gpu_unavailable_reason()
            if reason is not None:
                raise BackendUnavailable(f"gpu_ipc: {reason}; use backend 'auto', 'tcp' or 'cma' for host memory")
            from atom_kv.transfer.gpu_ipc.cuda_seam import CudaSeam

            _seam = CudaSeam()
        self._seam = _seam
        self.memory_kinds = _seam.memory_kinds
        super().__init__(config, **where)

    def _setup(self, cfg: "KVTransferConfig") -> None:
        super()._setup(cfg)
        self._share_lock = threading.Lock()
        self._exports: list[tuple[Any, int]] = []  # (exporter, device) per region
        self._export_error: Optional[str] = None  # why this memory cannot be shared: grants are refused
        self._written: dict[int, Any] = {}  # device -> this process's written event
        self._local: list[Any] = []  # our regions as uint8 tensors
        self._local_spans = Spans.of([], [], [])
        self._pools: dict[int, EventPool] = {}
        self._completions = Completions(self._seam, f"atomkv-gpu_ipc-settle-{self._key}",
                                        cfg.gpu_ipc.wait_spin_us * 1e-6)

    def _grant_keys(self, cfg: "KVTransferConfig") -> tuple[float, int]:
        timeout_s, connections = cfg.gpu_ipc.grant_timeout_s, cfg.gpu_ipc.grant_max_connections
        # None only until KVTransferConfig.__post_init__ fills them from their cma.grant_* aliases or defaults
        assert timeout_s is not None and connections is not None
        return timeout_s, connections

    def check_memory(self, memory: MemoryKind) -> None:
        check_memory(self.name, self.memory_kinds, memory,
                     instead="" if memory.is_gpu else "use backend 'auto', 'cma' or 'tcp' for host memory")

    # -- serving side ---------------------------------------------------
    def _handles(self) -> list[wire.GpuIpcRegion]:
        """One grant's handles: a fresh send of every region (one ref counter each).
        Raises :class:`TransferError` (the grant is refused) when they cannot be shared."""
        with self._lock:
            self._life.check_open()
            exports, written, error = list(self._exports), dict(self._written), self._export_error
        if error is not None:
            raise TransferError(error)
        with self._share_lock:  # grants are answered by two threads; a send rewraps the storage it shares
            return [exp.share(region, written[device].handle) for region, (exp, device) in enumerate(exports)]

    def register_memory(self, ptr: int, size: int, *, align: int = 1, memory: MemoryKind = HOST) -> list[int]:
        self._life.check_open()
        self.check_memory(memory)
        sizes = chunk_sizes(size, align, self.max_region_bytes)
        seam, device = self._seam, memory.device
        if device not in self._written:
            self._written[device] = seam.written(device)
        ids = []
        off = 0
        for n in sizes:
            try:
                exporter = seam.export(ptr + off, n, device)
            except TransferError as exc:  # served to nobody: each grant says why, and auto falls back to tcp
                exporter = None
                if self._export_error is None:
                    self._export_error = str(exc)
                    log.warning("gpu_ipc %s: %s; readers will be refused this memory", self._key, exc)
            with self._lock:
                ids.append(len(self._local))
                self._exports.append((exporter, device))
                self._local.append(seam.alias(ptr + off, n, device))
            off += n
        with self._lock:  # a new Spans object: each peer's lookup table is remade on its next read
            local = self._local
            self._local_spans = Spans.of([seam.address(t) for t in local],
                                         [int(t.numel()) for t in local], [seam.device_of(t) for t in local])
        log.info("gpu_ipc %s: registered %d bytes of %s memory at 0x%x as regions %s", self._key, size,
                 memory.label, ptr, ids)
        return ids

    def kv_written(self) -> None:
        """The engine's KV writes queued so far, on each registered GPU's
        current stream, count as written: readers' copies start after them."""
        with self._lock:
            written = list(self._written.values())
        for event in written:
            event.record()

    # -- reading side ---------------------------------------------------
    def add_peer(self, descriptor: bytes) -> str:
        self._life.check_open()
        desc, grant = self._granted(descriptor, "GPU IPC works within one node: use backend 'auto' "
                                                "(staged tcp across nodes)")
        regions = sorted(grant.ipc, key=lambda r: r.region)
        if [r.region for r in regions] != list(range(len(regions))):
            raise TransferError(f"gpu_ipc: peer pid {desc.pid} granted regions that are not numbered 0..n-1")
        peer = self._map(grant.pid, regions)
        try:
            self._open_lanes(peer)
        except Exception as exc:  # no stream here for this peer: auto falls back
            peer.close()
            raise TransferError(f"gpu_ipc: cannot prepare copies from peer pid {grant.pid}: {exc}") from None
        peer_id = f"gpu_ipc:{desc.key or desc.pid}#{next(self._peer_seq)}"
        self._keep_peer(peer_id, peer, _Peer.close)
        log.info("gpu_ipc %s: mapped %d regions of peer %s", self._key, len(peer.tensors), peer_id)
        return peer_id

    def _map(self, pid: int, regions: list[wire.GpuIpcRegion]) -> _Peer:
        """Map a granted peer's regions once, for every read from it."""
        sizes = np.asarray([r.size for r in regions], dtype=np.uint64)
        if pid == os.getpid():  # one process: our own memory, no handle to open
            return _Peer(pid, [self._seam.alias(r.addr, r.size, r.device) for r in regions], sizes, None,
                         [None] * len(regions))
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:  # it exited between its grant and here
            raise TransferError(f"gpu_ipc: peer pid {pid} is gone since its grant ({exc.strerror})") from None
        peer = _Peer(pid, [], sizes, pidfd, mapped=self._seam.open_peer(pid, pidfd))
        try:
            peer.tensors = [peer.mapped.region(r) for r in regions]
            peer.written = [peer.mapped.written(r) for r in regions]
            if peer.gone():
                raise TransferError(f"gpu_ipc: peer pid {pid} exited while its regions were mapped")
        except TransferError:
            peer.close()
            raise
        except Exception as exc:  # any other failure to map is the peer's memory we cannot use: auto falls back
            peer.close()
            raise TransferError(f"gpu_ipc: cannot map the memory of peer pid {pid}: {exc}") from None
        return peer

    def _open_lanes(self, peer: _Peer) -> None:
        """Where the peer's regions are, its written events by device, and one copy
        lane per GPU of ours (with peer access from each of the peer's GPUs)."""
        seam = self._seam
        devices = [seam.device_of(t) for t in peer.tensors]
        peer.spans = Spans.of([seam.address(t) for t in peer.tensors], [int(n) for n in peer.sizes], devices)
        for d, event in zip(devices, peer.written):
            events = peer.written_of.setdefault(d, [])
            if event is not None and event not in events:  # one per device (the same event for each region)
                events.append(event)
        with self._lock:
            local_devices = sorted(set(self._local_spans.device.tolist()))
        for device in local_devices:
            for peer_device in sorted(set(devices)):
                seam.prepare(device, peer_device)
            self._lane(peer, device)

    def _lane(self, peer: _Peer, device: int) -> _Lane:
        lane = peer.lanes.get(device)
        if lane is None:  # made at add_peer; here only for memory registered on a new GPU since
            with self._lock:
                pool = self._pools.get(device)
                if pool is None:
                    pool = self._pools[device] = EventPool(lambda: self._seam.event(device))
            lane = peer.lanes.setdefault(device, _Lane(self._seam, device, pool))
        return lane

    def remove_peer(self, peer_id: str) -> None:
        peer = self._pop_peer(peer_id)
        if peer is not None:  # reads in flight keep their own references to the mapped tensors
            peer.close()

    def read(self, peer_id: str, ops: Sequence[ReadOp] | Any, *, timeout_s: float) -> ReadHandle:
        rid = next(self._read_seq)
        with self._lock:
            peer = self._peers.get(peer_id)
            refusal = self._life.read_refusal(peer, peer_id)
            local = self._local_spans
        completions = self._completions
        if refusal is not None:
            handle = completions.handle(0, 0)
            handle._finish(f"gpu_ipc read {rid}: {refusal.text}", refusal.reason)
            return handle
        assert peer is not None  # an unknown peer was refused above
        plan, bad = plan_read(ops, peer.pair(local))
        if plan is None:
            assert bad is not None  # plan_read gives a plan or the first range out of bounds
            handle = completions.handle(0, 0)
            handle._finish(bad.message(f"gpu_ipc read {rid}", peer_id), ReadFailure.OUT_OF_BOUNDS)
            return handle
        handle = completions.handle(plan.nbytes, plan.ranges)
        if not plan.batches:
            handle._finish(None)
            return handle
        if peer.gone():
            handle._finish(f"gpu_ipc read {rid}: peer {peer_id} (pid {peer.pid}) has exited", ReadFailure.PEER_GONE)
            return handle
        self._life.watch(handle, timeout_s, f"gpu_ipc read {rid} from {peer_id}")
        fences: list[tuple[EventPool, Any]] = []
        error = self._enqueue(peer, plan.batches, fences)
        completions.track(handle, fences, peer.tensors, None if error is None else f"gpu_ipc read {rid}: {error}")
        return handle

    def _enqueue(self, peer: _Peer, batches: list[Any], fences: list[tuple[EventPool, Any]]) -> Optional[str]:
        """Per batch, on the lane of its destination GPU: the order after the producer's
        written events and the consumer's current stream, then one batched copy. A
        fence is recorded on every lane used, whatever happens midway; returns the
        error that stopped the copies, or None."""
        seam = self._seam
        error: Optional[str] = None
        for batch in batches:
            lane = self._lane(peer, batch.dst_device)
            with lane.lock:
                try:
                    seam.order(lane.stream, batch.dst_device, peer.written_of.get(batch.src_device, ()), lane.ordering)
                    seam.copy(lane.stream, batch)
                except Exception as exc:  # a device error: what was queued still settles through the fence
                    error = f"device copy failed: {exc}"
                finally:
                    event = lane.pool.take()
                    try:
                        seam.record(event, lane.stream)
                        fences.append((lane.pool, event))
                    except Exception as exc:
                        error = error or f"device copy failed: cannot fence the copies: {exc}"
                        lane.pool.give([event])
            if error is not None:
                break
        return error

    def fence_events(self) -> int:
        """Fence events this backend ever made (a pool's; none per read in steady state)."""
        with self._lock:
            return sum(pool.created for pool in self._pools.values())

    # -- lifecycle ------------------------------------------------------
    def _shut(self, peers: list[_Peer], endpoint: Optional[GrantServer]) -> None:
        if endpoint is not None:
            endpoint.close()
        self._completions.close()  # every read in flight settles first
        self._life.stop_deadlines()
        for peer in peers:
            peer.close()
        with self._lock:
            exports, self._exports, self._local, self._written = self._exports, [], [], {}
        for exporter, _ in exports:
            if exporter is not None:
                exporter.close()
