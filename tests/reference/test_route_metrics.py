"""The reference engine's route metrics: one ``atom_kv_route`` series per peer
route of each DP and TP rank, the hidden count, and fallbacks by backend and
reason as a counter (the e2e test shows them from real handshakes; here every
family is checked, fallbacks included, on an engine that is not started)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from atom_kv.engine_hooks import PeerRoute, RouteReport
from atom_kv.reference.dp import DataParallelEngine
from atom_kv.reference.engine import EngineArgs
from atom_kv.reference.metrics import EngineMetrics


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name]


def test_routes_hidden_counts_and_fallbacks_are_rendered_per_rank():
    engine = DataParallelEngine(EngineArgs(num_layers=2, num_blocks=8, block_size=4), None, lambda out: None,
                                dp_size=2)
    engine.cores[0].worker_routes[1] = RouteReport(
        routes=(PeerRoute("P", 0, 1, "host", "cma"), PeerRoute("Q", 1, 0, "gpu:0", "tcp")), hidden=3,
        fallbacks=(("gpu_ipc", "add_peer_failed", 2), ("nixl", "unavailable", 5)))
    engine.cores[1].worker_routes[0] = RouteReport()
    text = EngineMetrics(engine).render().decode()

    assert sorted(_samples(text, "atom_kv_route"), key=lambda s: s[0]["peer"]) == [
        ({"dp_rank": "0", "rank": "1", "peer": "P", "peer_dp_rank": "0", "peer_rank": "1", "memory": "host",
          "backend": "cma"}, 1.0),
        ({"dp_rank": "0", "rank": "1", "peer": "Q", "peer_dp_rank": "1", "peer_rank": "0", "memory": "gpu:0",
          "backend": "tcp"}, 1.0)]
    assert sorted(_samples(text, "atom_kv_routes_hidden"), key=lambda s: s[0]["dp_rank"]) == [
        ({"dp_rank": "0", "rank": "1"}, 3.0), ({"dp_rank": "1", "rank": "0"}, 0.0)]
    assert sorted(_samples(text, "atom_kv_route_fallbacks_total"), key=lambda s: s[0]["backend"]) == [
        ({"dp_rank": "0", "rank": "1", "backend": "gpu_ipc", "reason": "add_peer_failed"}, 2.0),
        ({"dp_rank": "0", "rank": "1", "backend": "nixl", "reason": "unavailable"}, 5.0)]
    assert "# TYPE atom_kv_route_fallbacks_total counter" in text
