"""Proxy + prefill + decode reference engines with several data-parallel ranks:
greedy outputs equal a colocated engine's token for token, every DP rank
serves, a decode rank reads from the prefill rank that computed the prompt,
and every rank's blocks are free afterwards. One cluster per configuration.
"""

from __future__ import annotations

import threading
import time

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.web import scrape_metrics
from tests.e2e.helpers import PROMPTS, generate, get_json, kv_read_floor

# (prefill DP, prefill TP, decode DP, decode TP)
CONFIGS = [
    pytest.param((2, 1, 2, 1), id="P-dp2-D-dp2"),
    pytest.param((2, 1, 1, 1), id="P-dp2-D-dp1"),
    pytest.param((1, 1, 2, 1), id="P-dp1-D-dp2"),
    pytest.param((2, 2, 1, 2), id="P-dp2tp2-D-dp1tp2"),
]


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    dp_p, tp_p, dp_d, tp_d = request.param
    c = Cluster([
        EngineSpec("P", tp=tp_p, dp=dp_p, num_blocks=96, extra_config={"abort_timeout_s": 10.0}),
        EngineSpec("D", tp=tp_d, dp=dp_d, num_blocks=96,
                   extra_config={"handshake_timeout_s": 3.0, "transfer_timeout_s": 3.0}),
    ], proxy_args=["--policy", "least_loaded"],
        log_dir=str(tmp_path_factory.mktemp(f"pd-dp{dp_p}x{tp_p}-dp{dp_d}x{tp_d}")))
    c.start()
    c.dp = {"P": dp_p, "D": dp_d}
    try:
        yield c
    finally:
        c.close()


def _per_rank(url: str, name: str, dp: int) -> list[float]:
    m = scrape_metrics(url + "/metrics")
    return [m.get(f'{name}{{dp_rank="{r}"}}', 0.0) for r in range(dp)]


def _ranks_free(c: Cluster) -> list[list[tuple[int, int]]]:
    out = []
    for i in range(len(c.specs)):
        status, body = get_json(c.engine_url(i) + "/health")
        assert status == 200, body
        out.append([(r["kv_blocks"]["free"], r["kv_blocks"]["total"]) for r in body["dp_ranks"]])
    return out


def _wait_all_free(c: Cluster, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        ranks = _ranks_free(c)
        if all(free == total for engine in ranks for free, total in engine):
            return
        assert time.monotonic() < deadline, f"blocks still in use (free, total) per rank: {ranks}"
        time.sleep(0.2)


@pytest.mark.parametrize("cluster", CONFIGS, indirect=True)
def test_registration_announces_dp_size(cluster):
    _, instances = get_json(cluster.proxy_url + "/instances")
    assert {i["role"]: i["dp_size"] for i in instances} == cluster.dp
    assert all(i["dp_rank_field"] for i in instances)


@pytest.mark.parametrize("cluster", CONFIGS, indirect=True)
def test_pd_equals_colocated_on_every_rank(cluster, colocated):
    p, d = cluster.index_of("P"), cluster.index_of("D")
    served_before = {i: _per_rank(cluster.engine_url(i), "atom_kv_requests_ok_total", cluster.dp[role])
                     for i, role in ((p, "P"), (d, "D"))}
    m0 = scrape_metrics(cluster.engine_url(d) + "/metrics")
    for stream in (False, True):
        for prompt in PROMPTS:
            res = generate(cluster.proxy_url, prompt, chat=False, stream=stream)
            assert res.status == 200 and res.error is None, res
            assert res.text == colocated.text(prompt, chat=False)
    for i, role in ((p, "P"), (d, "D")):
        served = _per_rank(cluster.engine_url(i), "atom_kv_requests_ok_total", cluster.dp[role])
        assert all(a > b for a, b in zip(served, served_before[i])), (role, served)
    m1 = scrape_metrics(cluster.engine_url(d) + "/metrics")
    # the decode engine really read every prompt's KV (4 KiB per token in total), but for what it had cached
    moved = m1.get("atom_kv_transfer_bytes", 0) - m0.get("atom_kv_transfer_bytes", 0)
    assert moved > 0 and moved >= kv_read_floor(m0, m1, 2 * sum(len(x) for x in PROMPTS))
    _wait_all_free(cluster)


@pytest.mark.parametrize("cluster", CONFIGS[:1], indirect=True)
def test_concurrent_requests_balance_over_the_ranks(cluster):
    """64 concurrent requests through the proxy's least_loaded policy: every DP rank serves,
    each rank's outstanding tokens stay within 25% of the mean, every block is free after."""
    assert cluster.dp == {"P": 2, "D": 2}
    prompts = [f"request {i}: " + "kv " * (3 + i % 9) for i in range(64)]
    results: list = [None] * len(prompts)
    # each role's busiest moment seen: its per-rank outstanding tokens then
    peak: dict = {role: (-1.0, []) for role in ("prefill", "decode")}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            m = scrape_metrics(cluster.proxy_url + "/metrics")
            for role in peak:
                loads = [v for k, v in sorted(m.items())
                         if k.startswith("atom_kv_proxy_dp_rank_outstanding_tokens{") and f'role="{role}"' in k]
                if sum(loads) > peak[role][0]:
                    peak[role] = (sum(loads), loads)

    def one(i: int) -> None:
        results[i] = generate(cluster.proxy_url, prompts[i], chat=False, stream=False, max_tokens=4, timeout=120)

    sampler = threading.Thread(target=sample, name="dp-load-sampler")
    sampler.start()
    workers = [threading.Thread(target=one, args=(i,), name=f"dp-client-{i}") for i in range(len(prompts))]
    try:
        for t in workers:
            t.start()
        for t in workers:
            t.join(180)
    finally:
        done.set()
        sampler.join(10)
    assert all(r is not None and r.status == 200 and r.error is None for r in results), \
        [r for r in results if r is None or r.error]
    m = scrape_metrics(cluster.proxy_url + "/metrics")
    routed = {k: v for k, v in m.items() if k.startswith("atom_kv_proxy_dp_rank_requests_total{")}
    assert len(routed) == 4 and all(v > 0 for v in routed.values()), routed
    for role, (_, loads) in peak.items():
        mean = sum(loads) / len(loads)
        assert len(loads) == 2 and mean > 0 and all(abs(x - mean) <= 0.25 * mean for x in loads), (role, peak)
    for i, role in ((cluster.index_of("P"), "P"), (cluster.index_of("D"), "D")):
        served = _per_rank(cluster.engine_url(i), "atom_kv_requests_ok_total", 2)
        assert all(s > 0 for s in served), (role, served)
    _wait_all_free(cluster)
