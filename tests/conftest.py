"""Shared test fixtures: free loopback ports (one helper, from atom_kv.testing.ports)."""

from __future__ import annotations

import pytest

from atom_kv.testing.ports import free_port

__all__ = ["free_port"]


@pytest.fixture
def port() -> int:
    return free_port()
