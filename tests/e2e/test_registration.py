"""Registration that answers, end to end: a real reference engine process and a real proxy process on
127.0.0.1. An engine with a wrong token, or pinging a port nobody serves, says so in one clear line within
10 s of its first ping (for the port: that it never connected); a registered engine says so once, and that
its connection was lost when the proxy dies."""

from __future__ import annotations

import json
import os
import re
import sys
from datetime import datetime

import pytest

from atom_kv.testing.polling import wait_until
from atom_kv.testing.ports import free_plan_base
from atom_kv.testing.processes import ManagedProcess
from atom_kv.testing.web import http_json
from tests.connector.test_discovery import non_ephemeral_port
from tests.proxy.procs import ProxyProcess

FIRST_PING = re.compile(r"registering P engine \S+ with ")


def _engine(log_dir: str, discovery_port: int, token: str) -> ManagedProcess:
    cfg = {"kv_role": "kv_producer", "backend": "tcp", "handshake_port": free_plan_base(1),
           "proxy_ip": f"127.0.0.1:{discovery_port}", "auth_token": token}  # default ping and answer timings
    return ManagedProcess("engine", [
        sys.executable, "-m", "atom_kv.reference", "--host", "127.0.0.1", "--port", "0",
        "--port-file", os.path.join(log_dir, "engine.port"), "--tp", "1", "--num-blocks", "16",
        "--log-level", "INFO", "--kv-transfer-config", json.dumps(cfg)], log_dir)


def _lines(proc: ManagedProcess, pattern: str) -> list[str]:
    with open(proc.log_path, encoding="utf-8", errors="replace") as f:
        return [line for line in f if re.search(pattern, line)]


def _line(proc: ManagedProcess, pattern: str, timeout: float) -> str:
    def found():
        if not proc.alive():
            raise AssertionError(f"the engine exited:\n{proc.tail()}")
        return _lines(proc, pattern)
    return wait_until(found, timeout, what=f"a log line matching {pattern!r}")[0]


def _at(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.fixture
def log_dir(tmp_path):
    return str(tmp_path)


def test_an_engine_with_the_wrong_token_logs_the_refusal_naming_the_token_within_10_s(log_dir):
    proxy = ProxyProcess("--registration-token", "the-proxys-secret")
    engine = None
    try:
        engine = _engine(log_dir, proxy.discovery_port, "another-secret")
        first = _line(engine, FIRST_PING.pattern, 120)  # the reference engine's start-up is not timed
        refused = _line(engine, "refused registration", 30)
        assert _at(refused) - _at(first) < 10, (first, refused)
        assert "WARNING" in refused and f"127.0.0.1:{proxy.discovery_port}" in refused and "(token)" in refused
        assert "--registration-token" in refused and "auth_token" in refused
        # more refused pings, no more lines: a state is logged when it changes
        wait_until(lambda: 'reason="auth"} 3.0' in http_json("GET", proxy.url + "/metrics")[1], 30,
                   what="three refused pings")
        assert len(_lines(engine, "refused registration")) == 1
        assert _lines(engine, "registered with proxy") == []
    finally:
        if engine is not None:
            engine.stop()
        proxy.kill()


def test_an_engine_pinging_a_port_nobody_serves_warns_within_10_s_naming_the_causes(log_dir):
    port = non_ephemeral_port()  # nothing listens there (and a DEALER cannot connect to itself there)
    engine = _engine(log_dir, port, "a-secret")
    try:
        first = _line(engine, FIRST_PING.pattern, 120)
        silent = _line(engine, "no answer from proxy", 30)
        assert _at(silent) - _at(first) < 10, (first, silent)
        assert "WARNING" in silent and f"no answer from proxy 127.0.0.1:{port} in 5 s" in silent
        for cause in ("proxy_ip", "proxy_ping_port", "firewall", "loopback"):
            assert cause in silent, cause
        assert "never connected" in silent and "nothing came back" not in silent, silent
        assert len(_lines(engine, "no answer from proxy")) == 1
    finally:
        engine.stop()


def test_a_registered_engine_says_so_once_then_notices_the_proxy_going_silent(log_dir):
    proxy = ProxyProcess("--registration-token", "shared-secret")
    engine = None
    try:
        engine = _engine(log_dir, proxy.discovery_port, "shared-secret")
        registered = _line(engine, "registered with proxy", 120)
        assert "INFO" in registered and f"127.0.0.1:{proxy.discovery_port}" in registered
        wait_until(lambda: len(http_json("GET", proxy.url + "/instances")[1] or []) == 1, 30,
                   what="the proxy to list the engine")
        proxy.kill()
        silent = _line(engine, "no answer from proxy", 30)
        assert "WARNING" in silent and "connected before, but the connection was lost" in silent, silent
        assert len(_lines(engine, "registered with proxy")) == 1
    finally:
        if engine is not None:
            engine.stop()
        proxy.kill()
