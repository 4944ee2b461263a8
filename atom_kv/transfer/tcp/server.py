"""The serving half of the tcp backend: a :class:`FrameServer` whose handler
authenticates readers (challenge-response when an ``auth_token`` is set) and
answers ``ReadRequest`` frames by sending straight from registered memory,
after bounds-checking every range.

Protocol on one connection (frames are 4-byte big-endian length + msgpack)::

    server -> TcpServerHello(nonce)              nonce empty without a token
    reader -> TcpHello(key, nonce, proof)        proof: HMAC over both nonces
    server -> TcpHelloReply(ok, proof, max_ranges)
    reader -> ReadRequest ... server -> ReadReply + raw bytes, repeated
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

from atom_kv import wire
from atom_kv.wire import decode
from atom_kv.transfer._frame_server import Conn, ServerLimits
from atom_kv.transfer._regions import RegionTable, out_of_bounds
from atom_kv.transfer._served import ServingEndpoint
from atom_kv.transfer._sockio import frame, request_frame_limit, send_views
from atom_kv.transfer._trust import AUTH_HINT, PURPOSE_TCP_READ

if TYPE_CHECKING:
    from atom_kv.config import KVTransferConfig

__all__ = ["TcpReadServer", "TcpServerSettings"]

log = logging.getLogger(__name__)

#: longest error text put in a reply
_MAX_ERROR_CHARS = 1024


@dataclass(frozen=True)
class TcpServerSettings:
    """The read server's bounds, from the ``tcp_*`` config keys."""

    max_connections: int
    max_ranges: int
    read_timeout_s: float
    idle_timeout_s: float
    threads: int
    send_timeout_s: float
    hello_timeout_s: float = 2.0
    max_unauthenticated_per_source: int = 64
    reserved_connections: int = 64

    @classmethod
    def from_config(cls, cfg: "KVTransferConfig") -> "TcpServerSettings":
        return cls(
            max_connections=cfg.tcp.max_connections,
            max_ranges=cfg.tcp.max_ranges_per_request,
            read_timeout_s=cfg.tcp.read_timeout_s,
            idle_timeout_s=cfg.tcp.idle_timeout_s,
            threads=cfg.tcp.server_threads,
            send_timeout_s=cfg.transfer_timeout_s,
            hello_timeout_s=cfg.tcp.hello_timeout_s,
            max_unauthenticated_per_source=cfg.tcp.max_unauthenticated_per_source,
            reserved_connections=(cfg.tcp.max_connections // 8 if cfg.limits.tcp_reserved_connections is None
                                  else cfg.limits.tcp_reserved_connections),
        )


