"""Free loopback ports, for servers that cannot bind port 0 and report what they got.

Prefer port 0 wherever the server can tell its bound port back (the
reference engine's ``--port 0 --port-file``): a port found free here can be
taken by someone else before the server binds it.

:func:`free_port` and :func:`free_port_range` pick ports *below* the kernel's ephemeral
range, so no outgoing connection and no listener on port 0 can ever be given one of them. That matters for ports a
server must bind again after a restart: a peer that keeps reconnecting to a
dead server's ephemeral port on loopback is eventually handed that very port
as its own source port (a TCP self-connect) and holds it.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_ephemeral_window", "free_plan_base", "free_port", "free_port_range"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, picked at random *below* the kernel's ephemeral
    range (as :func:`free_port_range`): a port the OS hands out itself (bind to port 0, the source port
    of any outgoing connection) can be taken by another process in the moment between this call and
    the server's bind, which made tests fail under load with "Address already in use"."""
    return free_port_range(1)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port_range(n: int, attempts: int = 200) -> int:
    """A base port such that ``base .. base+n-1`` are all free on 127.0.0.1 right now, outside
    the ephemeral range where possible (see the module docstring)."""
    return _free_blocks(n, (0,), attempts)


def free_plan_base(n: int, blocks: int = 4, attempts: int = 200) -> int:
    """A ``handshake_port`` whose whole default port plan is free on 127.0.0.1 right now:
    ``n`` ports (one per rank) at ``base + k*atom_kv.ports.STRIDE`` for each of ``blocks`` listener kinds."""
    from atom_kv.ports import STRIDE

    return _free_blocks(n, tuple(k * STRIDE for k in range(blocks)), attempts)


def free_ephemeral_window(n: int, attempts: int = 200) -> int:
    """The first of ``n`` consecutive free ports *inside* the kernel's ephemeral range (where the OS would
    pick a listener's port; a range below it, :func:`free_port_range`, serves UCX as well)."""
    low, high = _ephemeral_range()
    for _ in range(attempts):
        first = random.randint(low, high - n)
        if _all_free(range(first, first + n)):
            return first
    raise RuntimeError(f"no {n} free ports in a row in the ephemeral range {low}-{high}")


def _free_blocks(n: int, offsets: tuple[int, ...], attempts: int) -> int:
    span = max(offsets) + n
    low, high = _ephemeral_range()
    if low - span > 20000:
        first, last = 20000, low - span
    else:  # the ephemeral range starts too low to stay below it: stay above it if we can
        first, last = (high + 1, 65535 - span) if high + span < 65000 else (1024, 65535 - span)
    for _ in range(attempts):
        base = random.randint(first, last)
        if _all_free(p for off in offsets for p in range(base + off, base + off + n)):
            return base
    raise RuntimeError(f"no free ports found for {len(offsets)} blocks of {n}")


def _all_free(ports) -> bool:
    """Whether every port in ``ports`` can be bound on 127.0.0.1 right now."""
    socks = []
    try:
        for p in ports:
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", p))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()
