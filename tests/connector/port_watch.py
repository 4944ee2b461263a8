"""A host a client names in ``kv_transfer_params``, as a test sees it: ZeroMQ ROUTER sockets on
consecutive loopback ports that answer nothing and record what each port receives."""

from __future__ import annotations

import time
from typing import Callable

import zmq

from atom_kv import wire
from atom_kv.testing.ports import free_port_range


class PortWatch:
    """Owns ``n`` ROUTER sockets bound on ``base .. base+n-1`` of 127.0.0.1 and the messages
    each received (the type name of each: ``HandshakeRequest``, ``Release``, ...)."""

    def __init__(self, n: int, attempts: int = 20) -> None:
        self._ctx = zmq.Context()
        self.socks: list[zmq.Socket] = []
        for _ in range(attempts):
            self.base = free_port_range(n)
            try:
                for i in range(n):
                    sock = self._ctx.socket(zmq.ROUTER)
                    sock.setsockopt(zmq.LINGER, 0)
                    self.socks.append(sock)
                    sock.bind(f"tcp://127.0.0.1:{self.base + i}")
                break
            except zmq.ZMQError:  # taken meanwhile: another range
                for sock in self.socks:
                    sock.close()
                self.socks = []
        else:
            raise RuntimeError(f"no {n} free ports in a row")
        self.seen: list[list[str]] = [[] for _ in range(n)]

    def collect(self, wait_s: float) -> None:
        """Record what arrives on any port for ``wait_s`` seconds (blocking in a poll)."""
        self.wait_for(lambda: False, wait_s)

    def wait_for(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Record what arrives until ``done()`` (True) or ``timeout_s`` passed (False)."""
        poller = zmq.Poller()
        for sock in self.socks:
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for sock, _ in poller.poll(left * 1000):
                i = self.socks.index(sock)
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.seen[i].append(_name(frames[-1]))
        return True

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self._ctx.term()


def _name(data: bytes) -> str:
    try:
        return type(wire.decode(data, wire.HandshakeMessage)).__name__
    except wire.WireError:
        return "garbage"