class TcpReadServer(ServingEndpoint):
    """Owns one tcp backend's serving side: the read protocol on top of its
    :class:`ServingEndpoint`. Event keys: auth, version, decode, ranges,
    malformed, busy, oversized, timeout, idle, accept."""

    def __init__(
        self,
        regions: RegionTable,
        *,
        bind_host: str,
        host: str,
        auth_token: Optional[str],
        settings: TcpServerSettings,
        label: str,
        port: int = 0,
    ) -> None:
        self._regions = regions
        self._settings = settings
        limits = ServerLimits(
            max_connections=settings.max_connections,
            max_frame=request_frame_limit(settings.max_ranges),
            read_timeout_s=settings.read_timeout_s,
            idle_timeout_s=settings.idle_timeout_s,
            threads=settings.threads,
            hello_timeout_s=settings.hello_timeout_s,
            max_unauthenticated_per_source=settings.max_unauthenticated_per_source,
            reserved=min(settings.reserved_connections, settings.max_connections - 1),
            keys=("tcp.max_connections", "tcp.max_unauthenticated_per_source", "limits.tcp_reserved_connections"),
        )
        self._serve(log, "tcp", label, bind_host=bind_host, host=host, auth_token=auth_token,
                    limits=limits, handle=self._handle, port=port)

    @property
    def rejected_ranges(self) -> int:
        return self.events["ranges"]

    @property
    def connections(self) -> int:
        return self._server.connections

    # -- handshake ---------------------------------------------------------
    def _greet(self, conn: Conn) -> bytes:
        return wire.encode(wire.TcpServerHello(nonce=self._nonce(conn)))

    def _busy(self, why: str) -> bytes:
        return wire.encode(wire.TcpServerHello(ok=False, error=f"tcp: the read server refused the connection: {why}"))

    def _handle(self, conn: Conn, payload: bytearray) -> bool:
        if not conn.authenticated:
            return self._hello(conn, payload)
        self._answer(conn, payload)
        return True

    def _hello(self, conn: Conn, payload: bytearray) -> bool:
        who = f"{self._label}: reader at {conn.peer}"
        hello = self._opening(payload, wire.TcpHello, wire.TCP_PROTOCOL_VERSION, "hello")
        if isinstance(hello, tuple):  # refused: (event key, one line)
            return self._refuse_hello(conn, *hello, who=who)
        proof = self._proof(conn, PURPOSE_TCP_READ, hello.nonce, hello.proof)
        if proof is None:
            return self._refuse_hello(conn, "auth", f"tcp: the read server refused this reader: wrong or missing "
                                                    f"auth_token proof; {AUTH_HINT}", who=f"{who} ({hello.key!r})")
        conn.authenticated = True
        self._send(conn, wire.TcpHelloReply(ok=True, proof=proof, max_ranges=self._settings.max_ranges),
                   self._settings.read_timeout_s)
        log.debug("%s (%r): accepted", who, hello.key)
        return True

    def _refuse_hello(self, conn: Conn, key: str, why: str, *, who: str) -> bool:
        self.events.warn(key, f"{who}: refused: {why}")
        self._send(conn, wire.TcpHelloReply(ok=False, error=why[:_MAX_ERROR_CHARS]), self._settings.read_timeout_s)
        return False

    def _send(self, conn: Conn, msg: wire.TcpHelloReply | wire.ReadReply, timeout_s: float) -> None:
        conn.sock.settimeout(timeout_s)
        conn.sock.sendall(frame(wire.encode(msg)))

    # -- reads -------------------------------------------------------------
    def _answer(self, conn: Conn, data: bytearray) -> None:
        who = f"{self._label}: reader at {conn.peer}"
        try:
            req = decode(data, wire.ReadRequest)
        except wire.WireError as exc:
            self.events.warn("decode", f"{who}: undecodable read request: {exc}")
            self._send(conn, wire.ReadReply(req_id=-1, ok=False, error=str(exc)[:_MAX_ERROR_CHARS]),
                       self._settings.read_timeout_s)
            return
        rid = req.req_id
        if req.packed:
            if len(req.packed) % 24:
                self._refuse(conn, rid, "malformed", who,
                             "packed ranges are not a whole number of (region, offset, size) triples")
                return
            table = np.frombuffer(req.packed, dtype="<u8").reshape(-1, 3).astype(np.int64)
        else:
            try:
                table = np.array([(r.region, r.offset, r.size) for r in req.ranges], dtype=np.int64).reshape(-1, 3)
            except OverflowError:  # msgpack ints reach 2**64 - 1 and down to -2**63
                self._refuse(conn, rid, "ranges", who, "a range field does not fit in a signed 64-bit integer")
                return
        if len(table) > self._settings.max_ranges:
            self._refuse(conn, rid, "malformed", who,
                         f"{len(table)} ranges in one request (limit {self._settings.max_ranges}, "
                         "tcp.max_ranges_per_request)")
            return
        regions, offsets, sizes = table[:, 0], table[:, 1], table[:, 2]
        bad = out_of_bounds(regions, offsets, sizes, self._regions.sizes)
        if bad is not None:
            r, o, s = (int(x) for x in table[bad])
            self._refuse(conn, rid, "ranges", who,
                         f"range {bad} (region {r}, offset {o}, size {s}) is outside the registered regions")
            return
        total = int(sizes.sum())
        head = frame(wire.encode(wire.ReadReply(req_id=rid, ok=True, total=total)))
        if self._regions.any_staged(regions):  # GPU memory: gathered into staging buffers, pipelined
            from atom_kv.transfer.staging import send_staged

            deadline = time.monotonic() + self._settings.send_timeout_s
            send_views(conn.sock, [memoryview(head)], np.array([len(head)], dtype=np.int64), deadline)
            send_staged(conn.sock, self._regions, regions, offsets, sizes, deadline)
            log.debug("%s: request %d: sent %d staged bytes in %d ranges", who, rid, total, len(table))
            return
        views = [memoryview(head)]
        views.extend(self._regions.views(regions, offsets, sizes))
        lengths = np.empty(len(views), dtype=np.int64)
        lengths[0] = len(head)
        lengths[1:] = sizes
        send_views(conn.sock, views, lengths, time.monotonic() + self._settings.send_timeout_s)
        log.debug("%s: request %d: sent %d bytes in %d ranges", who, rid, total, len(table))

    def _refuse(self, conn: Conn, rid: int, key: str, who: str, why: str) -> None:
        self.events.warn(key, f"{who}: request {rid} refused: {why}")
        self._send(conn, wire.ReadReply(req_id=rid, ok=False, error=f"tcp: {why}"[:_MAX_ERROR_CHARS]),
                   self._settings.read_timeout_s)
