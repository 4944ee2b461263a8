"""Shared test fixtures: free loopback ports (one helper, from atom_kv.testing.ports), and a port whose
connections are never accepted."""

from __future__ import annotations

from typing import Iterator

import pytest

from atom_kv.testing.ports import free_port
from atom_kv.testing.unaccepting import ConnectionsNotDropped, unaccepting_listener

__all__ = ["free_port"]


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def unaccepting_port() -> Iterator[int]:
    """A loopback port whose listen backlog is full, so the kernel drops further SYNs as a DROP rule does: a
    connection attempt gets no answer (skipped on a kernel that completes them anyway)."""
    try:
        with unaccepting_listener() as port:
            yield port
    except ConnectionsNotDropped as exc:
        pytest.skip(str(exc))
