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
  read) and opens its written events. ``read`` checks every range against
  the granted region sizes, then queues one batched copy per (remote region,
  local region) pair (:func:`~atom_kv.transfer._batched_copy.copy_ranges`,
  straight from the remote ranges into the local ones) on this backend's
  own stream of the destination's GPU, after the producer's written event
  and the consumer's current stream, and records a fence on every stream it
  used, on every path. A named completion thread waits on the fences
  (blocking-sync events: the thread sleeps, no core spins): the handle
  finishes, and *settles*, only once the copies are complete on the device,
  so the consumer's next step after it saw the handle finish is ordered
  after them, and ``wait_settled`` keeps its meaning even for a read failed
  by its deadline.
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
import queue
import select
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from atom_kv import wire
from atom_kv.transfer._grant import GrantedBackend, GrantServer
from atom_kv.transfer._regions import begin_read, out_of_bounds
from atom_kv.transfer._trust import PURPOSE_GPU_IPC_GRANT
from atom_kv.transfer.base import BackendUnavailable, ReadHandle, ReadOp, TransferError, chunk_sizes
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


@dataclass
class _Peer:
    """A granted peer: its regions mapped here, their sizes, its written
    events (per region, None when none) and what the seam opened for it."""

    pid: int
    tensors: list[Any]
    sizes: np.ndarray
    pidfd: Optional[int]
    written: list[Any] = field(default_factory=list)
    mapped: Any = None

    def gone(self) -> bool:
        return self.pidfd is not None and pid_exited(self.pidfd)

    def close(self) -> None:
        self.tensors, self.written = [], []
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class GpuIpcBackend(GrantedBackend):
    """Owns this process's exporters and written events, the grant endpoint,
    the mapped peers, one copy stream per GPU and the completion thread (see
    :class:`ServedBackend` for the addresses it listens on and advertises).

    ``_seam``: every device call (tests pass the host stand-in,
    :mod:`atom_kv.transfer.gpu_ipc.host_seam`); the other keywords are
    :class:`ServedBackend`'s."""

    name = "gpu_ipc"
    accepts_op_arrays = True
    memory_kinds = frozenset({"gpu"})
    purpose = PURPOSE_GPU_IPC_GRANT
    #: how scattered reads copy (:data:`~atom_kv.transfer._batched_copy.COPY_MODES`):
    #: "direct" (each byte read once) or "gather" (the older gather + scatter, to measure against)
    copy_mode = "direct"

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
        self._local_sizes = np.zeros(0, dtype=np.uint64)
        self._streams: dict[int, Any] = {}
        self._done: "queue.SimpleQueue[Optional[tuple[ReadHandle, list[Any], Optional[str], Any]]]" = \
            queue.SimpleQueue()
        self._completer = threading.Thread(target=self._complete, name=f"atomkv-gpu_ipc-done-{self._key}",
                                           daemon=True)
        self._completer.start()

    def _grant_keys(self, cfg: "KVTransferConfig") -> tuple[float, int]:
        return cfg.gpu_ipc_grant_timeout_s, cfg.gpu_ipc_grant_max_connections

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
        self._local_sizes = np.concatenate([self._local_sizes, np.asarray(sizes, dtype=np.uint64)])
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

    def remove_peer(self, peer_id: str) -> None:
        peer = self._pop_peer(peer_id)
        if peer is not None:  # reads in flight keep their own references to the mapped tensors
            peer.close()

    def _stream(self, device: int) -> Any:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = self._seam.stream(device)
        return s

    def read(self, peer_id: str, ops: Sequence[ReadOp] | Any, *, timeout_s: float) -> ReadHandle:
        rid = next(self._read_seq)
        what = f"gpu_ipc read {rid}"
        with self._lock:
            peer = self._peers.get(peer_id)
            refusal = self._life.read_refusal(peer, peer_id)
        handle, table = begin_read(what, ops, self._local_sizes, refusal=refusal)
        if table is None:
            return handle
        bad = out_of_bounds(table[:, 2], table[:, 3], table[:, 4], peer.sizes)
        if bad is not None:
            _, _, rr, ro, sz = (int(x) for x in table[bad])
            handle._finish(f"{what}: remote range (region {rr}, offset {ro}, size {sz}) is outside the regions "
                           f"peer {peer_id} registered")
            return handle
        if peer.gone():
            handle._finish(f"{what}: peer {peer_id} (pid {peer.pid}) has exited")
            return handle
        handle._track_io()
        self._life.watch(handle, timeout_s, f"{what} from {peer_id}")
        fences: list[Any] = []
        error = None
        keep = peer.tensors  # mapped memory stays referenced until the copies settled
        try:
            self._enqueue(peer, table, fences)
        except Exception as exc:  # a device error: what was queued still settles through the fences
            error = f"{what}: device copy failed: {exc}"
        self._done.put((handle, fences, error, keep))
        return handle

    def _enqueue(self, peer: _Peer, table: np.ndarray, fences: list[Any]) -> None:
        """One batched copy per (remote region, local region) pair, on the
        destination GPU's stream (and the source's, when they differ), each
        stream ordered after the producer's written event and the consumer's
        current stream. A fence is recorded on every stream used, whatever
        happens midway."""
        from atom_kv.transfer._batched_copy import copy_ranges

        seam = self._seam
        pairs = table[:, 2] * (1 << 32) + table[:, 0]
        used: dict[int, Any] = {}
        try:
            for key in np.unique(pairs):
                m = pairs == key
                remote = int(key >> 32)
                src, dst = peer.tensors[remote], self._local[int(key & 0xFFFFFFFF)]
                written = peer.written[remote]
                devices = dict.fromkeys((seam.device_of(dst), seam.device_of(src)))
                streams = {d: self._stream(d) for d in devices}
                used.update(streams)
                for d, stream in streams.items():  # here the current streams are still the consumer's
                    seam.order(stream, d, [] if written is None else [written])
                with seam.using(next(iter(devices)), list(streams.values())):
                    copy_ranges(src, table[m, 3], dst, table[m, 1], table[m, 4], mode=self.copy_mode)
        finally:
            for stream in used.values():
                fences.append(seam.record(stream))

    def _complete(self) -> None:
        """The completion thread: a read finishes and settles once its copies are complete."""
        while True:
            item = self._done.get()
            if item is None:
                return
            handle, fences, error, _keep = item
            try:
                for fence in fences:
                    self._seam.synchronize(fence)
            except Exception as exc:  # reported on the handle, never swallowed
                error = error or f"gpu_ipc: device copy failed: {exc}"
            handle._finish(error)
            handle._settle()
            del item, _keep  # the read's mapped memory is not held while waiting for the next one

    # -- lifecycle ------------------------------------------------------
    def _shut(self, peers: list[_Peer], endpoint: Optional[GrantServer]) -> None:
        if endpoint is not None:
            endpoint.close()
        self._done.put(None)  # after every queued read: each settles first
        if self._completer is not threading.current_thread():
            self._completer.join(timeout=30)
        self._life.stop_deadlines()
        for peer in peers:
            peer.close()
        with self._lock:
            exports, self._exports, self._local, self._written = self._exports, [], [], {}
        for exporter, _ in exports:
            if exporter is not None:
                exporter.close()
