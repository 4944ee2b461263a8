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
from atom_kv.transfer._cma_sys import cma_unavailable_reason
from tests.e2e.helpers import PROMPTS, generate, get_json

CMA_REASON = cma_unavailable_reason()
#: what auto picks for host memory between two engines of this host
EXPECTED = "tcp" if CMA_REASON else "cma"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster([EngineSpec("P", backend="auto"), EngineSpec("D", backend="auto")],
                log_dir=str(tmp_path_factory.mktemp("routes")))
    c.start()
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

    route = {"dp_rank": "0", "rank": "0", "peer": prefill_id, "peer_dp_rank": "0", "peer_rank": "0",
             "memory": "host", "backend": EXPECTED}

    def shown() -> str | None:
        text = _metrics_text(d_url)
        return text if (route, 1.0) in _series(text, "atom_kv_route") else None

    text = wait_until(shown, 20, what=f"atom_kv_route{route} in the decode engine's /metrics")
    assert len(_series(text, "atom_kv_route")) == 1  # one prefill rank read, one route
    assert _series(text, "atom_kv_routes_hidden") == [({"dp_rank": "0", "rank": "0"}, 0.0)]
    fallbacks = _series(text, "atom_kv_route_fallbacks_total")
    if CMA_REASON:  # cma not usable here: each peer read over tcp counts as a fallback
        assert ({"dp_rank": "0", "rank": "0", "backend": "cma", "reason": "unavailable"}, 1.0) in fallbacks
    else:
        assert fallbacks == []

    _, health = get_json(d_url + "/health")
    (rank,) = [r for r in health["kv_routes"] if r["routes"]]
    assert (rank["dp_rank"], rank["rank"], rank["hidden"]) == (0, 0, 0)
    assert rank["routes"] == [{"peer": prefill_id, "peer_dp_rank": 0, "peer_rank": 0, "memory": "host",
                               "backend": EXPECTED}]

    # the prefill engine reads from no one: no routes, and its /metrics says so
    _, p_health = get_json(p_url + "/health")
    assert not any(r["routes"] for r in p_health["kv_routes"])
    assert _series(_metrics_text(p_url), "atom_kv_route") == []
