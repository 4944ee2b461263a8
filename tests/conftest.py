"""Shared test fixtures: free loopback ports (one helper, from atom_kv.testing.ports), and a port whose
connections are never accepted."""

from __future__ import annotations

import socket
from typing import Iterator

import pytest

from atom_kv.testing.ports import free_port

__all__ = ["free_port"]


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def unaccepting_port() -> Iterator[int]:
    """A loopback port whose listen backlog is full, so the kernel drops further SYNs as a DROP rule does: a
    connection attempt gets no answer (skipped on a kernel that completes them anyway)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(2):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.3).close()
        except OSError:
            pass  # dropped: what the tests need
        else:
            pytest.skip("this kernel completes connections past a full listen backlog")
        yield port
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
