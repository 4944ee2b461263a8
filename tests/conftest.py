"""Shared test helpers: free loopback ports and process hygiene."""

from __future__ import annotations

import socket

import pytest


def free_port() -> int:
    """A TCP port the OS says is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port() -> int:
    return free_port()
