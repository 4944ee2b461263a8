"""``tcp`` backend: one-sided reads of registered memory over plain sockets.

The serving side (:class:`~atom_kv.transfer.tcp.server.TcpReadServer`) sends
straight from registered memory with ``sendmsg``; the reading side
(:class:`~atom_kv.transfer.tcp.peer.TcpPeer`) receives straight into the
destination with ``recvmsg_into``, over ``tcp.streams`` parallel connections.
Works between any two hosts.

GPU memory is *staged* (:mod:`atom_kv.transfer.staging`): the serving side
copies the requested ranges straight into pinned host buffers and sends
those; the reader receives into pinned buffers and copies them straight into
the destination, pipelined over a ring of buffers per connection, from one
job to the next.
The wire protocol is the same, so either side may be staged or not.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from atom_kv import wire
from atom_kv.transfer._hostid import host_identity
from atom_kv.transfer._jobs import ReadState
from atom_kv.transfer._regions import RegionTable, begin_read, split_large
from atom_kv.transfer._served import ServedBackend
from atom_kv.transfer.tcp.peer import Job, TcpPeer
from atom_kv.transfer.tcp.server import TcpReadServer, TcpServerSettings
from atom_kv.transfer.memory import HOST, MemoryKind
from atom_kv.transfer.base import ReadHandle, ReadOp

if TYPE_CHECKING:
    from atom_kv.config import KVTransferConfig

__all__ = ["TcpBackend"]

log = logging.getLogger(__name__)

#: bytes and ranges per request (one job); big reads are split across streams
MAX_JOB_BYTES = 16 << 20
MIN_JOB_BYTES = 256 << 10
MAX_JOB_RANGES = 8192


def plan_jobs(table: np.ndarray, streams: int, max_ranges: int = MAX_JOB_RANGES) -> list[np.ndarray]:
    """Cut a merged op table into request-sized batches, so that the work
    spreads over ``streams`` connections and no request names more than
    ``max_ranges`` ranges (the server's limit)."""
    max_ranges = max(1, min(MAX_JOB_RANGES, max_ranges))
    total = int(table[:, 4].sum())
    target = min(MAX_JOB_BYTES, max(MIN_JOB_BYTES, -(-total // streams)))
    table = split_large(table, target)
    ends = np.cumsum(table[:, 4])
    job_of = (ends - 1) // target
    cuts = np.flatnonzero(np.diff(job_of)) + 1
    jobs = []
    for piece in np.split(table, cuts):
        for i in range(0, len(piece), max_ranges):
            jobs.append(piece[i : i + max_ranges])
    return jobs


class TcpBackend(ServedBackend):
    """Owns this process's registered regions, its read server (see
    :class:`ServedBackend` for the addresses it listens on and advertises)
    and one :class:`TcpPeer` per added peer."""

    name = "tcp"
    accepts_op_arrays = True
    memory_kinds = frozenset({"host", "gpu"})

    #: stage host memory too (through the host copier): the CPU suite runs
    #: the staging code GPU memory uses this way. Set before registering.
    stage_host_memory: bool = False
    #: the copier of staged host memory (None: the host copier); the bench and
    #: tests set a FAKE device copier (the test scaffolding's fake_copier module). Set before registering.
    staging_copier: Any = None

    def _setup(self, cfg: "KVTransferConfig") -> None:
        self._settings = TcpServerSettings.from_config(cfg)
        self._streams = cfg.tcp.streams
        self._connect_timeout = cfg.connect_timeout_s
        self._hello_timeout = cfg.handshake_timeout_s
        self._io_timeout = cfg.transfer_timeout_s
        pairs = cfg.staging.pool_pairs or cfg.tcp.server_threads + cfg.tcp.streams
        self._regions = RegionTable(staging_pairs=pairs, staging_bytes=cfg.staging.piece_bytes,
                                    staging_buffers=cfg.staging.ring_buffers)

    # -- serving side ---------------------------------------------------
    @property
    def server(self) -> TcpReadServer:
        return self._serving()

    def _start_endpoint(self, port: int) -> TcpReadServer:
        return TcpReadServer(self._regions, bind_host=self._bind_host, host=self._host, auth_token=self._token,
                             settings=self._settings, label=f"tcp server {self._key}", port=port)

    def register_memory(self, ptr: int, size: int, *, align: int = 1, memory: MemoryKind = HOST) -> list[int]:
        self._life.check_open()
        self.check_memory(memory)
        ids = self._regions.add(ptr, size, align, self.max_region_bytes, memory=memory,
                                staged=self.stage_host_memory, host_copier=self.staging_copier)
        log.info("tcp %s: registered %d bytes of %s memory at 0x%x as regions %s%s", self._key, size, memory.label,
                 ptr, ids, " (staged)" if self._regions.staged[ids[0]] else "")
        return ids

    def export_descriptor(self) -> bytes:
        srv = self.server
        return wire.encode(wire.TcpDescriptor(host=srv.host, port=srv.port, key=self._key, host_id=host_identity()))

    # -- reading side ---------------------------------------------------
    def add_peer(self, descriptor: bytes) -> str:
        self._life.check_open()
        desc = self._descriptor(descriptor, wire.TcpDescriptor)
        peer_id = f"tcp:{desc.key or desc.host}:{desc.port}#{next(self._peer_seq)}"
        peer = TcpPeer(
            peer_id, desc, self._regions, key=self._key, auth_token=self._token, streams=self._streams,
            connect_timeout_s=self._connect_timeout, hello_timeout_s=self._hello_timeout, io_timeout_s=self._io_timeout,
            events=self.reader_events,
        )
        self._keep_peer(peer_id, peer, TcpPeer.close)
        log.info("tcp %s: added peer %s", self._key, peer_id)
        return peer_id

    def remove_peer(self, peer_id: str) -> None:
        peer = self._pop_peer(peer_id)
        if peer is not None:
            peer.close()

    def read(self, peer_id: str, ops: Sequence[ReadOp] | Any, *, timeout_s: float) -> ReadHandle:
        """Start reading; ``ops`` may also be an (n, 5) int array with the
        :class:`ReadOp` columns (the fast path for many ranges)."""
        rid = next(self._read_seq)
        with self._lock:
            peer = self._peers.get(peer_id)
            refusal = self._life.read_refusal(peer, peer_id)
        handle, table = begin_read(f"tcp read {rid}", ops, self._regions.sizes, refusal=refusal)
        if table is None:
            return handle
        assert peer is not None  # an unknown peer was refused above
        jobs = plan_jobs(table, peer.streams, peer.max_ranges)
        state = ReadState(handle, rid, len(jobs))
        self._life.watch(handle, timeout_s, f"tcp read {rid} from {peer_id}")
        deadline = handle.started + timeout_s
        for piece in jobs:
            peer.submit(Job(state, piece, deadline))
        return handle

    def stats(self) -> dict[str, int]:
        """Event counts: the read server's ("auth", "decode", "busy",
        "oversized", "timeout", "idle", ...) and, prefixed "reader_", this
        side's ("reader_bad_reply", "reader_stale")."""
        return super().stats()

    # -- lifecycle ------------------------------------------------------
    def kv_written(self) -> None:
        self._regions.kv_written()

    def _shut(self, peers: list[TcpPeer], endpoint: Optional[TcpReadServer]) -> None:
        for peer in peers:
            peer.close()
        if endpoint is not None:
            endpoint.close()
        self._life.stop_deadlines()
        self._regions.clear()
