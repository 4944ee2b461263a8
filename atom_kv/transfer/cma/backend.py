"""``cma`` backend: same-host reads with ``process_vm_readv`` (cross memory
attach), zero copies beyond the kernel's single one.

The serving process allows itself to be read (``PR_SET_PTRACER``) when it
registers memory and runs a small grant endpoint that hands the region
table to readers that prove they know the ``auth_token`` (challenge-response,
see ``_trust``; the token never travels). The reading side bounds-checks
every range against that table and issues up to IOV_MAX ranges per syscall
from two named worker threads that split big reads.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from atom_kv import wire
from atom_kv.ports import RankPorts, listening
from atom_kv.transfer._grant import GrantServer, request_grant
from atom_kv.transfer.cma.syscalls import CmaSys, PeerGone, cma_unavailable_reason
from atom_kv.wire import decode
from atom_kv.transfer._events import EndpointEvents, endpoint_stats
from atom_kv.transfer._hostid import host_identity
from atom_kv.transfer._jobs import JobWorkers, ReadState
from atom_kv.transfer._lifecycle import Lifecycle
from atom_kv.transfer._regions import RegionTable, begin_read, out_of_bounds, resolve_config, split_large
from atom_kv.transfer.memory import HOST, MemoryKind
from atom_kv.transfer.base import ReadHandle, ReadOp, TransferBackend, TransferError

if TYPE_CHECKING:
    from atom_kv.config import KVTransferConfig

__all__ = ["CmaBackend", "cma_unavailable_reason"]

log = logging.getLogger(__name__)

#: reads at least this big are split across the worker threads
SPLIT_BYTES = 4 << 20


@dataclass
class _CmaPeer:
    peer_id: str
    pid: int
    addrs: np.ndarray  # uint64, by region id
    sizes: np.ndarray  # uint64, by region id (0 = not granted)


@dataclass
class _Job:
    state: ReadState
    pid: int
    local: np.ndarray
    remote: np.ndarray
    sizes: np.ndarray


class CmaBackend(TransferBackend):
    """Owns registered regions, the grant endpoint, granted peers and the
    reader threads of one process's cma endpoint.

    ``host`` is the address readers are told to reach the grant endpoint at;
    it listens on ``bind_host`` (``host`` when not given)."""

    name = "cma"
    accepts_op_arrays = True

    def __init__(
        self,
        config: Optional["KVTransferConfig"] = None,
        *,
        host: str = "127.0.0.1",
        bind_host: Optional[str] = None,
        key: Optional[str] = None,
        ports: Optional[RankPorts] = None,
    ) -> None:
        cfg = resolve_config(config)
        self._ports = ports
        self._sys = CmaSys()
        self._host = host
        self._bind_host = bind_host or host
        self._key = key or f"cma-{os.getpid()}-{id(self):x}"
        self._token = cfg.auth_token
        self._grant_timeout = cfg.cma_grant_timeout_s
        self._grant_max_connections = cfg.cma_grant_max_connections
        self.reader_events = EndpointEvents(log, f"cma {self._key} reader events")
        self._regions = RegionTable()
        self._lock = threading.Lock()
        self._life = Lifecycle("cma", self._lock, key=self._key)
        self._ctl: Optional[GrantServer] = None
        self._peers: dict[str, _CmaPeer] = {}
        self._peer_seq = itertools.count(1)
        self._read_seq = itertools.count(1)
        self._ptracer_done = False
        self._workers: Optional[JobWorkers] = None  # started on the first read
        self._nthreads = max(1, min(2, os.cpu_count() or 1))

    # -- serving side ---------------------------------------------------
    def _control(self) -> GrantServer:
        with self._lock:
            self._life.check_open()
            if self._ctl is None:
                self._ctl = listening(self._ports, "cma", self._bind_host, lambda port: GrantServer(
                    bind_host=self._bind_host, host=self._host, auth_token=self._token,
                    timeout_s=self._grant_timeout, max_connections=self._grant_max_connections,
                    spans=self._regions.spans, label=f"cma grant endpoint {self._key}", port=port,
                ))
            return self._ctl

    def register_memory(self, ptr: int, size: int, *, align: int = 1, memory: MemoryKind = HOST) -> list[int]:
        self._life.check_open()
        self.check_memory(memory)
        if not self._ptracer_done:
            note = self._sys.allow_any_tracer()
            self._ptracer_done = True
            if note:
                log.info("cma %s: %s", self._key, note)
        ids = self._regions.add(ptr, size, align, self.max_region_bytes)
        log.info("cma %s: registered %d bytes at 0x%x as regions %s", self._key, size, ptr, ids)
        return ids

    def export_descriptor(self) -> bytes:
        ctl = self._control()
        return wire.encode(
            wire.CmaDescriptor(pid=os.getpid(), host_id=host_identity(), ctl_host=ctl.host, ctl_port=ctl.port, key=self._key)
        )

    # -- reading side ---------------------------------------------------
    def add_peer(self, descriptor: bytes) -> str:
        self._life.check_open()
        try:
            desc = decode(descriptor, wire.CmaDescriptor)
        except wire.WireError as exc:
            log.warning("cma %s: bad peer descriptor: %s", self._key, exc)
            raise TransferError(f"cma: bad peer descriptor: {exc}") from None
        if desc.host_id != host_identity():
            raise TransferError(
                f"cma: peer {desc.key or desc.pid} is on another host (or pid namespace); use backend 'tcp' instead"
            )
        grant = request_grant(desc, self._key, self._token, self._grant_timeout, self.reader_events)
        if not grant.ok:
            raise TransferError(grant.error)
        if grant.pid != desc.pid:
            raise TransferError(f"cma: control endpoint answered for pid {grant.pid}, descriptor says {desc.pid}")
        n = len(grant.regions)
        if any(not 0 <= s.region < n or s.size < 0 or s.addr < 0 for s in grant.regions):
            raise TransferError(f"cma: peer {desc.key or desc.pid} sent an invalid region table (ids must be 0..{n - 1})")
        addrs = np.zeros(n, dtype=np.uint64)
        sizes = np.zeros(n, dtype=np.uint64)
        for s in grant.regions:
            addrs[s.region] = s.addr
            sizes[s.region] = s.size
        if grant.regions:
            self._probe(desc.pid, grant.regions[0].addr)
        peer_id = f"cma:{desc.key or desc.pid}#{next(self._peer_seq)}"
        with self._lock:
            self._life.check_open()
            self._peers[peer_id] = _CmaPeer(peer_id, desc.pid, addrs, sizes)
        log.info("cma %s: added peer %s (pid %d, %d regions)", self._key, peer_id, desc.pid, n)
        return peer_id

    def _probe(self, pid: int, addr: int) -> None:
        """Read one byte so that a kernel refusal surfaces at add_peer."""
        dst = np.zeros(1, dtype=np.uint8)
        try:
            self._sys.read(pid, np.array([dst.ctypes.data], np.uint64), np.array([addr], np.uint64), np.ones(1, np.uint64))
        except PeerGone as exc:
            raise TransferError(str(exc)) from None

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            self._peers.pop(peer_id, None)

    def read(self, peer_id: str, ops: Sequence[ReadOp] | Any, *, timeout_s: float) -> ReadHandle:
        """Start reading; ``ops`` may also be an (n, 5) int array with the
        :class:`ReadOp` columns (the fast path for many ranges)."""
        rid = next(self._read_seq)
        what = f"cma read {rid}"
        with self._lock:
            peer = self._peers.get(peer_id)
            refusal = self._life.read_refusal(peer, peer_id)
        handle, table = begin_read(what, ops, self._regions.sizes, refusal=refusal)
        if table is None:
            return handle
        nbytes = handle.nbytes
        bad = out_of_bounds(table[:, 2], table[:, 3], table[:, 4], peer.sizes)
        if bad is not None:
            _, _, rr, ro, sz = (int(x) for x in table[bad])
            log.warning("%s from %s: refused out-of-range remote range", what, peer_id)
            handle._finish(
                f"{what}: cma: range (region {rr}, offset {ro}, size {sz}) is outside the peer's registered regions"
            )
            return handle
        parts = self._nthreads if nbytes >= SPLIT_BYTES else 1
        pieces = [table]
        if parts > 1:
            table = split_large(table, -(-nbytes // parts))
            ends = np.cumsum(table[:, 4])
            cuts = np.searchsorted(ends, [nbytes * k // parts for k in range(1, parts)], side="left") + 1
            pieces = [p for p in np.split(table, cuts) if len(p)]
        workers = self._started_workers()
        if workers is None:  # closed since the refusal check
            handle._finish(f"{what}: backend is closed")
            return handle
        state = ReadState(handle, rid, len(pieces))
        self._life.watch(handle, timeout_s, f"{what} from {peer_id}")
        laddr, raddr = self._regions.addrs, peer.addrs
        for p in pieces:
            local = laddr[p[:, 0]] + p[:, 1].astype(np.uint64)
            remote = raddr[p[:, 2]] + p[:, 3].astype(np.uint64)
            workers.submit(_Job(state, peer.pid, local, remote, p[:, 4].astype(np.uint64)))
        return handle

    def _started_workers(self) -> Optional[JobWorkers]:
        """The reader threads, started on first use; None once closed."""
        with self._lock:
            if self._workers is None and not self._life.closed:
                self._workers = JobWorkers(f"atomkv-cma-read-{self._key}", self._nthreads, self._run_job,
                                           what="cma read", closed_reason="backend closed")
            return self._workers

    def _run_job(self, _index: int, job: "_Job") -> Optional[str]:
        try:
            self._sys.read(job.pid, job.local, job.remote, job.sizes, job.state.handle.done)
        except TransferError as exc:  # includes PeerGone and BackendUnavailable (EPERM)
            return f"cma read {job.state.rid}: {exc}"
        return None

    def stats(self) -> dict[str, int]:
        """Event counts: the grant endpoint's ("granted", "auth", "decode",
        "busy", "timeout", ...) and, prefixed "reader_", this side's."""
        with self._lock:
            ctl = self._ctl
        return endpoint_stats(ctl, self.reader_events)

    # -- lifecycle ------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if not self._life.mark_closed():
                return
            ctl, self._ctl = self._ctl, None
            workers, self._workers = self._workers, None
            self._peers.clear()
        if workers is not None:
            workers.close()
        if ctl is not None:
            ctl.close()
        self._life.stop_deadlines()
        self._regions.clear()
        self.reader_events.flush()
        log.info("cma %s: closed", self._key)
