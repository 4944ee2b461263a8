"""Raw-socket helpers for the data-path protocol tests: speak the tcp read
and cma grant protocols by hand (proofs computed here from the protocol's
definition, independently of the code under test), record what a reader
sends, and measure this process (threads, RSS)."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import threading
from typing import Callable, Optional

from atom_kv import wire
from atom_kv.transfer._sockio import frame, recv_frame

TCP_PURPOSE = b"atom-kv/tcp-read/v1"
CMA_PURPOSE = b"atom-kv/cma-grant/v1"


def proof(token: str, purpose: bytes, role: bytes, server_nonce: str, reader_nonce: str) -> str:
    """HMAC-SHA256(token, purpose \\0 role \\0 server_nonce \\0 reader_nonce), hex."""
    msg = b"\0".join((purpose, role, server_nonce.encode(), reader_nonce.encode()))
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def tcp_open(host: str, port: int) -> tuple[socket.socket, wire.TcpServerHello]:
    """Connect and read the server's first frame."""
    s = socket.create_connection((host, port), timeout=5)
    return s, wire.decode(recv_frame(s), wire.TcpServerHello)


def tcp_login(host: str, port: int, token: Optional[str]) -> tuple[socket.socket, wire.TcpHelloReply]:
    """A hand-made reader hello (a correct proof when ``token`` is given)."""
    s, greeting = tcp_open(host, port)
    nonce, mac = "", ""
    if token is not None:
        nonce = os.urandom(16).hex()
        mac = proof(token, TCP_PURPOSE, b"reader", greeting.nonce, nonce)
    s.sendall(frame(wire.encode(wire.TcpHello(key="raw", nonce=nonce, proof=mac))))
    reply = wire.decode(recv_frame(s), wire.TcpHelloReply)
    if reply.ok and token is not None:
        assert reply.proof == proof(token, TCP_PURPOSE, b"server", greeting.nonce, nonce), "server proof is wrong"
    return s, reply


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc status")


def thread_count(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def closed_by_peer(s: socket.socket, timeout: float) -> bool:
    """True when the peer closes ``s`` (EOF or reset) within ``timeout`` seconds."""
    s.settimeout(timeout)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


class Recorder:
    """A loopback relay that forwards one or more connections to ``upstream``
    and records every byte each way (to prove what does and does not travel).
    With ``upstream=None`` it is a fake server: ``script(sock, log)`` speaks
    to each accepted connection and records what it receives."""

    def __init__(self, upstream: Optional[tuple[str, int]] = None,
                 script: Optional[Callable[[socket.socket, bytearray], None]] = None) -> None:
        self.upstream = upstream
        self.script = script
        self.to_server = bytearray()
        self.to_reader = bytearray()
        self._lock = threading.Lock()
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self._lsock.getsockname()[1]
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        t = threading.Thread(target=self._accept, name="test-recorder-accept", daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        self._lsock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self._lsock.accept()
            except (TimeoutError, OSError):
                continue
            conn.settimeout(None)
            self._socks.append(conn)
            if self.upstream is None:
                assert self.script is not None
                t = threading.Thread(target=self._run_script, args=(conn,), name="test-recorder-script", daemon=True)
                t.start()
                self._threads.append(t)
                continue
            up = socket.create_connection(self.upstream, timeout=5)
            up.settimeout(None)
            self._socks.append(up)
            for src, dst, log in ((conn, up, self.to_server), (up, conn, self.to_reader)):
                t = threading.Thread(target=self._pump, args=(src, dst, log), name="test-recorder-pump", daemon=True)
                t.start()
                self._threads.append(t)

    def _run_script(self, conn: socket.socket) -> None:
        try:
            self.script(conn, self.to_server)  # type: ignore[misc]
        except OSError:
            pass
        finally:
            conn.close()

    def _pump(self, src: socket.socket, dst: socket.socket, log: bytearray) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                with self._lock:
                    log += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop = True
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in self._threads:
            t.join(5)
        self._lsock.close()


def record_until_closed(conn: socket.socket, log: bytearray, timeout: float = 5) -> None:
    """Append everything ``conn`` receives to ``log`` until the other side closes."""
    conn.settimeout(timeout)
    try:
        while True:
            data = conn.recv(65536)
            if not data:
                return
            log += data
    except (TimeoutError, OSError):
        return
