"""A listening TCP socket that accepts no connection: its listen backlog is full, so the kernel drops
further SYNs, as a firewall's DROP rule does, and a connection attempt to it gets no answer."""

from __future__ import annotations

import socket
from contextlib import contextmanager
from typing import Iterator

__all__ = ["ConnectionsNotDropped", "unaccepting_listener"]


class ConnectionsNotDropped(RuntimeError):
    """This kernel completes connections past a full listen backlog (the listener cannot drop them)."""


@contextmanager
def unaccepting_listener(host: str = "127.0.0.1", port: int = 0) -> Iterator[int]:
    """Listen on ``host:port`` (0: the OS picks) with a full backlog; yields the port, closes it on exit.
    Raises :class:`ConnectionsNotDropped` where a probe connection still completes, :class:`OSError` where
    the address cannot be bound."""
    listener = socket.socket()
    fillers: list[socket.socket] = []
    try:
        listener.bind((host, port))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(2):
            filler = socket.socket()
            filler.setblocking(False)
            fillers.append(filler)
            filler.connect_ex((host, port))
        try:
            socket.create_connection((host, port), timeout=0.3).close()
        except OSError:
            pass  # dropped: what the callers need
        else:
            raise ConnectionsNotDropped("this kernel completes connections past a full listen backlog")
        yield port
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
