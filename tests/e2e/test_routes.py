"""Visible routes: a decode engine's ``/metrics`` and ``/health`` name the
transfer backend ``auto`` chose for each prefill rank it read from (``cma``
between two engines on one host, where the kernel allows it; ``tcp``
otherwise, counted as a fallback), with real engines and a proxy on
127.0.0.1. Label sets stay bounded: see ``tests/connector/test_routes_view.py``."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.transfer.cma.syscalls import cma_unavailable_reason
from tests.e2e.helpers import PROMPTS, generate, get_json

CMA_REASON = cma_unavailable_reason()
#: what auto picks for host memory between two engines of this host
EXPECTED = "tcp" if CMA_REASON else "cma"


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def cluster(request, tmp_path_factory):
    tp = request.param  # at TP 2 each rank is its own process: routes travel back with its step results
    c = Cluster([EngineSpec("P", tp=tp, backend="auto"), EngineSpec("D", tp=tp, backend="auto")],
                log_dir=str(tmp_path_factory.mktemp(f"routes-tp{tp}")))
    c.start()
    c.tp = tp
    try:
        yield c
    finally:
        c.close()


def _metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return resp.read().decode()


def _series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name``: (labels, value)."""
    out = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out.append((dict(sample.labels), sample.value))
    return out


def test_decode_engine_shows_the_route_auto_chose(cluster):
    p_url, d_url = cluster.engine_url(cluster.index_of("P")), cluster.engine_url(cluster.index_of("D"))
    _, p_health = get_json(p_url + "/health")
    prefill_id = p_health["engine_id"]
    _, before = get_json(d_url + "/health")
    assert not any(r["routes"] for r in before["kv_routes"])  # no peer read yet

    res = generate(cluster.proxy_url, PROMPTS[0], chat=False, stream=False, max_tokens=4)
    assert res.status == 200, res.error

    # decode rank r reads the prefill's rank r (equal TP: the same KV heads)
    routes = [{"dp_rank": "0", "rank": str(r), "peer": prefill_id, "peer_dp_rank": "0", "peer_rank": str(r),
               "memory": "host", "backend": EXPECTED} for r in range(cluster.tp)]

    def shown() -> str | None:
        text = _metrics_text(d_url)
        have = _series(text, "atom_kv_route")
        return text if all((route, 1.0) in have for route in routes) else None

    text = wait_until(shown, 20, what=f"{routes} in the decode engine's /metrics")
    assert len(_series(text, "atom_kv_route")) == cluster.tp  # one route per prefill rank read
    assert sorted(_series(text, "atom_kv_routes_hidden"), key=lambda s: s[0]["rank"]) == [
        ({"dp_rank": "0", "rank": str(r)}, 0.0) for r in range(cluster.tp)]
    fallbacks = _series(text, "atom_kv_route_fallbacks_total")
    if CMA_REASON:  # cma not usable here: each peer read over tcp counts as a fallback
        assert ({"dp_rank": "0", "rank": "0", "backend": "cma", "reason": "unavailable"}, 1.0) in fallbacks
    else:
        assert fallbacks == []

    _, health = get_json(d_url + "/health")
    assert [(r["dp_rank"], r["rank"], r["hidden"], r["routes"]) for r in health["kv_routes"]] == [
        (0, r, 0, [{"peer": prefill_id, "peer_dp_rank": 0, "peer_rank": r, "memory": "host", "backend": EXPECTED}])
        for r in range(cluster.tp)]

    # the prefill engine reads from no one: no routes, and its /metrics says so
    _, p_health = get_json(p_url + "/health")
    assert not any(r["routes"] for r in p_health["kv_routes"])
    assert _series(_metrics_text(p_url), "atom_kv_route") == []
