"""ZeroMQ ``tcp://`` endpoints for a host (an IP address, IPv6 too, or a name)."""

from __future__ import annotations

import socket
from typing import Callable, Optional

import zmq

__all__ = ["tcp_endpoint", "connect_socket"]


def tcp_endpoint(host: str, port: int) -> tuple[str, bool]:
    """The ``tcp://`` endpoint of ``host:port`` (a name is resolved here: ZeroMQ
    binds only addresses) and whether it is IPv6 (the socket then needs
    ``zmq.IPV6``). Raises :class:`ValueError` for a name that does not resolve."""
    addr = host.strip("[]")
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, addr)
            break
        except OSError:
            continue
    else:
        try:
            addr = str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, IndexError) as exc:
            raise ValueError(f"cannot resolve host {host!r}: {exc}") from None
    if ":" in addr:
        return f"tcp://[{addr}]:{port}", True
    return f"tcp://{addr}:{port}", False


def connect_socket(ctx: zmq.Context, kind: int, host: str, port: int, options: dict[int, int],
                   before_connect: Optional[Callable[[zmq.Socket], None]] = None) -> zmq.Socket:
    """A new socket of ``kind`` with ``LINGER`` 0 and ``options``, connected to ``host:port``;
    ``before_connect`` is called with it just before it connects (a monitor sees the first attempt)."""
    endpoint, ipv6 = tcp_endpoint(host, port)
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        for option, value in options.items():
            sock.setsockopt(option, value)
        if before_connect is not None:
            before_connect(sock)
        sock.connect(endpoint)
    except BaseException:
        sock.close(0)
        raise
    return sock
