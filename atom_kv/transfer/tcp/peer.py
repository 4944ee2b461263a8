"""The reading half of the tcp backend: ``tcp.streams`` connections to one
peer's read server, each driven by a named worker thread (:class:`JobWorkers`)
that takes jobs (batches of ranges) from a shared queue and receives the
reply straight into destination memory."""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from atom_kv import wire
from atom_kv.wire import decode
from atom_kv.transfer._events import EndpointEvents
from atom_kv.transfer._jobs import DEFERRED, JobWorkers, ReadState
from atom_kv.transfer._regions import RegionTable
from atom_kv.transfer._sockio import HELLO_FRAME_MAX, PeerClosed, frame, recv_frame, recv_views
from atom_kv.transfer._trust import PURPOSE_TCP_READ, ReaderProof, version_refusal
from atom_kv.transfer.base import PeerUnreachable, TransferError

log = logging.getLogger(__name__)


@dataclass
class Job:
    """A batch of ranges read with one request: ``table`` is (n, 5) int64
    (local region, local offset, remote region, remote offset, size)."""

    state: ReadState
    table: np.ndarray
    deadline: float


class _Stale(Exception):
    """A reused connection turned out closed before any reply byte arrived
    (the server dropped it while idle): reconnect and send the request again."""


class TcpPeer:
    """Connections and worker threads for reading from one remote process.

    Each connection authenticates the server before sending a request (when
    this engine has an ``auth_token``); ``max_ranges`` is the most ranges the
    server accepts in one request. ``events`` counts what went wrong with
    this peer's replies ("bad_reply", "stale")."""

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
        hello_timeout_s: Optional[float] = None,
        events: EndpointEvents,
    ) -> None:
        self.peer_id = peer_id
        self.desc = desc
        self._local = local
        self._key = key
        self._token = auth_token
        self._connect_timeout = connect_timeout_s
        self._hello_timeout = hello_timeout_s if hello_timeout_s is not None else connect_timeout_s
        self._io_timeout = io_timeout_s
        self._events = events
        self._lock = threading.Lock()
        self._socks: list[Optional[socket.socket]] = [None] * streams
        self._receivers: list[Any] = [None] * streams  # per connection: its staging ring, while jobs come
        self._req_seq = 0
        self.max_ranges = 0
        # one connection up front: proves the peer is alive, knows our token and says its limits
        self._socks[0] = self._connect()
        self._workers = JobWorkers(
            f"atomkv-tcp-read-{desc.port}", streams, self._run_job,
            what="tcp read", closed_reason=f"peer {peer_id} removed", on_crash=self._drop, idle=self._idle,
        )

    @property
    def streams(self) -> int:
        return len(self._workers)

    def _connect(self) -> socket.socket:
        where = f"{self.desc.host}:{self.desc.port}"
        try:
            sock = socket.create_connection((self.desc.host, self.desc.port), timeout=self._connect_timeout)
        except TimeoutError:
            raise PeerUnreachable(f"tcp: cannot connect to peer {where} within {self._connect_timeout:g} s "
                                  "(connect_timeout_s): the connection attempt had no answer (a firewall dropping "
                                  "it, or no host at that address)") from None
        except OSError as exc:
            raise PeerUnreachable(f"tcp: cannot connect to peer {where}: {exc}") from None
        deadline = time.monotonic() + self._hello_timeout
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.max_ranges = self._authenticate(sock, where, deadline)
        except BaseException:
            sock.close()
            raise
        return sock

    def _authenticate(self, sock: socket.socket, where: str, deadline: float) -> int:
        """The reader's side of the hello (see :mod:`atom_kv.transfer.tcp.server`); returns the
        server's ``max_ranges`` or raises :class:`TransferError`."""
        try:
            try:
                greeting = decode(recv_frame(sock, deadline, HELLO_FRAME_MAX), wire.TcpServerHello)
            except TimeoutError:
                raise TransferError(
                    f"tcp: peer {where} sent no server hello within {self._hello_timeout:g}s "
                    "(an atom-kv older than protocol v2 does not speak first?)"
                ) from None
            if greeting.v != wire.TCP_PROTOCOL_VERSION:
                raise TransferError(f"{version_refusal('tcp', 'peer', greeting.v, wire.TCP_PROTOCOL_VERSION)} "
                                    f"(peer {where})")
            if not greeting.ok:
                raise TransferError(f"{greeting.error} (peer {where})")
            proof = ReaderProof(self._token, PURPOSE_TCP_READ, greeting.nonce, "tcp", where)
            sock.sendall(frame(wire.encode(wire.TcpHello(key=self._key, nonce=proof.nonce, proof=proof.proof))))
            reply = decode(recv_frame(sock, deadline, HELLO_FRAME_MAX), wire.TcpHelloReply)
        except wire.WireError as exc:
            self._events.warn("bad_reply", f"tcp: peer {where} sent a bad hello: {exc}")
            raise TransferError(f"tcp: peer {where} sent a bad hello: {exc}") from None
        except (OSError, TimeoutError) as exc:
            raise TransferError(f"tcp: handshake with peer {where} failed: {exc or type(exc).__name__}") from None
        if reply.v != wire.TCP_PROTOCOL_VERSION:
            raise TransferError(f"{version_refusal('tcp', 'peer', reply.v, wire.TCP_PROTOCOL_VERSION)} (peer {where})")
        if not reply.ok:
            raise TransferError(f"{reply.error} (peer {where})")
        proof.check_server(reply.proof)
        if reply.max_ranges < 1:
            raise TransferError(f"tcp: peer {where} announced max_ranges={reply.max_ranges}; expected >= 1")
        return reply.max_ranges

    def submit(self, job: Job) -> None:
        self._workers.submit(job)

    def _next_req_id(self) -> int:
        with self._lock:
            self._req_seq += 1
            return self._req_seq

    def _run_job(self, idx: int, job: Job) -> Optional[str]:
        state = job.state
        what = f"tcp read {state.rid} from {self.desc.host}:{self.desc.port}"
        for attempt in (1, 2):
            if time.monotonic() >= job.deadline:
                return f"{what}: timed out before it could be sent"
            reused = self._socks[idx] is not None
            try:
                if not reused:
                    self._socks[idx] = self._connect()
            except TransferError as exc:
                return f"{what}: {exc}"
            try:
                return self._request(idx, job, what, may_be_stale=reused and attempt == 1)
            except _Stale:
                self._events.count("stale")
                log.debug("%s: connection %d was closed by the server while idle; reconnecting", what, idx)
                self._drop(idx)
        return f"{what}: connection failed twice"  # not reached: a fresh connection never raises _Stale

    def _request(self, idx: int, job: Job, what: str, *, may_be_stale: bool) -> Optional[str]:
        """Send one request on connection ``idx`` and receive its bytes into the destination
        (staged: :data:`DEFERRED`, the job reports itself once its last copies are complete)."""
        sock = self._socks[idx]
        assert sock is not None
        state, table = job.state, job.table
        req_id = self._next_req_id()
        packed = np.ascontiguousarray(table[:, 2:5]).astype("<u8").tobytes()
        try:
            sock.settimeout(self._io_timeout)
            try:
                sock.sendall(frame(wire.encode(wire.ReadRequest(req_id=req_id, ranges=[], packed=packed))))
                head = recv_frame(sock, job.deadline, HELLO_FRAME_MAX)
            except (PeerClosed, ConnectionResetError, BrokenPipeError):
                if may_be_stale:
                    raise _Stale() from None
                raise
            reply = decode(head, wire.ReadReply)
            if not reply.ok:
                return f"{what}: {reply.error}"
            sizes = table[:, 4]
            expected = int(sizes.sum())
            if reply.req_id != req_id or reply.total != expected:
                raise ConnectionError(
                    f"reply {reply.req_id}/{reply.total} bytes does not match request {req_id}/{expected}"
                )
            if self._local.any_staged(table[:, 0]):  # GPU memory: received into staging buffers, pipelined
                self._receiver(idx).receive(sock, table[:, 0], table[:, 1], sizes, job.deadline, state.handle.done,
                                            on_settled=state.job_done)
                return DEFERRED
            views = self._local.views(table[:, 0], table[:, 1], sizes)
            recv_views(sock, views, sizes, job.deadline, state.handle.done)
            return None
        except wire.WireError as exc:
            self._events.warn("bad_reply", f"{what}: bad reply: {exc}")
            self._drop_sock(sock)
            return f"{what}: bad reply: {exc}"
        except (OSError, TimeoutError) as exc:
            self._drop_sock(sock)
            if state.handle.done():
                return None
            if isinstance(exc, TimeoutError):
                return f"{what}: timed out"
            return f"{what}: connection failed: {exc}"

    def _receiver(self, idx: int) -> Any:
        receiver = self._receivers[idx]
        if receiver is None:
            from atom_kv.transfer.staging import StagedReceiver

            receiver = self._receivers[idx] = StagedReceiver(self._local)
        return receiver

    def _idle(self, idx: int) -> None:
        """Connection ``idx`` has no job waiting: its staged jobs settle, its ring goes back."""
        receiver = self._receivers[idx]
        if receiver is not None:
            receiver.idle()

    def _drop_sock(self, sock: socket.socket) -> None:
        for i, s in enumerate(self._socks):
            if s is sock:
                self._drop(i)
                return

    def _drop(self, idx: int) -> None:
        sock, self._socks[idx] = self._socks[idx], None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop the workers (shutting the sockets wakes any inside a receive),
        fail what is still queued, close the sockets."""
        self._workers.close(unblock=self._shutdown_sockets)
        for i in range(len(self._socks)):
            self._drop(i)

    def _shutdown_sockets(self) -> None:
        for sock in self._socks:
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
