"""Static engines with several DP ranks learn ``dp_size`` from ``/health``: real reference engines (P and D,
DP 2 each, not registering) behind a real proxy that knows them only from ``--prefill`` / ``--decode``.

The prefill's spec names no ``dp=``; the decode's says ``dp=4``, which its ``/health`` (2) contradicts: the
proxy uses 2 for both, says so about the decode in exactly one line, and every request succeeds on both
ranks of both engines (a rank the engine lacks would fail)."""

from __future__ import annotations

import re

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import scrape_metrics
from tests.e2e.helpers import generate, get_json
from tests.proxy.procs import ProxyProcess

PROBE_S = 0.2


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    c = Cluster([EngineSpec("P", dp=2, num_blocks=64, register=False),
                 EngineSpec("D", dp=2, num_blocks=64, register=False,
                            extra_config={"handshake_timeout_s": 5.0, "transfer_timeout_s": 5.0})],
                with_proxy=False, log_dir=str(tmp_path_factory.mktemp("static-dp")))
    c.start()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def proxy(engines):
    p = ProxyProcess("--no-discovery", "--prefill", engines.engine_url(engines.index_of("P")),
                     "--decode", engines.engine_url(engines.index_of("D")) + ",dp=4",
                     "--registration-token", engines.token, "--policy", "round_robin",
                     "--probe-interval", str(PROBE_S), "--heartbeat-timeout", "30", timeout=30)
    try:
        yield p
    finally:
        p.kill()


def _instances(proxy: ProxyProcess) -> dict[str, dict]:
    status, listing = get_json(proxy.url + "/instances")
    assert status == 200, listing
    return {i["role"]: i for i in listing}


def _served_per_rank(url: str) -> list[float]:
    m = scrape_metrics(url + "/metrics")
    return [m.get(f'atom_kv_requests_ok_total{{dp_rank="{r}"}}', 0.0) for r in range(2)]


def test_static_engines_take_dp_size_from_health(engines, proxy):
    wait_until(lambda: all(i["state"] == "up" for i in _instances(proxy).values()) and len(_instances(proxy)) == 2,
               30, what="both static engines to be probed up")
    listed = _instances(proxy)
    assert {role: i["dp_size"] for role, i in listed.items()} == {"P": 2, "D": 2}
    assert {role: len(i["outstanding_tokens"]) for role, i in listed.items()} == {"P": 2, "D": 2}

    urls = {role: engines.engine_url(engines.index_of(role)) for role in ("P", "D")}
    before = {role: _served_per_rank(url) for role, url in urls.items()}
    for n in range(6):
        res = generate(proxy.url, f"static dp request {n}: " + "kv " * (2 + n), chat=False, stream=n % 2 == 1,
                       max_tokens=4, timeout=120)
        assert res.status == 200 and res.error is None, res
    for role, url in urls.items():
        after = _served_per_rank(url)
        assert all(a > b for a, b in zip(after, before[role])), (role, before[role], after)  # both ranks served

    # more probes pass, each reading dp_size=2 again: still the one line about the decode's spec
    seen = listed["D"]["last_seen"]
    wait_until(lambda: _instances(proxy)["D"]["last_seen"] >= seen + 3 * PROBE_S, 30, what="three more probes")
    mismatch = re.compile(r"WARNING .*static decode engine http://127\.0\.0\.1:\d+: its /health reports dp_size=2 "
                          r"but its --decode spec says dp=4; using dp_size=2 from /health")
    lines = [line for line in proxy.lines if "dp_size" in line and "WARNING" in line]
    assert [bool(mismatch.search(line)) for line in lines] == [True], lines
