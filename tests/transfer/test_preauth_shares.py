"""Fair shares for strangers on the data path's pre-authentication ports (real sockets on 127.0.0.x; the
whole 127.0.0.0/8 is loopback, so each address is a distinct source): the ``tcp`` read server and the
``cma``/``gpu_ipc`` grant endpoint. Strangers hold idle connections that never send their hello, on the
legitimate reader's own address or on 64 others; the reader's 20 connects (tcp) and 20 grants all get
through. The issue measured 1 of 20 on both, and a refusal text that blamed "512 connections open"."""

from __future__ import annotations

import os
import socket
import threading
from typing import Any, Callable, Optional

import pytest

from atom_kv import wire
from atom_kv.transfer._grant import GrantServer, request_grant
from atom_kv.transfer._sockio import frame, recv_frame
from atom_kv.transfer._trust import PURPOSE_CMA_GRANT
from atom_kv.transfer.base import TransferError
from atom_kv.testing.polling import wait_until
from tests.transfer._raw import TCP_PURPOSE, proof, tcp_login, tcp_open
from tests.transfer.test_tcp_server_limits import Served

TOKEN = "shares-token-3b9e51"
LEGITIMATE = 20


class Strangers:
    """Connections that never send their hello, from given source addresses; a thread keeps opening more
    (``per_s`` a second) so closed ones are replaced, as a real stranger would."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def open(self, source: str, n: int) -> None:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", self.port), timeout=5, source_address=(source, 0))
            with self._lock:
                self.socks.append(s)

    def keep_opening(self, sources: list[str], per_s: float, limit: int) -> None:
        def run() -> None:
            i = 0
            while not self._stop.wait(1.0 / per_s) and i < limit:
                try:
                    self.open(sources[i % len(sources)], 1)
                except OSError:
                    pass
                i += 1
        self._thread = threading.Thread(target=run, name="test-strangers", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            for s in self.socks:
                s.close()


def _legitimate(attempt: Callable[[], Optional[str]]) -> list[str]:
    failures = []
    for _ in range(LEGITIMATE):
        why = attempt()
        if why:
            failures.append(why)
    return failures


# -- tcp -------------------------------------------------------------------------
def _tcp_connect(srv: Served) -> Optional[str]:
    """A reader's connect: the server's greeting, then the hello with the proof; None, or why it failed."""
    try:
        s, greeting = tcp_open(srv.host, srv.port)
        with s:
            if not greeting.ok:
                return greeting.error
            nonce = os.urandom(16).hex()
            s.sendall(frame(wire.encode(wire.TcpHello(key="reader", nonce=nonce, proof=proof(
                TOKEN, TCP_PURPOSE, b"reader", greeting.nonce, nonce)))))
            reply = wire.decode(recv_frame(s), wire.TcpHelloReply)
            return None if reply.ok else reply.error
    except (OSError, wire.WireError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _refused(stats: dict[str, int]) -> int:
    return stats.get("busy", 0) + stats.get("busy_source", 0)


@pytest.fixture
def served():
    made = []

    def make(**tcp: Any) -> Served:
        """A read server with a token and these ``tcp`` keys."""
        srv = Served(auth_token=TOKEN, tcp={"read_timeout_s": 60, "hello_timeout_s": 60, **tcp})
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.close()


def test_tcp_a_stranger_on_the_readers_address_slows_only_itself(served):
    srv = served()
    strangers = Strangers(srv.port)
    try:
        strangers.open("127.0.0.1", 200)  # more than tcp.max_unauthenticated_per_source (64), all idle
        wait_until(lambda: srv.backend.server.connections <= 64 and srv.stats().get("busy_source", 0) >= 136, 20,
                   interval=0.02, what="the address's oldest connections closed")
        strangers.keep_opening(["127.0.0.1"], per_s=50, limit=2000)
        failures = _legitimate(lambda: _tcp_connect(srv))
        assert failures == [], f"{len(failures)} of {LEGITIMATE} refused: {failures[0]}"
        srv.read_check(auth_token=TOKEN)  # a real reader (tcp.streams connections) reads, the stranger still at it
    finally:
        strangers.close()


def test_tcp_64_strangers_leave_legitimate_connects_at_20_of_20(served):
    srv = served(max_connections=128)
    sources = [f"127.0.0.{i}" for i in range(2, 66)]
    strangers = Strangers(srv.port)
    try:
        for src in sources:
            strangers.open(src, 4)  # 256 idle connections: twice tcp.max_connections
        wait_until(lambda: _refused(srv.stats()) >= 128, 20, interval=0.02, what="the shares enforced")
        assert srv.backend.server.connections <= 128
        strangers.keep_opening(sources, per_s=50, limit=2000)
        failures = _legitimate(lambda: _tcp_connect(srv))
        assert failures == [], f"{len(failures)} of {LEGITIMATE} refused: {failures[0]}"
        srv.read_check(auth_token=TOKEN)
    finally:
        strangers.close()


def test_tcp_refusals_name_the_real_cause(served, caplog):
    srv = served(max_connections=4)
    held = [tcp_login(srv.host, srv.port, TOKEN)[0] for _ in range(4)]  # every slot authenticated
    try:
        why = _tcp_connect(srv)
        assert why and "4 connections already open (tcp.max_connections)" in why, why
    finally:
        for s in held:
            s.close()
    wait_until(lambda: srv.backend.server.connections == 0, 10, interval=0.02, what="connections closed")
    # with slots free again, connections are taken again; the one refusal was counted once
    s, greeting = tcp_open(srv.host, srv.port)
    with s:
        assert greeting.ok
        newer, again = tcp_open(srv.host, srv.port)
        with newer:
            assert again.ok
    assert srv.stats().get("busy", 0) == 1


# -- cma / gpu_ipc grants --------------------------------------------------------------
@pytest.fixture
def grant_endpoint():
    server = GrantServer(bind_host="127.0.0.1", host="127.0.0.1", auth_token=TOKEN, timeout_s=30.0,
                              max_connections=64, spans=lambda: [(0, 4096, 4096)], label="test grant endpoint")
    yield server
    server.close()


def _grant(server: GrantServer) -> Optional[str]:
    desc = wire.CmaDescriptor(pid=os.getpid(), host_id="h", ctl_host="127.0.0.1", ctl_port=server.port)
    try:
        reply = request_grant(desc, "reader", TOKEN, 5.0, purpose=PURPOSE_CMA_GRANT)
    except TransferError as exc:
        return str(exc)
    return None if reply.ok and reply.regions else reply.error or "no regions"


def test_grants_a_stranger_holding_idle_connections_on_the_readers_address_slows_only_itself(grant_endpoint):
    strangers = Strangers(grant_endpoint.port)
    try:
        strangers.open("127.0.0.1", 100)  # more than cma.grant_max_connections (64), all idle
        wait_until(lambda: _refused(grant_endpoint.stats()) >= 36, 20, interval=0.02,
                   what="the stranger's share enforced")
        strangers.keep_opening(["127.0.0.1"], per_s=50, limit=2000)
        failures = _legitimate(lambda: _grant(grant_endpoint))
        assert failures == [], f"{len(failures)} of {LEGITIMATE} refused: {failures[0]}"
        wait_until(lambda: grant_endpoint.grants == LEGITIMATE, 10, interval=0.02, what="every grant counted")
    finally:
        strangers.close()


def test_grants_64_strangers_leave_legitimate_grants_at_20_of_20(grant_endpoint):
    sources = [f"127.0.0.{i}" for i in range(2, 66)]
    strangers = Strangers(grant_endpoint.port)
    try:
        for src in sources:
            strangers.open(src, 2)  # 128 idle connections: twice cma.grant_max_connections
        wait_until(lambda: _refused(grant_endpoint.stats()) >= 64, 20, interval=0.02, what="the shares enforced")
        strangers.keep_opening(sources, per_s=50, limit=2000)
        failures = _legitimate(lambda: _grant(grant_endpoint))
        assert failures == [], f"{len(failures)} of {LEGITIMATE} refused: {failures[0]}"
    finally:
        strangers.close()
