"""Engines that say they are leaving, against real processes: a proxy (heartbeat timeout 60 s, so only the
engine's own word can take it out of routing in time), a prefill engine and two decode engines, all
registering by ping. A client loop keeps bounded requests going (two at a time, streamed and not) while one
decode engine gets SIGTERM: its first ping after the signal says ``draining``, the proxy lists it as draining
at once and gives it no new legs, its in-flight requests finish, it exits 0; restarted on the same port it
pings without the mark and takes requests again. Not one request fails."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json, scrape_metrics
from tests.e2e.helpers import Result, generate

HEARTBEAT_S = 60.0  # far longer than the test waits for the drained state: the ping, not the silence, says it
CLIENTS = 2


@pytest.fixture
def cluster(tmp_path):
    c = Cluster([EngineSpec("P", num_blocks=256), EngineSpec("D"), EngineSpec("D")], heartbeat_timeout=HEARTBEAT_S,
                proxy_args=["--policy", "round_robin"], log_dir=str(tmp_path))
    c.start()
    try:
        yield c
    finally:
        c.close()


class ClientLoop:
    """``CLIENTS`` threads sending bounded requests through the proxy until stopped; keeps every result."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.results: list[Result] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,), name=f"client-{n}") for n in range(CLIENTS)]

    def _run(self, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            res = generate(self.url, f"rolling restart client {n} request {i} " + "kv " * (i % 7), chat=i % 3 == 0,
                           stream=i % 2 == 1, max_tokens=6 + i % 5, timeout=60)
            with self._lock:
                self.results.append(res)
            i += 1

    def __enter__(self) -> "ClientLoop":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)

    def count(self) -> int:
        with self._lock:
            return len(self.results)

    def failures(self) -> list[Result]:
        with self._lock:
            return [r for r in self.results if r.status != 200 or r.error is not None]


def _worker(cluster: Cluster, url: str) -> dict:
    status, body = http_json("GET", cluster.proxy_url + "/workers", timeout=10)
    assert status == 200, body
    return next(w for w in body["workers"] if w["url"] == url and w["role"] == "decode")


def _served(url: str) -> float:
    return scrape_metrics(url + "/metrics").get("atom_kv_requests_ok_total", 0.0)


def test_rolling_restart_of_a_decode_engine_under_load_fails_no_request(cluster):
    d = cluster.index_of("D", 1)
    url = cluster.engine_url(d)
    assert _worker(cluster, url)["state"] == "active" and _worker(cluster, url)["source"] == "ping"
    with ClientLoop(cluster.proxy_url) as clients:
        wait_until(lambda: clients.count() >= 6 and _served(url) >= 1, 60, what="load on both decode engines")
        signalled = time.monotonic()
        cluster.engines[d].proc.send_signal(signal.SIGTERM)
        wait_until(lambda: _worker(cluster, url)["state"] == "draining", 10, interval=0.05,
                   what="the proxy to list the engine as draining")
        assert time.monotonic() - signalled < HEARTBEAT_S / 4  # its ping said so, not a heartbeat timeout
        assert cluster.engines[d].proc.wait(60) == 0
        before = clients.count()
        wait_until(lambda: clients.count() >= before + 4, 60, what="requests while the engine is away")
        cluster.restart_engine(d)
        wait_until(lambda: _worker(cluster, url)["state"] == "active", 30, what="the restarted engine's ping")
        wait_until(lambda: _served(url) >= 2, 60, what="the restarted engine to take requests")
    assert clients.count() >= 12
    assert clients.failures() == []
    log = cluster.proxy.log_text()
    assert "evicted" not in log  # nothing waited for the heartbeat


def test_draining_ping_without_a_proxy_answer_does_not_hold_the_shutdown(cluster):
    """The engine waits for a proxy to hear its draining ping only up to its answer timeout: with the proxy
    gone it still exits 0 within the orderly bounds."""
    d = cluster.index_of("D", 0)
    cluster.proxy.stop()
    started = time.monotonic()
    cluster.engines[d].proc.send_signal(signal.SIGTERM)
    assert cluster.engines[d].proc.wait(60) == 0
    assert time.monotonic() - started < 30
