"""The cma backend's control endpoint: a tiny socket server (one named
thread) in the serving process. A reader must present the ``auth_token`` (if
set) and its pid; it gets back the region table it may read. It also proves
the serving process is alive at ``add_peer`` time."""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from typing import Callable, Optional

from atom_kv import wire
from atom_kv.transfer._sockio import frame, recv_frame, wait_readable

log = logging.getLogger(__name__)


class CmaControlServer:
    """Owns the listening socket and the thread answering grant requests."""

    def __init__(
        self, host: str, auth_token: Optional[str], timeout_s: float,
        spans: Callable[[], list[tuple[int, int, int]]], label: str,
    ) -> None:
        self._token = auth_token.encode() if auth_token else None
        self._timeout = timeout_s
        self._spans = spans
        self._label = label
        self._lsock = socket.create_server((host, 0), backlog=64)
        self.host = host
        self.port = self._lsock.getsockname()[1]
        self._wake_r, self._wake_w = os.pipe()
        self._stop = threading.Event()
        self.decode_errors = 0
        self.auth_failures = 0
        self.grants = 0
        self._thread = threading.Thread(target=self._run, name=f"atomkv-cma-ctl-{self.port}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not wait_readable(self._lsock, self._wake_r, self._timeout):
                    continue
                conn, _ = self._lsock.accept()
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("%s: accept failed", self._label)
                continue
            with conn:
                try:
                    self._answer(conn)
                except (OSError, TimeoutError, ConnectionError) as exc:
                    log.info("%s: grant connection dropped: %s", self._label, exc)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(self._timeout)
        data = recv_frame(conn, time.monotonic() + self._timeout)
        try:
            req = wire.decode(data, wire.CmaGrantRequest)
        except wire.WireError as exc:
            self.decode_errors += 1
            log.warning("%s: bad grant request: %s", self._label, exc)
            conn.sendall(frame(wire.encode(wire.CmaGrantReply(ok=False, error=f"cma: bad grant request: {exc}"))))
            return
        if self._token is not None and not hmac.compare_digest((req.auth_token or "").encode(), self._token):
            self.auth_failures += 1
            log.warning("%s: refused reader pid %d (%r): wrong or missing auth_token", self._label, req.pid, req.key)
            reply = wire.CmaGrantReply(ok=False, error="cma: the peer rejected our auth_token (wrong or missing)")
            conn.sendall(frame(wire.encode(reply)))
            return
        spans = [wire.RegionSpan(region=r, addr=a, size=s) for r, a, s in self._spans()]
        self.grants += 1
        log.info("%s: granted reader pid %d (%r) %d regions", self._label, req.pid, req.key, len(spans))
        conn.sendall(frame(wire.encode(wire.CmaGrantReply(ok=True, pid=os.getpid(), regions=spans))))

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        self._lsock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def request_grant(
    desc: wire.CmaDescriptor, key: str, auth_token: Optional[str], timeout_s: float
) -> wire.CmaGrantReply:
    """Ask a peer's control endpoint for its region table."""
    where = f"{desc.ctl_host}:{desc.ctl_port} (pid {desc.pid})"
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((desc.ctl_host, desc.ctl_port), timeout=timeout_s) as sock:
            sock.sendall(frame(wire.encode(wire.CmaGrantRequest(pid=os.getpid(), key=key, auth_token=auth_token))))
            return wire.decode(recv_frame(sock, deadline), wire.CmaGrantReply)
    except wire.WireError as exc:
        log.warning("cma: bad grant reply from %s: %s", where, exc)
        return wire.CmaGrantReply(ok=False, error=f"cma: bad grant reply from {where}: {exc}")
    except (OSError, TimeoutError) as exc:
        return wire.CmaGrantReply(ok=False, error=f"cma: cannot reach peer control endpoint {where}: {exc or 'timed out'}")
