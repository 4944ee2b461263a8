"""Acting on a ZeroMQ connection through the file descriptor its socket monitor reported.

A monitor event names a connection by its descriptor, and the event may be
older than the connection's end: by the time it is read, the descriptor may
be closed or reused by another socket. Both helpers work on a duplicate of the
descriptor (closing it leaves ZeroMQ's open) and act only while it is still a
connected TCP socket on the listening port given.
"""

from __future__ import annotations

import os
import socket
from typing import Optional

__all__ = ["peer_of", "shutdown"]


def _open(fd: int) -> Optional[socket.socket]:
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _ours(sock: socket.socket, port: Optional[int]) -> bool:
    return port is None or sock.getsockname()[1] == port


def peer_of(fd: int, port: Optional[int] = None) -> Optional[str]:
    """The peer address of the connection on ``fd`` if it is a connected socket on local ``port``
    (any port when None), else None."""
    sock = _open(fd)
    if sock is None:
        return None
    with sock:
        try:
            return str(sock.getpeername()[0]) if _ours(sock, port) else None
        except (OSError, IndexError):
            return None


def shutdown(fd: int, port: Optional[int] = None) -> bool:
    """Shut the connection on ``fd`` down (ZeroMQ then sees it end and closes its side), if it is
    still a socket on local ``port``; whether it was."""
    sock = _open(fd)
    if sock is None:
        return False
    with sock:
        try:
            if not _ours(sock, port):
                return False
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False
