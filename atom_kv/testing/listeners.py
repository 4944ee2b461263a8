"""Which TCP ports a process listens on, read from ``/proc`` (Linux): exact, whatever else listens on the
machine, for the tests that check an engine's listeners against its port plan."""

from __future__ import annotations

import os
import socket
from typing import Iterable, Optional

__all__ = ["listeners"]

_LISTEN = "0A"


def _socket_inodes(pid: Optional[int]) -> set[str]:
    where = f"/proc/{pid if pid is not None else 'self'}/fd"
    inodes: set[str] = set()
    try:
        fds = os.listdir(where)
    except OSError:  # the process is gone
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"{where}/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


def _address(hexaddr: str, v6: bool) -> str:
    raw = bytes.fromhex(hexaddr)
    if not v6:
        return socket.inet_ntoa(raw[::-1])
    # /proc shows IPv6 as four host-order 32-bit words
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def listeners(pids: Optional[Iterable[int]] = None, *, v6: bool = True) -> set[tuple[str, int]]:
    """``(address, port)`` of every listening TCP socket held by ``pids`` (default: this process), IPv4 and,
    with ``v6``, IPv6 (an IPv6 address as ``inet_ntop`` writes it, e.g. ``::``)."""
    inodes: set[str] = set()
    for pid in (pids if pids is not None else [None]):
        inodes |= _socket_inodes(pid)
    out = set()
    for table, is_v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        if is_v6 and not v6:
            continue
        try:
            with open(table, encoding="ascii") as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == _LISTEN and cols[9] in inodes:
                        addr, port = cols[1].split(":")
                        out.add((_address(addr, is_v6), int(port, 16)))
        except OSError:  # no IPv6 on this host
            continue
    return out
