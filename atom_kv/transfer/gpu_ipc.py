"""``gpu_ipc`` backend: one-sided GPU-to-GPU reads between processes of one
node, through CUDA IPC memory handles (HIP IPC on ROCm builds of torch).

- Serving: each registered GPU region is exported once as an IPC handle
  (:mod:`atom_kv.transfer._ipc_handles`). Handles are capabilities: whoever
  holds one can read and write that GPU memory. So they never travel in the
  descriptor; a reader gets them from the grant endpoint
  (:mod:`atom_kv.transfer._cma_control`), and only after proving the
  ``auth_token`` there (challenge-response, purpose ``gpu-ipc-grant``).
- Reading: ``add_peer`` maps the peer's regions once (per peer, not per
  read). ``read`` checks every range against the granted region sizes, then
  queues one batched gather/scatter per (remote region, local region) pair
  (:func:`~atom_kv.transfer._batched_copy.copy_ranges`) on this backend's
  own stream of the destination's GPU, records an event, and returns. A named
  completion thread waits on the event: the handle finishes, and *settles*,
  only once that stream's work is done, so ``wait_settled`` keeps its meaning
  even for a read failed by its deadline.
- A peer that exited is noticed through its pidfd: reads from it fail.

Two processes on one GPU and two GPUs of one node with peer access both work
(a copy between devices goes through ``Tensor.to``). torch is imported lazily;
without a GPU the constructor raises :class:`BackendUnavailable` in one line.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import select
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from atom_kv import wire
from atom_kv.ports import RankPorts, listening
from atom_kv.transfer._cma_control import CmaControlServer, request_grant
from atom_kv.transfer._events import EndpointEvents, endpoint_stats
from atom_kv.transfer._hostid import host_identity
from atom_kv.transfer._lifecycle import Lifecycle
from atom_kv.transfer._regions import begin_read, out_of_bounds, resolve_config
from atom_kv.transfer._trust import PURPOSE_GPU_IPC_GRANT
from atom_kv.transfer.base import BackendUnavailable, ReadHandle, ReadOp, TransferBackend, TransferError, chunk_sizes
from atom_kv.transfer.memory import HOST, MemoryKind, check_memory
from atom_kv.wire import decode

if TYPE_CHECKING:
    from atom_kv.config import KVTransferConfig

__all__ = ["GpuIpcBackend"]

log = logging.getLogger(__name__)


@dataclass
class _Peer:
    """A granted peer: its regions mapped here (uint8 tensors) and their sizes."""

    pid: int
    tensors: list[Any]
    sizes: np.ndarray
    pidfd: Optional[int]

    def gone(self) -> bool:
        if self.pidfd is None:
            return False
        readable, _, _ = select.select([self.pidfd], [], [], 0)
        return bool(readable)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        self.tensors = []


class GpuIpcBackend(TransferBackend):
    """Owns this process's exported GPU regions, the grant endpoint, the
    mapped peers, one copy stream per GPU and the completion thread."""

    name = "gpu_ipc"
    accepts_op_arrays = True
    memory_kinds = frozenset({"gpu"})

    def __init__(
        self,
        config: Optional["KVTransferConfig"] = None,
        *,
        host: str = "127.0.0.1",
        bind_host: Optional[str] = None,
        key: Optional[str] = None,
        ports: Optional[RankPorts] = None,
    ) -> None:
        from atom_kv.transfer.memory import gpu_unavailable_reason

        reason = gpu_unavailable_reason()
        if reason is not None:
            raise BackendUnavailable(f"gpu_ipc: {reason}; use backend 'auto', 'tcp' or 'cma' for host memory")
        import torch

        self._torch = torch
        cfg = resolve_config(config)
        self._ports = ports
        self._host = host
        self._bind_host = bind_host or host
        self._key = key or f"gpu_ipc-{os.getpid()}-{id(self):x}"
        self._token = cfg.auth_token
        self._grant_timeout = cfg.cma_grant_timeout_s
        self._grant_max_connections = cfg.cma_grant_max_connections
        self.reader_events = EndpointEvents(log, f"gpu_ipc {self._key} reader events")
        self._lock = threading.Lock()
        self._life = Lifecycle("gpu_ipc", self._lock, key=self._key)
        self._exports: list[wire.GpuIpcRegion] = []
        self._keep: list[Any] = []  # storages behind exported handles
        self._local: list[Any] = []  # our regions as uint8 tensors
        self._local_sizes = np.zeros(0, dtype=np.uint64)
        self._ctl: Optional[CmaControlServer] = None
        self._peers: dict[str, _Peer] = {}
        self._streams: dict[int, Any] = {}
        self._peer_seq = itertools.count(1)
        self._read_seq = itertools.count(1)
        self._done: "queue.SimpleQueue[Optional[tuple[ReadHandle, list[Any], Optional[str]]]]" = queue.SimpleQueue()
        self._completer = threading.Thread(target=self._complete, name=f"atomkv-gpu_ipc-done-{self._key}",
                                           daemon=True)
        self._completer.start()

    def check_memory(self, memory: MemoryKind) -> None:
        check_memory(self.name, self.memory_kinds, memory,
                     instead="" if memory.is_gpu else "use backend 'auto', 'cma' or 'tcp' for host memory")

    # -- serving side ---------------------------------------------------
    def _control(self) -> CmaControlServer:
        with self._lock:
            self._life.check_open()
            if self._ctl is None:
                self._ctl = listening(self._ports, "gpu_ipc", self._bind_host, lambda port: CmaControlServer(
                    bind_host=self._bind_host, host=self._host, auth_token=self._token,
                    timeout_s=self._grant_timeout, max_connections=self._grant_max_connections,
                    spans=lambda: [], label=f"gpu_ipc grant endpoint {self._key}", name="gpu_ipc",
                    purpose=PURPOSE_GPU_IPC_GRANT, handles=lambda: list(self._exports), port=port,
                ))
            return self._ctl

    def register_memory(self, ptr: int, size: int, *, align: int = 1, memory: MemoryKind = HOST) -> list[int]:
        self._life.check_open()
        self.check_memory(memory)
        from atom_kv.transfer._ipc_handles import alias, export_region

        ids = []
        off = 0
        for n in chunk_sizes(size, align, self.max_region_bytes):
            rid = len(self._local)
            exported, storage = export_region(rid, ptr + off, n, memory.device)
            self._exports.append(exported)
            self._keep.append(storage)
            self._local.append(alias(ptr + off, n, memory.device))
            ids.append(rid)
            off += n
        self._local_sizes = np.concatenate([self._local_sizes, np.asarray(chunk_sizes(size, align, self.max_region_bytes),
                                                                         dtype=np.uint64)])
        log.info("gpu_ipc %s: registered %d bytes of %s memory at 0x%x as regions %s", self._key, size,
                 memory.label, ptr, ids)
        return ids

    def export_descriptor(self) -> bytes:
        ctl = self._control()
        return wire.encode(wire.CmaDescriptor(pid=os.getpid(), host_id=host_identity(), ctl_host=ctl.host,
                                              ctl_port=ctl.port, key=self._key))

    # -- reading side ---------------------------------------------------
    def add_peer(self, descriptor: bytes) -> str:
        self._life.check_open()
        try:
            desc = decode(descriptor, wire.CmaDescriptor)
        except wire.WireError as exc:
            raise TransferError(f"gpu_ipc: bad peer descriptor: {exc}") from None
        if desc.host_id != host_identity():
            raise TransferError(f"gpu_ipc: peer {desc.ctl_host} (pid {desc.pid}) is on another host; GPU IPC "
                                "works within one node: use backend 'auto' (staged tcp across nodes)")
        grant = request_grant(desc, self._key, self._token, self._grant_timeout, self.reader_events,
                              name="gpu_ipc", purpose=PURPOSE_GPU_IPC_GRANT)
        if not grant.ok:
            raise TransferError(grant.error)
        regions = sorted(grant.ipc, key=lambda r: r.region)
        if [r.region for r in regions] != list(range(len(regions))):
            raise TransferError(f"gpu_ipc: peer pid {desc.pid} granted regions that are not numbered 0..n-1")
        from atom_kv.transfer._ipc_handles import alias, open_region

        same_process = grant.pid == os.getpid()
        try:  # mapped once here, for every read from this peer
            tensors = [alias(r.addr, r.size, r.device) if same_process else open_region(r) for r in regions]
        except TransferError:
            raise
        except RuntimeError as exc:
            raise TransferError(f"gpu_ipc: cannot map the GPU memory of peer pid {desc.pid}: {exc}") from None
        pidfd = None if same_process else os.pidfd_open(grant.pid)
        peer = _Peer(grant.pid, tensors, np.asarray([r.size for r in regions], dtype=np.uint64), pidfd)
        peer_id = f"gpu_ipc:{desc.key or desc.pid}#{next(self._peer_seq)}"
        with self._lock:
            closed = self._life.closed
            if not closed:
                self._peers[peer_id] = peer
        if closed:
            peer.close()
            self._life.check_open()
        log.info("gpu_ipc %s: mapped %d regions of peer %s", self._key, len(tensors), peer_id)
        return peer_id

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(peer_id, None)
        if peer is not None:
            peer.close()

    def _stream(self, device: Any) -> Any:
        s = self._streams.get(device.index)
        if s is None:
            s = self._streams[device.index] = self._torch.cuda.Stream(device)
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
        events: list[Any] = []
        error = None
        try:
            self._enqueue(peer, table, events)
        except Exception as exc:  # a CUDA error: what was queued still settles through its events
            error = f"{what}: device copy failed: {exc}"
        self._done.put((handle, events, error))
        return handle

    def _enqueue(self, peer: _Peer, table: np.ndarray, events: list[Any]) -> None:
        """One batched copy per (remote region, local region) pair, on the
        destination GPU's stream (and the source's, when they differ)."""
        import contextlib

        from atom_kv.transfer._batched_copy import copy_ranges

        torch = self._torch
        pairs = table[:, 2] * (1 << 32) + table[:, 0]
        used: dict[int, Any] = {}
        for key in np.unique(pairs):
            m = pairs == key
            src, dst = peer.tensors[int(key >> 32)], self._local[int(key & 0xFFFFFFFF)]
            streams = {d.index: self._stream(d) for d in (src.device, dst.device)}
            used.update(streams)
            with contextlib.ExitStack() as on:
                on.enter_context(torch.cuda.device(dst.device))
                for stream in streams.values():
                    on.enter_context(torch.cuda.stream(stream))
                copy_ranges(src, table[m, 3], dst, table[m, 1], table[m, 4])
        for stream in used.values():
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)

    def _complete(self) -> None:
        """The completion thread: a read finishes and settles once its stream work is done."""
        while True:
            item = self._done.get()
            if item is None:
                return
            handle, events, error = item
            try:
                for event in events:
                    event.synchronize()
            except Exception as exc:  # reported on the handle, never swallowed
                error = error or f"gpu_ipc: device copy failed: {exc}"
            handle._finish(error)
            handle._settle()

    def stats(self) -> dict[str, int]:
        with self._lock:
            ctl = self._ctl
        return endpoint_stats(ctl, self.reader_events)

    # -- lifecycle ------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if not self._life.mark_closed():
                return
            peers = list(self._peers.values())
            self._peers.clear()
            ctl, self._ctl = self._ctl, None
        if ctl is not None:
            ctl.close()
        self._done.put(None)  # after every queued read: each settles first
        if self._completer is not threading.current_thread():
            self._completer.join(timeout=30)
        self._life.stop_deadlines()
        for peer in peers:
            peer.close()
        self._local, self._keep, self._exports = [], [], []
        self.reader_events.flush()
        log.info("gpu_ipc %s: closed", self._key)
