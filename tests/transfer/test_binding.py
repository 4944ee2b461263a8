"""Listeners bind the address they are given (``bind_host``, else ``host``),
never all interfaces unless asked; descriptors advertise ``host``."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from atom_kv.testing.listeners import listeners
from atom_kv import wire
from atom_kv.config import KVTransferConfig
from atom_kv.transfer import create_backend
from atom_kv.transfer.cma.syscalls import cma_unavailable_reason

CMA_REASON = cma_unavailable_reason()
BACKENDS = ["tcp", "auto", pytest.param("cma", marks=pytest.mark.skipif(CMA_REASON is not None,
                                                                          reason=CMA_REASON or ""))]


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _bound_addresses(port: int) -> set[str]:
    """Local addresses of this process's listening IPv4 sockets on ``port``
    (from /proc: exact, whatever else listens on the machine)."""
    return {addr for addr, p in listeners(v6=False) if p == port}


def _listeners(name: str, blob: bytes) -> list[tuple[str, int]]:
    """(advertised host, port) of every listener a descriptor names."""
    if name == "tcp":
        d = wire.decode(blob, wire.TcpDescriptor)
        return [(d.host, d.port)]
    if name == "cma":
        c = wire.decode(blob, wire.CmaDescriptor)
        return [(c.ctl_host, c.ctl_port)]
    auto = wire.decode(blob, wire.AutoDescriptor)
    out = _listeners("tcp", auto.tcp)
    return out + (_listeners("cma", auto.cma) if auto.cma else [])


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("bind_host", [None, "127.0.0.2"])
def test_listeners_bind_only_the_given_address(name: str, bind_host: str | None) -> None:
    cfg = KVTransferConfig(kv_role="kv_producer")
    buf = np.zeros(4096, dtype=np.uint8)
    with create_backend(name, cfg, host="127.0.0.2", bind_host=bind_host) as be:
        be.register_memory(buf.ctypes.data, buf.nbytes)
        listeners = _listeners(name, be.export_descriptor())
        assert listeners
        for host, port in listeners:
            assert host == "127.0.0.2"
            assert _bound_addresses(port) == {"127.0.0.2"}
            assert _reachable("127.0.0.2", port)


@pytest.mark.parametrize("name", BACKENDS)
def test_all_interfaces_only_when_asked_and_the_advertised_host_is_kept(name: str) -> None:
    cfg = KVTransferConfig(kv_role="kv_producer")
    buf = np.zeros(4096, dtype=np.uint8)
    with create_backend(name, cfg, host="127.0.0.1", bind_host="0.0.0.0") as be:
        be.register_memory(buf.ctypes.data, buf.nbytes)
        for host, port in _listeners(name, be.export_descriptor()):
            assert host == "127.0.0.1"  # peers are told the address, not the wildcard
            assert _bound_addresses(port) == {"0.0.0.0"}
            assert _reachable("127.0.0.1", port) and _reachable("127.0.0.2", port)
