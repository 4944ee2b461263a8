"""Several proxies in front of one fleet: two replicas for availability, and ``--reuse-port``.

One prefill and one decode reference engine register (signed, with a shared
token) with four proxies at once through ``proxy_ip``'s list:

- two replicas on ports of their own, as two hosts behind an L4 balancer
  would run them: with either one killed, every request succeeds through the
  other, and a replica restarted on its ports relearns the fleet from the next
  registration ping;
- two processes sharing one HTTP port with ``--reuse-port`` (each with its own
  discovery port): the kernel spreads connections over both, and with one
  killed the other serves every request on the same port.
"""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
import time

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.ports import free_port_range
from atom_kv.testing.processes import REPO_ROOT, ManagedProcess, interrupts_held
from atom_kv.testing.web import http_json, scrape_metrics
from tests.e2e.helpers import PROMPTS, generate

PING_INTERVAL_S = 2.0
HEARTBEAT_S = 6.0
TOKEN = secrets.token_hex(16)
_COMPLETIONS_200 = re.compile(r'^atom_kv_proxy_requests_total\{.*completions.*status="200".*\}$')


class Proxy:
    """One proxy process on fixed ports (so it can be restarted where its engines ping it)."""

    def __init__(self, name: str, log_dir: str, http_port: int, discovery_port: int, *extra: str) -> None:
        self.name, self.log_dir = name, log_dir
        self.http_port, self.discovery_port = http_port, discovery_port
        self.argv = [sys.executable, "-m", "atom_kv.proxy", "--host", "127.0.0.1", "--port", str(http_port),
                     "--discovery-host", "127.0.0.1", "--discovery-port", str(discovery_port),
                     "--registration-token", TOKEN, "--heartbeat-timeout", str(HEARTBEAT_S), *extra]
        self.proc: ManagedProcess | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> "Proxy":
        self.starts += 1
        with interrupts_held():
            self.proc = ManagedProcess(f"{self.name}-{self.starts}", self.argv, self.log_dir)
        return self

    def log(self) -> str:
        assert self.proc is not None
        return self.proc.log_text()

    def check_alive(self) -> None:
        assert self.proc is not None
        if not self.proc.alive():
            raise RuntimeError(f"{self.proc.name} exited with {self.proc.proc.returncode}:\n{self.proc.tail()}")

    def registered_both(self) -> bool:
        """Whether its log says it registered a prefill and a decode instance (raises if it died)."""
        self.check_alive()
        log = self.log()
        return "registered prefill instance" in log and "registered decode instance" in log

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def _fleet_known(url: str) -> bool:
    status, body = http_json("GET", url + "/health", timeout=2.0)
    return status == 200 and isinstance(body, dict) and body.get("prefill", 0) >= 1 and body.get("decode", 0) >= 1


def _completions_ok(url: str) -> float:
    metrics = scrape_metrics(url + "/metrics")
    return sum(v for k, v in metrics.items() if _COMPLETIONS_200.match(k))


