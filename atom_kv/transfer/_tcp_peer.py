"""The reading half of the tcp backend: ``tcp_streams`` connections to one
peer's read server, each driven by a named worker thread that takes jobs
(batches of ranges) from a shared queue and receives the reply straight into
destination memory."""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from atom_kv import wire
from atom_kv.transfer._regions import RegionTable
from atom_kv.transfer._sockio import frame, recv_frame, recv_views
from atom_kv.transfer.base import ReadHandle, TransferError

log = logging.getLogger(__name__)


class ReadState:
    """One ``read()`` call split into jobs; finishes its handle when the last
    job is done or at the first failure."""

    __slots__ = ("handle", "rid", "_left", "_lock")

    def __init__(self, handle: ReadHandle, rid: int, jobs: int) -> None:
        self.handle = handle
        self.rid = rid
        self._left = jobs
        self._lock = threading.Lock()
        handle._track_io()

    def job_done(self, error: Optional[str] = None) -> None:
        """Every job reports exactly once, whether it ran, failed or was
        skipped; the last report settles the handle (no more writes)."""
        if error is not None:
            self.handle._finish(error)
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.handle._finish(None)  # no-op if already failed
            self.handle._settle()

    def job_skipped(self) -> None:
        """A queued job dropped because the handle already finished."""
        self.job_done(None)


def drain_jobs(jobs: "queue.Queue", run, *, closed, what: str, closed_reason: str = "backend closed",
               on_crash=None) -> None:
    """The body of a read worker thread, shared by the host-memory backends.

    Takes jobs (anything with ``.state``, a :class:`ReadState`) until ``None``
    and makes every job report to its state exactly once — whether it ran
    (``run(job)`` returns an error string or ``None``), was skipped because its
    handle already finished, was refused because ``closed()``, or crashed —
    which is what lets the handle settle."""
    while True:
        job = jobs.get()
        if job is None:
            return
        state = job.state
        if state.handle.done():
            state.job_skipped()
            continue
        if closed():
            state.job_done(f"{what} {state.rid}: {closed_reason}")
            continue
        try:
            error = run(job)
        except Exception as exc:  # a bug must fail the read, not the worker
            log.exception("%s %d: unexpected error", what, state.rid)
            if on_crash is not None:
                on_crash()
            error = f"{what} {state.rid}: internal error: {exc!r}"
        state.job_done(error)


@dataclass
class Job:
    """A batch of ranges read with one request: ``table`` is (n, 5) int64
    (local region, local offset, remote region, remote offset, size)."""

    state: ReadState
    table: np.ndarray
    deadline: float


class TcpPeer:
    """Connections and worker threads for reading from one remote process."""

    def __init__(
        self,
        peer_id: str,
        desc: wire.TcpDescriptor,
        local: RegionTable,
        *,
        key: str,
        auth_token: Optional[str],
        streams: int,
        connect_timeout_s: float,
        io_timeout_s: float,
    ) -> None:
        self.peer_id = peer_id
        self.desc = desc
        self._local = local
        self._key = key
        self._token = auth_token
        self._connect_timeout = connect_timeout_s
        self._io_timeout = io_timeout_s
        self._jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._lock = threading.Lock()
        self._socks: list[Optional[socket.socket]] = [None] * streams
        self._closed = False
        self._req_seq = 0
        # one connection up front: proves the peer is alive and accepts our token
        self._socks[0] = self._connect()
        self._threads = [
            threading.Thread(
                target=self._worker, args=(i,), name=f"atomkv-tcp-read-{desc.port}-{i}", daemon=True
            )
            for i in range(streams)
        ]
        for t in self._threads:
            t.start()

    @property
    def streams(self) -> int:
        return len(self._threads)

    def _connect(self) -> socket.socket:
        where = f"{self.desc.host}:{self.desc.port}"
        deadline = time.monotonic() + self._connect_timeout
        try:
            sock = socket.create_connection((self.desc.host, self.desc.port), timeout=self._connect_timeout)
        except OSError as exc:
            raise TransferError(f"tcp: cannot connect to peer {where}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(frame(wire.encode(wire.TcpHello(key=self._key, auth_token=self._token))))
            reply = wire.decode(recv_frame(sock, deadline), wire.TcpHelloReply)
        except wire.WireError as exc:
            sock.close()
            log.warning("tcp: peer %s sent a bad hello reply: %s", where, exc)
            raise TransferError(f"tcp: peer {where} sent a bad hello reply: {exc}") from None
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise TransferError(f"tcp: handshake with peer {where} failed: {exc or type(exc).__name__}") from None
        if not reply.ok:
            sock.close()
            raise TransferError(f"{reply.error} (peer {where})")
        return sock

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def _next_req_id(self) -> int:
        with self._lock:
            self._req_seq += 1
            return self._req_seq

    def _worker(self, idx: int) -> None:
        drain_jobs(self._jobs, lambda job: self._run_job(idx, job), closed=lambda: self._closed,
                   what="tcp read", closed_reason=f"peer {self.peer_id} removed", on_crash=lambda: self._drop(idx))

    def _run_job(self, idx: int, job: Job) -> Optional[str]:
        state = job.state
        what = f"tcp read {state.rid} from {self.desc.host}:{self.desc.port}"
        if time.monotonic() >= job.deadline:
            return f"{what}: timed out before it could be sent"
        sock = self._socks[idx]
        try:
            if sock is None:
                sock = self._socks[idx] = self._connect()
        except TransferError as exc:
            return f"{what}: {exc}"
        table = job.table
        req_id = self._next_req_id()
        packed = np.ascontiguousarray(table[:, 2:5]).astype("<u8").tobytes()
        try:
            sock.settimeout(self._io_timeout)
            sock.sendall(frame(wire.encode(wire.ReadRequest(req_id=req_id, ranges=[], packed=packed))))
            reply = wire.decode(recv_frame(sock, job.deadline), wire.ReadReply)
            if not reply.ok:
                return f"{what}: {reply.error}"
            sizes = table[:, 4]
            expected = int(sizes.sum())
            if reply.req_id != req_id or reply.total != expected:
                raise ConnectionError(
                    f"reply {reply.req_id}/{reply.total} bytes does not match request {req_id}/{expected}"
                )
            views = self._local.views(table[:, 0], table[:, 1], sizes)
            recv_views(sock, views, sizes, job.deadline, state.handle.done)
            return None
        except wire.WireError as exc:
            log.warning("%s: bad reply: %s", what, exc)
            self._drop(idx)
            return f"{what}: bad reply: {exc}"
        except (OSError, TimeoutError) as exc:
            self._drop(idx)
            if state.handle.done():
                return None
            if isinstance(exc, TimeoutError):
                return f"{what}: timed out"
            return f"{what}: connection failed: {exc}"

    def _drop(self, idx: int) -> None:
        sock, self._socks[idx] = self._socks[idx], None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for sock in self._socks:
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=5)
        for i in range(len(self._socks)):
            self._drop(i)
        # fail whatever was still queued
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.state.job_done(f"tcp read {job.state.rid}: peer {self.peer_id} removed")
