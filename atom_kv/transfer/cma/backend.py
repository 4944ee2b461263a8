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

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from atom_kv.transfer._grant import GrantedBackend, GrantServer
from atom_kv.transfer._jobs import JobWorkers, ReadState
from atom_kv.transfer._regions import RegionTable, begin_read, out_of_bounds, split_large
from atom_kv.transfer.base import ReadFailure, ReadHandle, ReadOp, TransferError
from atom_kv.transfer.cma.syscalls import CmaSys, PeerGone, cma_unavailable_reason
from atom_kv.transfer.memory import HOST, MemoryKind

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


class CmaBackend(GrantedBackend):
    """Owns registered regions, the grant endpoint, granted peers and the
    reader threads of one process's cma endpoint (see :class:`ServedBackend`
    for the addresses it listens on and advertises)."""

    name = "cma"
    accepts_op_arrays = True

    def _setup(self, cfg: "KVTransferConfig") -> None:
        super()._setup(cfg)
        self._sys = CmaSys()
        self._regions = RegionTable()
        self._ptracer_done = False
        self._workers: Optional[JobWorkers] = None  # started on the first read
        self._nthreads = max(1, min(2, os.cpu_count() or 1))

    def _grant_keys(self, cfg: "KVTransferConfig") -> tuple[float, int]:
        return cfg.cma.grant_timeout_s, cfg.cma.grant_max_connections

    # -- serving side ---------------------------------------------------
    def _spans(self) -> list[tuple[int, int, int]]:
        return self._regions.spans()

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

    # -- reading side ---------------------------------------------------
    def add_peer(self, descriptor: bytes) -> str:
        self._life.check_open()
        desc, grant = self._granted(descriptor, "use backend 'tcp' instead")
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
        self._keep_peer(peer_id, _CmaPeer(peer_id, desc.pid, addrs, sizes))
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
        self._pop_peer(peer_id)

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
        assert peer is not None  # an unknown peer was refused above
        nbytes = handle.nbytes
        bad = out_of_bounds(table[:, 2], table[:, 3], table[:, 4], peer.sizes)
        if bad is not None:
            _, _, rr, ro, sz = (int(x) for x in table[bad])
            log.warning("%s from %s: refused out-of-range remote range", what, peer_id)
            handle._finish(
                f"{what}: cma: range (region {rr}, offset {ro}, size {sz}) is outside the peer's registered regions",
                ReadFailure.OUT_OF_BOUNDS,
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
            handle._finish(f"{what}: backend is closed", ReadFailure.CLOSED)
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
        return super().stats()

    # -- lifecycle ------------------------------------------------------
    def _shut(self, peers: list[_CmaPeer], endpoint: Optional[GrantServer]) -> None:
        with self._lock:
            workers, self._workers = self._workers, None
        if workers is not None:
            workers.close()
        if endpoint is not None:
            endpoint.close()
        self._life.stop_deadlines()
        self._regions.clear()
