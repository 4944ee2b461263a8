"""A health probe that times out is a reason: in ``/instances``, in one WARNING, and in the engine's answer.

Real sockets on 127.0.0.1: an engine address whose server accepts and never answers (the probe connects, and
its ``GET /health`` times out), and one whose connections are never accepted (a full listen backlog: the
kernel drops the SYNs, as a DROP rule does, so the probe's connect times out). The namespace test with a
real iptables rule is ``tests/e2e/test_firewall.py``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Iterator

import pytest

from atom_kv.testing.web import http_json
from tests.proxy.test_registration_answers import _answers, _asking

PROBE_S = 0.2  # the FAST settings' probe interval (tests/proxy/conftest.py); probe and connect timeouts: 1 s


class SilentServer:
    """Accepts connections (on a named thread) and never answers; counts them."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="silent-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in self.accepted:
            conn.close()
        self.sock.close()


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


def _instance(proxy, base_url: str) -> dict | None:
    status, listing = http_json("GET", proxy.url + "/instances", timeout=5.0)
    assert status == 200
    return next((i for i in listing if i["address"] == base_url), None)


async def _registered_at(proxy, make_engine, port: int) -> tuple[str, dict]:
    """Register a decode engine whose address is ``127.0.0.1:port``; its URL and ping fields."""
    d = await make_engine("D")
    base_url = f"http://127.0.0.1:{port}"
    fields = dict(d.register_fields(), request_address=base_url + "/v1/completions")
    (answer,) = await _answers(proxy, [_asking(fields)], 1)
    assert (answer.status, answer.reason) == ("registered", "")
    return base_url, fields


async def test_an_engine_that_never_answers_its_probe_is_pending_with_the_timeout_said_once(
        make_proxy, make_engine, silent, caplog):
    caplog.set_level(logging.INFO, logger="atom_kv.proxy.fleet.registry")
    proxy = await make_proxy()
    base_url, fields = await _registered_at(proxy, make_engine, silent.port)
    assert await proxy.registry.wait_for(lambda r: any(i.down_reason for i in r.known("D")), 5.0)
    entry = await asyncio.to_thread(_instance, proxy, base_url)
    assert entry is not None and entry["state"] == "pending"
    assert entry["down_reason"].startswith("health probe timed out after 1 s"), entry
    assert f"127.0.0.1:{silent.port}" in entry["down_reason"] and "not answered" in entry["down_reason"], entry

    # the engine is told in its registration answer
    (answer,) = await _answers(proxy, [_asking(fields)], 1)
    assert (answer.status, answer.reason) == ("registered", "unreachable")
    assert "timed out after 1 s" in answer.detail and "firewall" in answer.detail, answer.detail

    # more probes time out: still one WARNING for this engine, and it is never routed
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10.0
    while len(silent.accepted) < 3 and loop.time() < deadline:
        await asyncio.sleep(PROBE_S)
    assert len(silent.accepted) >= 3, "the proxy did not probe the engine again"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and base_url in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "is not reachable" in warnings[0].getMessage() and "firewall" in warnings[0].getMessage()
    assert proxy.registry.live("D") == []


async def test_an_engine_whose_connections_are_never_accepted_times_out_connecting(
        make_proxy, make_engine, unaccepting_port):
    proxy = await make_proxy()
    base_url, fields = await _registered_at(proxy, make_engine, unaccepting_port)
    assert await proxy.registry.wait_for(lambda r: any(i.down_reason for i in r.known("D")), 5.0)
    entry = await asyncio.to_thread(_instance, proxy, base_url)
    assert entry is not None and entry["state"] == "pending"
    assert entry["down_reason"] == (
        f"health probe timed out after 1 s: connect to 127.0.0.1:{unaccepting_port} timed out")
    (answer,) = await _answers(proxy, [_asking(fields)], 1)
    assert (answer.status, answer.reason) == ("registered", "unreachable")
    assert "timed out after 1 s" in answer.detail
