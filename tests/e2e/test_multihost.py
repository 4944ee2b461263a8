"""Proxy, prefill and decode on three simulated hosts, as an operator runs them.

Each host is a network namespace on a private bridge (``atom_kv/testing/netns.py``)
with one address, and each engine also runs under its own pid, mount and UTS
namespace, so the connector sees separate hosts (another hostname and pid
namespace: no ``cma`` between them). Everything listens on the hosts'
addresses with the documented default ports (proxy 10001 and discovery 36367,
engines 8000 and handshake 6301+rank), registration is signed with a shared
token, and the test's client connects from a fourth host.

In file order: greedy output through P/D equals a colocated engine's, token
for token, with ``nixl`` (UCX over the veth: ``UCX_TLS=tcp``,
``UCX_NET_DEVICES`` the host's interface), ``auto`` and ``tcp``, prefill TP 2
and decode TP 1, and no host listens on a port outside the port plan; then,
on ``tcp``, the decode host's link goes down for a few seconds mid-stream (the
stream completes, no block is lost), and the prefill engine is killed
mid-prefill (a clear error, no block held on the decode engine, recovery
after a restart). Needs root, ``ip``, ``unshare`` and ``ss``; skipped with the
reason otherwise.
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import pytest

from atom_kv.config import KVTransferConfig
from atom_kv.ports import planned_ports
from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json, scrape_metrics
from atom_kv.transfer.nixl.probe import nixl_unavailable_reason
from tests.e2e.helpers import PROMPTS, Result, generate, kv_read_floor
from atom_kv.testing.netns import NIC, Hosts, NsProcess, stop_all, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

PROXY_PORT, DISCOVERY_PORT = 10001, 36367  # the proxy's defaults
ENGINE_PORT, HANDSHAKE_PORT = 8000, 6301  # the engines' (handshake: one port per rank from here)
TP = {"P": 2, "D": 1}
HOST = {"P": "prefill", "D": "decode"}
HEARTBEAT_S = 3.0
PING_INTERVAL_S = 0.5
UCX_PORTS = "40100-40115"  # nixl: UCX's TCP listeners (one per rank) stay in this range (inside the ephemeral range)
TOKEN = secrets.token_hex(16)


def _engine_config(role: str, backend: str, proxy_addr: str) -> dict:
    config = {
        "kv_role": "kv_producer" if role == "P" else "kv_consumer",
        "backend": backend,
        "handshake_port": HANDSHAKE_PORT,
        "proxy_ip": proxy_addr,
        "auth_token": TOKEN,
        "ping_interval_s": PING_INTERVAL_S,
        "abort_timeout_s": 10.0,
        "handshake_timeout_s": 3.0,
        "transfer_timeout_s": 5.0,
    }
    if backend == "nixl":
        config["nixl_ucx_tcp_port_range"] = UCX_PORTS
    return config


def plan(role: str, backend: str) -> set[int]:
    """Every port the port plan says a host of ``role`` (proxy, P or D) listens on."""
    if role == "proxy":
        return {PROXY_PORT, DISCOVERY_PORT}
    config = KVTransferConfig.from_dict(_engine_config(role, backend, "10.231.7.1"))
    return {port for p in planned_ports(config, tp_size=TP[role], http_port=ENGINE_PORT) for port in p.ports}


class Fleet:
    """The hosts, the proxy, and the P/D pair currently running (restarted when the backend changes)."""

    def __init__(self, hosts: Hosts) -> None:
        self.hosts = hosts
        self.backend: Optional[str] = None
        self.engines: dict[str, NsProcess] = {}
        self.starts = 0  # engines started so far (each gets a log of its own)
        self.proxy_url = f"http://{hosts.addr['proxy']}:{PROXY_PORT}"
        self.proxy = hosts.spawn("proxy", "proxy", [
            sys.executable, "-m", "atom_kv.proxy", "--host", hosts.addr["proxy"], "--port", str(PROXY_PORT),
            "--discovery-port", str(DISCOVERY_PORT), "--registration-token", TOKEN,
            "--heartbeat-timeout", str(HEARTBEAT_S), "--log-level", "INFO"])

    def url(self, role: str) -> str:
        return f"http://{self.hosts.addr[HOST[role]]}:{ENGINE_PORT}"

    def client(self, fn, *args, timeout: float = 120.0, **kwargs):
        """``fn`` called from the client host."""
        return self.hosts.call("client", fn, *args, timeout=timeout, **kwargs)

    def get(self, url: str) -> tuple[int, object]:
        return self.client(http_json, "GET", url, timeout=5.0)

    def _check_alive(self) -> None:
        for proc in (self.proxy, *self.engines.values()):
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.tail(30)}")

    def start_engine(self, role: str) -> None:
        backend = self.backend
        assert backend is not None
        # UCX over the veth: its TCP transport on the host's interface; its ports come from the config's range
        env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": NIC} if backend == "nixl" else None
        host = HOST[role]
        self.starts += 1
        self.engines[role] = self.hosts.spawn(host, f"{role}-{backend}-{self.starts}", [
            sys.executable, "-m", "atom_kv.reference", "--host", self.hosts.addr[host], "--port", str(ENGINE_PORT),
            "--tp", str(TP[role]), "--num-blocks", "128", "--log-level", "INFO",
            "--kv-transfer-config", json.dumps(_engine_config(role, backend, self.hosts.addr["proxy"]))], env=env)

    def wait_registered(self, timeout: float = 90.0) -> None:
        """Until both engines serve and the proxy holds both of them (by engine id) as up."""
        ids: dict[str, str] = {}

        def ready() -> bool:
            self._check_alive()
            for role in ("P", "D"):
                if role not in ids:
                    status, body = self.get(self.url(role) + "/health")
                    if status != 200:
                        return False
                    ids[role] = body["engine_id"]
            status, instances = self.get(self.proxy_url + "/instances")
            up = {(i["role"], i["engine_id"]) for i in instances if i["state"] == "up"} if status == 200 else set()
            return all((role, ids[role]) in up for role in ("P", "D"))

        wait_until(ready, timeout, interval=0.1, what=f"the {self.backend} engines to serve and register")

    def use(self, backend: str) -> None:
        """P and D engines of ``backend`` (restarted when another backend runs)."""
        if self.backend == backend and all(p.alive() for p in self.engines.values()):
            return
        running = [p for p in self.engines.values() if p.alive()]
        stop_all(running)
        codes = {p.name: p.proc.returncode for p in running}
        assert set(codes.values()) <= {0}, f"engines did not stop cleanly on SIGTERM: {codes}"
        self.backend = backend
        for role in ("P", "D"):
            self.start_engine(role)
        self.wait_registered()

    def blocks(self, role: str) -> dict:
        status, body = self.get(self.url(role) + "/health")
        assert status == 200, body
        return body["kv_blocks"]

    def all_free(self, role: str) -> bool:
        blocks = self.blocks(role)
        return blocks["free"] == blocks["total"]

    def wait_all_free(self, role: str, timeout: float = 15.0) -> None:
        wait_until(lambda: self.all_free(role), timeout, what=f"every KV block of the {HOST[role]} engine to be free")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    hosts = Hosts(["proxy", "prefill", "decode", "client"], str(tmp_path_factory.mktemp("multihost")))
    try:
        hosts.build()
        yield Fleet(hosts)
    finally:
        hosts.close()


@pytest.mark.parametrize("backend", [
    pytest.param("nixl", marks=pytest.mark.skipif(bool(nixl_unavailable_reason()),
                                                  reason=nixl_unavailable_reason() or "")),
    "auto",
    "tcp",
])
def test_pd_across_hosts_equals_colocated_and_listens_only_on_planned_ports(fleet, colocated, backend):
    fleet.use(backend)
    before = fleet.client(scrape_metrics, fleet.url("D") + "/metrics")
    for i, prompt in enumerate(PROMPTS):
        for chat, stream in ((False, i % 2 == 0), (True, i % 2 == 1)):
            res = fleet.client(generate, fleet.proxy_url, prompt, chat=chat, stream=stream)
            assert res.status == 200 and res.error is None, (backend, res)
            assert res.text == colocated.text(prompt, chat=chat), (backend, prompt, chat, stream)
    after = fleet.client(scrape_metrics, fleet.url("D") + "/metrics")
    moved = after.get("atom_kv_transfer_bytes", 0.0) - before.get("atom_kv_transfer_bytes", 0.0)
    # the decode host really read the KV, but for what its prefix cache held
    assert moved > 0 and moved >= kv_read_floor(before, after, 2 * sum(len(p) for p in PROMPTS)), moved
    logs = {role: _log(fleet.engines[role]) for role in ("P", "D")}
    for role, log in logs.items():  # the proxy answered the signed pings, and the engine said so
        assert f"registered with proxy {fleet.hosts.addr['proxy']}:{DISCOVERY_PORT}" in log, (role, log[-2000:])
    if backend == "auto":  # another host: tcp, never cma
        assert logs["D"].count(" uses tcp") == TP["P"] and " uses cma" not in logs["D"], logs["D"][-2000:]

    for role, host in (("proxy", "proxy"), ("P", "prefill"), ("D", "decode"), ("client", "client")):
        listening = fleet.hosts.listening(host)
        exposed = {(a, p) for a, p in listening if not a.startswith("127.")}
        # on loopback, only the reference engine's TP ranks (gloo, one listener per rank; one rank: none)
        loopback = listening - exposed
        assert len(loopback) <= (TP[role] if TP.get(role, 1) > 1 else 0), (host, sorted(listening))
        own = fleet.hosts.addr[host]
        assert all(a == own for a, _ in exposed), f"{host}: a listener on another address than {own}: {listening}"
        planned = plan(role, backend) if role != "client" else set()
        outside = sorted(p for _, p in exposed if p not in planned)
        assert not outside, f"{host} listens on {outside}, outside the plan {sorted(planned)}: {sorted(listening)}"
        if role in ("proxy", "P"):  # and every planned server port is really there
            must = {PROXY_PORT, DISCOVERY_PORT} if role == "proxy" else {ENGINE_PORT, HANDSHAKE_PORT, HANDSHAKE_PORT + 1}
            assert must <= {p for _, p in exposed}, (host, listening)


def _log(proc: NsProcess) -> str:
    return proc.log_text()


def _stream_events(url: str, prompt: str, max_tokens: int, decoding: threading.Event, arrivals: list[float],
                   timeout: float) -> Result:
    """A streamed completion, noting when each SSE event arrived. ``decoding`` is set at the second event: the
    first may be the prefill's token, forwarded while the decode engine is still reading the KV cache."""
    body = {"model": "atom-kv-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    pieces = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            arrivals.append(time.monotonic())
            if len(arrivals) >= 2:
                decoding.set()
            payload = line[5:].strip()
            if payload == "[DONE]":
                return Result(resp.status, "".join(pieces))
            event = json.loads(payload)
            if "error" in event:
                return Result(resp.status, "".join(pieces), error=str(event["error"]))
            pieces.extend(c.get("text") or "" for c in event.get("choices", []))
    return Result(resp.status, "".join(pieces), error="stream ended without [DONE]")


def test_decode_link_down_mid_stream_the_stream_completes_and_no_block_is_lost(fleet, colocated):
    fleet.use("tcp")
    prompt, n = PROMPTS[2], 96
    decoding, arrivals = threading.Event(), []
    future = fleet.hosts.submit("client", _stream_events, fleet.proxy_url, prompt, n, decoding, arrivals, 60.0)
    assert decoding.wait(30), "no event from the decode engine"  # its KV read is over; it streams
    fleet.hosts.link("decode", up=False)
    down_at = time.monotonic()
    try:
        time.sleep(3.0)  # the outage itself
    finally:
        fleet.hosts.link("decode", up=True)
    up_at = time.monotonic()
    res = future.result(60)
    assert res.error is None and res.text == colocated.text(prompt, chat=False, max_tokens=n), res
    assert any(t > up_at for t in arrivals), "the stream had ended before the link went down"
    assert not any(down_at + 1.5 < t < up_at for t in arrivals), "events crossed a link that was down"
    for role in ("P", "D"):
        fleet.wait_all_free(role)


def test_prefill_killed_mid_prefill_clear_error_no_block_held_recovers_after_restart(fleet, colocated):
    fleet.use("tcp")
    long_prompt = "A long prompt keeps the prefill engine busy for a while. " * 21  # ~1200 tokens
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(fleet.client, generate, fleet.proxy_url, long_prompt + str(i), chat=False,
                               stream=bool(i % 2), max_tokens=8, timeout=60) for i in range(4)]
        wait_until(lambda: sum(fleet.get(fleet.url("P") + "/health")[1]["requests"].values()) > 0, 30,
                   interval=0.02, what="the prefill engine to start working")
        fleet.engines["P"].kill()
        results = [f.result(90) for f in futures]
    failed = [r for r in results if r.error is not None]
    assert failed, results
    assert any(r.status == 502 and "prefill" in r.error for r in failed), failed  # says which leg failed
    for r in failed:  # an HTTP error, or an error event in a stream that had begun: one line, no traceback
        assert r.status in (200, 502, 503) and r.error and "Traceback" not in r.error, r
        assert "\n" not in r.error.strip(), r
    for i, r in enumerate(results):
        if r.error is None:  # finished before the kill: still right
            assert r.text == colocated.text(long_prompt + str(i), chat=False, max_tokens=8)
    wait_until(lambda: fleet.get(fleet.proxy_url + "/health")[0] == 503, HEARTBEAT_S + 10,
               what="the proxy to drop the killed prefill engine")
    res = fleet.client(generate, fleet.proxy_url, PROMPTS[0], chat=False, stream=False)
    assert res.status == 503 and res.error, res  # no prefill engine: said so at once
    fleet.wait_all_free("D")
    fleet.start_engine("P")
    fleet.wait_registered()
    res = fleet.client(generate, fleet.proxy_url, PROMPTS[1], chat=True, stream=True)
    assert res.error is None and res.text == colocated.text(PROMPTS[1], chat=True), res
