"""Free loopback ports, for servers that cannot bind port 0 and report what they got.

Prefer port 0 wherever the server can tell its bound port back (the
reference engine's ``--port 0 --port-file``): a port found free here can be
taken by someone else before the server binds it.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port", "free_port_range"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS says is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int, attempts: int = 200) -> int:
    """A base port such that ``base .. base+n-1`` are all free on 127.0.0.1 right now."""
    for _ in range(attempts):
        base = random.randint(20000, 60000 - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")
