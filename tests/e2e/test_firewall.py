"""Firewalls that drop packets, as default-DROP rules do: the proxy and the engine each say what happened.

Two simulated hosts (``atom_kv/testing/netns.py``): a proxy and a decode reference engine, each on its own address,
registration signed with a token. An iptables DROP rule on the engine's host for its HTTP port: within two
probe intervals of the engine's registration, ``/instances`` shows it pending with the ``down_reason``
"health probe timed out after N s", the proxy logs one WARNING for it (not one per probe), and the engine
logs the registration answer "registered, unreachable" naming the timeout; once the rule is gone it is up.
A DROP rule on the proxy's host for the discovery port: the engine's warning says it never connected.
Needs root, ``ip``, ``unshare``, ``ss`` and ``iptables``; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import sys
import time
from typing import Optional

import pytest

from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json
from atom_kv.testing.netns import NIC, Hosts, NsProcess, unavailable_reason


def _unavailable() -> Optional[str]:
    reason = unavailable_reason()
    if reason is None and shutil.which("iptables") is None:
        reason = "needs `iptables` on PATH (apt-get install iptables)"
    return reason


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=_unavailable() or "")

PROXY_PORT, DISCOVERY_PORT, ENGINE_PORT, HANDSHAKE_PORT = 10001, 36367, 8000, 6301
PROBE_INTERVAL_S, PROBE_TIMEOUT_S = 2.0, 1.0
TOKEN = secrets.token_hex(16)


@pytest.fixture
def hosts(tmp_path):
    with Hosts(["proxy", "engine"], str(tmp_path)) as built:
        yield built


def _drop(hosts: Hosts, host: str, port: int, add: bool = True) -> None:
    """Add (or remove) a rule on ``host`` that drops every TCP packet to ``port`` coming in on its interface."""
    hosts.run(host, "iptables", "-A" if add else "-D", "INPUT", "-i", NIC, "-p", "tcp", "--dport", str(port),
              "-j", "DROP")


def _proxy(hosts: Hosts) -> NsProcess:
    return hosts.spawn("proxy", "proxy", [
        sys.executable, "-m", "atom_kv.proxy", "--host", hosts.addr["proxy"], "--port", str(PROXY_PORT),
        "--discovery-port", str(DISCOVERY_PORT), "--registration-token", TOKEN, "--log-level", "INFO",
        "--probe-interval", str(PROBE_INTERVAL_S), "--probe-timeout", str(PROBE_TIMEOUT_S)], own_host=False)


def _engine(hosts: Hosts) -> NsProcess:
    config = {"kv_role": "kv_consumer", "backend": "tcp", "handshake_port": HANDSHAKE_PORT,
              "proxy_ip": hosts.addr["proxy"], "auth_token": TOKEN, "ping_interval_s": 0.5,
              "registration_answer_timeout_s": 3.0}
    return hosts.spawn("engine", "engine", [
        sys.executable, "-m", "atom_kv.reference", "--host", hosts.addr["engine"], "--port", str(ENGINE_PORT),
        "--tp", "1", "--num-blocks", "16", "--log-level", "INFO", "--kv-transfer-config", json.dumps(config)])


def _lines(proc: NsProcess, pattern: str) -> list[str]:
    return [line for line in proc.log_text().splitlines() if re.search(pattern, line)]


def _line(proc: NsProcess, pattern: str, timeout: float) -> str:
    def found() -> list[str]:
        if not proc.alive():
            raise AssertionError(f"{proc.name} exited:\n{proc.tail(30)}")
        return _lines(proc, pattern)
    return wait_until(found, timeout, interval=0.1, what=f"a line of {proc.name} matching {pattern!r}")[0]


def test_an_engine_behind_a_dropping_firewall_is_pending_with_the_timeout_as_its_reason(hosts):
    _drop(hosts, "engine", ENGINE_PORT)
    proxy = _proxy(hosts)
    engine = _engine(hosts)
    instances = f"http://{hosts.addr['proxy']}:{PROXY_PORT}/instances"
    url = f"http://{hosts.addr['engine']}:{ENGINE_PORT}"

    def listed() -> Optional[dict]:
        status, body = hosts.call("proxy", http_json, "GET", instances, timeout=5.0)
        return next((i for i in body if i["address"] == url), None) if status == 200 else None

    wait_until(listed, 120, interval=0.05, what="the proxy to list the engine")  # the engine's start-up: not timed
    seen = time.monotonic()
    entry = wait_until(lambda: (lambda i: i if i and i["down_reason"] else None)(listed()), 4 * PROBE_INTERVAL_S,
                       interval=0.05, what="a down_reason for the engine")
    assert time.monotonic() - seen < 2 * PROBE_INTERVAL_S, entry
    assert entry["state"] == "pending", entry
    assert f"health probe timed out after {PROBE_TIMEOUT_S:g} s" in entry["down_reason"], entry

    # the engine hears it in its registration answer: registered, but unreachable, and why
    answer = _line(engine, r"proxy \S+ registered D engine", 20)
    assert "WARNING" in answer and "timed out after" in answer and url in answer, answer
    assert "firewall" in answer, answer

    # one WARNING on the proxy for this engine, however many probes time out
    probes = 3
    time.sleep(probes * PROBE_INTERVAL_S)
    warnings = _lines(proxy, rf"WARNING .*instance {re.escape(url)} is not reachable")
    assert len(warnings) == 1, proxy.tail(40)
    assert "timed out after" in warnings[0] and "firewall" in warnings[0], warnings

    _drop(hosts, "engine", ENGINE_PORT, add=False)  # the firewall was the cause: without it, it comes up
    entry = wait_until(lambda: (lambda i: i if i and i["state"] == "up" else None)(listed()), 4 * PROBE_INTERVAL_S,
                       interval=0.1, what="the engine to come up once the rule is gone")
    assert entry["down_reason"] is None


def test_an_engine_whose_pings_are_dropped_says_it_never_connected(hosts):
    _drop(hosts, "proxy", DISCOVERY_PORT)
    _proxy(hosts)
    engine = _engine(hosts)
    silent = _line(engine, "no answer from proxy", 120)
    assert "WARNING" in silent and f"{hosts.addr['proxy']}:{DISCOVERY_PORT}" in silent, silent
    assert "never connected" in silent and "has had no answer" in silent, silent
    assert "nothing came back" not in silent, silent
