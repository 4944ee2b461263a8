"""Smoke test of ``python -m atom_kv.bench proxy`` (output shape, no errors) on a tiny run;
no latency or throughput is asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_proxy_prints_one_json_result_without_errors():
    env = dict(os.environ, PYTHONPATH=ROOT, PATH=os.path.dirname(sys.executable))  # no vllm-router on PATH
    out = subprocess.run(
        [sys.executable, "-m", "atom_kv.bench", "proxy", "--json", "--latency-requests", "10",
         "--duration", "0.3", "--concurrency", "4", "--tokens", "4", "--peer", "vllm-router",
         "--hit-rate", "--sessions", "4", "--turns", "2", "--explore"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.strip()]
    row = json.loads(line)
    assert row["tokens"] == 4 and row["c1_errors"] == 0
    assert row["c1_proxy_p50_ms"] > 0 and row["c1_direct_p50_ms"] > 0
    (tp,) = row["throughput"]
    assert tp["concurrency"] == 4 and tp["errors"] == 0 and tp["requests"] > 0 and tp["req_per_s"] > 0
    assert tp["proxy_cpu_ms_per_req"] > 0  # from /proc
    assert "vllm-router" in row["peer_skipped"] and "peer" not in row
    rates = row["hit_rate"]["policies"]
    assert set(rates) == {"atom-kv round_robin", "atom-kv prefix_hash", "atom-kv cache_aware"}
    assert all(r["errors"] == 0 and 0.0 <= r["hit_rate"] <= 1.0 and sum(r["requests_per_engine"]) == 8
               for r in rates.values())
