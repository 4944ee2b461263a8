"""The serving half of the tcp backend: a listening socket and one named
thread per reader connection that answers ``ReadRequest`` frames by sending
straight from registered memory, after bounds-checking every range."""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
from typing import Optional

import numpy as np

from atom_kv import wire
from atom_kv.transfer._regions import RegionTable, out_of_bounds
from atom_kv.transfer._sockio import (
    PeerClosed,
    frame,
    recv_frame,
    send_views,
    wait_readable,
)

log = logging.getLogger(__name__)

#: a request may name at most this many ranges (bounds the view list we build)
MAX_RANGES_PER_REQUEST = 1 << 20


class TcpReadServer:
    """Owns the listening socket, the accept thread and the per-connection
    serving threads of one tcp backend."""

    def __init__(
        self, regions: RegionTable, host: str, auth_token: Optional[str], io_timeout_s: float, label: str
    ) -> None:
        self._regions = regions
        self._token = auth_token.encode() if auth_token else None
        self._io_timeout = io_timeout_s
        self._label = label
        self._lsock = socket.create_server((host, 0), backlog=128)
        self.host = host
        self.port = self._lsock.getsockname()[1]
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._conns: dict[int, tuple[socket.socket, threading.Thread]] = {}
        self._stop = threading.Event()
        self._seq = 0
        #: counters, readable by tests and metrics
        self.decode_errors = 0
        self.rejected_ranges = 0
        self.auth_failures = 0
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"atomkv-tcp-accept-{self.port}", daemon=True
        )
        self._accept_thread.start()

    # ------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not wait_readable(self._lsock, self._wake_r, self._io_timeout):
                    continue
                conn, addr = self._lsock.accept()
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("%s: accept failed", self._label)
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._stop.is_set():
                    conn.close()
                    return
                self._seq += 1
                cid = self._seq
                t = threading.Thread(
                    target=self._serve, args=(cid, conn, addr),
                    name=f"atomkv-tcp-serve-{self.port}-{cid}", daemon=True,
                )
                self._conns[cid] = (conn, t)
            t.start()

    def _serve(self, cid: int, conn: socket.socket, addr: tuple) -> None:
        who = f"{self._label} conn {cid} from {addr[0]}:{addr[1]}"
        try:
            conn.settimeout(self._io_timeout)
            if not self._hello(conn, who):
                return
            while not self._stop.is_set():
                try:
                    if not wait_readable(conn, self._wake_r, self._io_timeout):
                        continue
                    data = recv_frame(conn)
                except (PeerClosed, ConnectionError, TimeoutError, OSError):
                    return
                self._answer(conn, data, who)
        except (ConnectionError, TimeoutError, OSError) as exc:
            if not self._stop.is_set():
                log.info("%s: connection dropped: %s", who, exc)
        finally:
            with self._lock:
                self._conns.pop(cid, None)
            conn.close()

    def _hello(self, conn: socket.socket, who: str) -> bool:
        try:
            hello = wire.decode(recv_frame(conn), wire.TcpHello)
        except wire.WireError as exc:
            self.decode_errors += 1
            log.warning("%s: bad hello: %s", who, exc)
            conn.sendall(frame(wire.encode(wire.TcpHelloReply(ok=False, error=f"bad hello: {exc}"))))
            return False
        if self._token is not None:
            given = (hello.auth_token or "").encode()
            if not hmac.compare_digest(given, self._token):
                self.auth_failures += 1
                log.warning("%s: rejected reader %r: wrong or missing auth_token", who, hello.key)
                reply = wire.TcpHelloReply(ok=False, error="tcp: the peer rejected our auth_token (wrong or missing)")
                conn.sendall(frame(wire.encode(reply)))
                return False
        conn.sendall(frame(wire.encode(wire.TcpHelloReply(ok=True))))
        return True

    def _answer(self, conn: socket.socket, data: bytes, who: str) -> None:
        try:
            req = wire.decode(data, wire.ReadRequest)
        except wire.WireError as exc:
            self.decode_errors += 1
            log.warning("%s: undecodable read request: %s", who, exc)
            conn.sendall(frame(wire.encode(wire.ReadReply(req_id=-1, ok=False, error=str(exc)))))
            return
        rid = req.req_id
        if req.packed:
            if len(req.packed) % 24:
                self._refuse(conn, rid, who, "packed ranges are not a whole number of (region, offset, size) triples")
                return
            table = np.frombuffer(req.packed, dtype="<u8").reshape(-1, 3).astype(np.int64)
        else:
            try:
                table = np.array([(r.region, r.offset, r.size) for r in req.ranges], dtype=np.int64).reshape(-1, 3)
            except OverflowError:  # msgpack ints reach 2**64 - 1 and down to -2**63
                self.rejected_ranges += 1
                self._refuse(conn, rid, who, "a range field does not fit in a signed 64-bit integer")
                return
        if len(table) > MAX_RANGES_PER_REQUEST:
            self._refuse(conn, rid, who, f"{len(table)} ranges in one request (limit {MAX_RANGES_PER_REQUEST})")
            return
        regions, offsets, sizes = table[:, 0], table[:, 1], table[:, 2]
        bad = out_of_bounds(regions, offsets, sizes, self._regions.sizes)
        if bad is not None:
            self.rejected_ranges += 1
            r, o, s = (int(x) for x in table[bad])
            self._refuse(
                conn, rid, who,
                f"range {bad} (region {r}, offset {o}, size {s}) is outside the registered regions",
            )
            return
        total = int(sizes.sum())
        head = frame(wire.encode(wire.ReadReply(req_id=rid, ok=True, total=total)))
        views = [memoryview(head)]
        views.extend(self._regions.views(regions, offsets, sizes))
        lengths = np.empty(len(views), dtype=np.int64)
        lengths[0] = len(head)
        lengths[1:] = sizes
        send_views(conn, views, lengths)
        log.debug("%s: request %d: sent %d bytes in %d ranges", who, rid, total, len(table))

    def _refuse(self, conn: socket.socket, rid: int, who: str, why: str) -> None:
        log.warning("%s: request %d refused: %s", who, rid, why)
        conn.sendall(frame(wire.encode(wire.ReadReply(req_id=rid, ok=False, error=f"tcp: {why}"))))

    # ------------------------------------------------------------------
    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        os.write(self._wake_w, b"x")
        with self._lock:
            conns = list(self._conns.values())
        for conn, _ in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accept_thread.join(timeout=5)
        try:
            self._lsock.close()
        except OSError:
            pass
        for _, t in conns:
            t.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