def _every_request_succeeds(url: str, colocated, n: int = 6) -> None:
    for i in range(n):
        prompt, chat, stream = PROMPTS[i % len(PROMPTS)], bool(i % 2), bool(i // 2 % 2)
        res = generate(url, prompt, chat=chat, stream=stream, timeout=60)
        assert res.status == 200 and res.error is None, (url, i, res)
        assert res.text == colocated.text(prompt, chat=chat), (url, i)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Four proxies (replicas A and B, reuse-port pair R1 and R2) and one P/D pair registered with all four."""
    log_dir = str(tmp_path_factory.mktemp("replicas"))
    base = free_port_range(6)  # below the ephemeral range: a restarted proxy binds its ports again
    shared = base + 4
    proxies = {
        "A": Proxy("proxyA", log_dir, base, base + 1),
        "B": Proxy("proxyB", log_dir, base + 2, base + 3),
        "R1": Proxy("proxyR1", log_dir, shared, base + 5, "--reuse-port"),
    }
    r2_discovery = free_port_range(1)
    proxies["R2"] = Proxy("proxyR2", log_dir, shared, r2_discovery, "--reuse-port")
    proxy_ip = ",".join(f"127.0.0.1:{p.discovery_port}" for p in proxies.values())
    engine_cfg = {"proxy_ip": proxy_ip, "auth_token": TOKEN}
    cluster = Cluster([
        EngineSpec("P", num_blocks=128, extra_config=dict(engine_cfg)),
        EngineSpec("D", num_blocks=128, extra_config=dict(engine_cfg)),
    ], with_proxy=False, ping_interval_s=PING_INTERVAL_S, log_dir=log_dir)
    try:
        for proxy in proxies.values():
            proxy.start()
        cluster.start()
        for name in ("A", "B"):
            wait_until(lambda url=proxies[name].url: _fleet_known(url), 60, interval=0.1,
                       what=f"proxy {name} to learn the fleet")
        for name in ("R1", "R2"):  # one shared port: each process's own log says what it learnt
            wait_until(proxies[name].registered_both, 60, interval=0.1, what=f"proxy {name} to register the fleet")
        yield cluster, proxies
    finally:
        cluster.close()
        for proxy in proxies.values():
            proxy.stop()


def test_either_replica_killed_the_other_serves_every_request(fleet, colocated):
    _, proxies = fleet
    a, b = proxies["A"], proxies["B"]
    _every_request_succeeds(a.url, colocated, n=3)
    _every_request_succeeds(b.url, colocated, n=3)

    a.kill()
    _every_request_succeeds(b.url, colocated)

    # A comes back on its ports and learns the fleet from the engines' next pings: within one interval
    # (plus the time to probe the engines), long before B's knowledge or any heartbeat could matter
    a.start()
    wait_until(lambda: (a.check_alive(), http_json("GET", a.url + "/health", timeout=1.0)[0] in (200, 503))[1],
               60, interval=0.05, what="restarted proxy A to answer /health")
    up = time.monotonic()
    wait_until(lambda: _fleet_known(a.url), PING_INTERVAL_S + 20, interval=0.05,
               what="restarted proxy A to relearn the fleet")
    relearnt = time.monotonic() - up
    assert relearnt <= PING_INTERVAL_S + 1.5, f"proxy A relearnt the fleet {relearnt:.2f} s after its start"

    b.kill()
    _every_request_succeeds(a.url, colocated)
    b.start()  # both replicas up again for whatever runs next
    wait_until(lambda: _fleet_known(b.url), 60, interval=0.1, what="restarted proxy B to relearn the fleet")


def test_reuse_port_processes_share_the_port_and_survive_one_killed(fleet, colocated, tmp_path):
    _, proxies = fleet
    r1, r2 = proxies["R1"], proxies["R2"]
    url = r1.url  # the shared port
    assert r2.url == url

    # a process without --reuse-port cannot take the shared port: one line, no traceback
    intruder = ManagedProcess("proxy-no-reuse", [sys.executable, "-m", "atom_kv.proxy", "--host", "127.0.0.1",
                                                 "--port", str(r1.http_port), "--no-discovery",
                                                 "--prefill", "http://127.0.0.1:9", "--decode",
                                                 "http://127.0.0.1:9"], str(tmp_path))
    try:
        assert intruder.proc.wait(30) == 1
    finally:
        intruder.stop()
    with open(intruder.log_path, encoding="utf-8") as f:
        out = f.read().strip().splitlines()
    assert out == [f"atom-kv-proxy: cannot listen on 127.0.0.1:{r1.http_port}: address already in use"], out

    wait_until(lambda: _fleet_known(url), 30, interval=0.1, what="the shared port to answer with the fleet")
    n = 24  # a new connection each: P(all on one process) = 2 ** -23
    for i in range(n):
        res = generate(url, PROMPTS[i % len(PROMPTS)], chat=False, stream=bool(i % 2), max_tokens=4, timeout=60)
        assert res.status == 200 and res.error is None, (i, res)

    r1.kill()
    # only R2 answers on the port now: its own count shows R1 took part of the load, R2 the rest
    served_by_r2 = _completions_ok(url)
    assert 0 < served_by_r2 < n, f"R2 served {served_by_r2:g} of {n} requests"
    for i in range(6):
        res = generate(url, PROMPTS[i % len(PROMPTS)], chat=bool(i % 2), stream=bool(i // 2 % 2), timeout=60)
        assert res.status == 200 and res.error is None, (i, res)
        assert res.text == colocated.text(PROMPTS[i % len(PROMPTS)], chat=bool(i % 2))
    assert _completions_ok(url) == served_by_r2 + 6


def test_reuse_port_needs_a_fixed_port():
    res = subprocess.run([sys.executable, "-m", "atom_kv.proxy", "--port", "0", "--reuse-port",
                          "--registration-token", TOKEN], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
                         check=False)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert last.startswith("atom-kv-proxy: error: reuse_port: --reuse-port") and "--port" in last, last
