"""Fair shares on a producer rank's handshake port: strangers who never answer their challenge, on the
legitimate decode engine's own address or on 64 other addresses (127.0.0.2..127.0.0.65, all loopback),
leave that engine's handshakes at 20 of 20. The issue measured 14 of 19 refused with 64 sources, and every
one refused after about 10 s with one stranger on the decode engine's address at 6.7 requests a second."""

from __future__ import annotations

import threading
import time

import zmq

from atom_kv import wire
from atom_kv.auth import new_nonce
from atom_kv.connector.handshake import HandshakeRejected, request_handshake
from tests.conftest import free_port
from tests.connector.inproc import producer_engine
from tests.connector.kvutil import compat
from tests.connector.test_trust import TOKEN

LEGITIMATE = 20


class Strangers:
    """DEALER sockets, one per source address, sending handshake requests they never prove (a thread)."""

    def __init__(self, port: int, sources: list[str], per_socket: int = 1) -> None:
        self.ctx = zmq.Context()
        self.socks = []
        for src in sources:
            for _ in range(per_socket):
                s = self.ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDHWM, 100_000)
                s.connect(f"tcp://{src}:0;127.0.0.1:{port}")
                self.socks.append(s)
        self.sent = 0
        self.answers = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _request(self) -> bytes:
        return wire.encode(wire.HandshakeRequest(engine_id="stranger", tp_rank=0, tp_size=1, compat=compat(),
                                                 backend="tcp", nonce=new_nonce()))

    def burst(self, n: int) -> None:
        """``n`` requests on every socket, now."""
        for s in self.socks:
            for _ in range(n):
                s.send(self._request(), zmq.NOBLOCK)
                self.sent += 1

    def drain(self, timeout_s: float) -> None:
        """Read answers until every request sent has one (or ``timeout_s`` passes)."""
        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while self.answers < self.sent and time.monotonic() < deadline:
            for s, _ in poller.poll(200):
                while True:
                    try:
                        s.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.answers += 1

    def keep_sending(self, per_s: float, limit: int) -> None:
        """A thread: one request on each socket in turn, ``per_s`` a second, ``limit`` at most."""
        def run() -> None:
            i = 0
            while not self._stop.wait(1.0 / per_s) and i < limit:
                self.socks[i % len(self.socks)].send(self._request(), zmq.NOBLOCK)
                i += 1
        self._thread = threading.Thread(target=run, name="test-strangers", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for s in self.socks:
            s.close(0)
        self.ctx.term()


def _legitimate_handshakes(port: int) -> list[str]:
    """Twenty proven handshakes from 127.0.0.1, one after the other: the failures' messages."""
    ctx = zmq.Context()
    failures = []
    try:
        for _ in range(LEGITIMATE):
            req = wire.HandshakeRequest(engine_id="D", tp_rank=0, tp_size=1, compat=compat(), backend="tcp")
            try:
                reply = request_handshake(ctx, "127.0.0.1", port, req, 10.0, auth_token=TOKEN)
                if not reply.ok:
                    failures.append(reply.error)
            except HandshakeRejected as exc:
                failures.append(str(exc))
    finally:
        ctx.term()
    return failures


def test_a_stranger_on_the_decode_engines_own_address_slows_only_itself():
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN, handshake_timeout_s=30.0)
    strangers = Strangers(port, ["127.0.0.1"], per_socket=4)
    try:
        strangers.burst(100)  # 400 pending requests from the decode engine's address: over its cap of 64
        strangers.drain(20)
        assert strangers.answers == strangers.sent
        strangers.keep_sending(per_s=200, limit=20_000)
        failures = _legitimate_handshakes(port)
        assert failures == [], f"{len(failures)} of {LEGITIMATE} refused: {failures[0]}"
        assert pw.handshake_server.refusals().get("challenges_source", 0) > 0  # the stranger pushed out its own
    finally:
        strangers.close()
        pw.close()


def test_64_strangers_leave_legitimate_handshakes_at_20_of_20():
    port = free_port()
    P, pw, _ = producer_engine(port, auth_token=TOKEN, handshake_timeout_s=30.0)
    strangers = Strangers(port, [f"127.0.0.{i}" for i in range(2, 66)])
    try:
        strangers.burst(80)  # 5,120 pending requests: more than the 4,096 a rank keeps
        strangers.drain(60)
        assert strangers.answers == strangers.sent
        strangers.keep_sending(per_s=200, limit=20_000)
        failures = _legitimate_handshakes(port)
        assert failures == [], f"{len(failures)} of {LEGITIMATE} refused: {failures[0]}"
        assert len(pw.handshake_server._challenges) <= 4096
    finally:
        strangers.close()
        pw.close()
