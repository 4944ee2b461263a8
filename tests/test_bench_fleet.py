"""``python -m atom_kv.bench fleet`` at tiny sizes: it runs end to end (a real proxy, a real fake fleet on
loopback addresses, signed pings, KV events) and its JSON has every figure, each positive."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from atom_kv.bench import fleet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fleet_bench_at_tiny_sizes(tmp_path):
    out = tmp_path / "fleet.json"
    proc = subprocess.run(
        [sys.executable, "-m", "atom_kv.bench", "fleet", "--sizes", "2,8", "--requests", "60", "--concurrency", "8",
         "--idle-seconds", "0.3", "--ping-interval", "0.5", "--probe-interval", "0.5", "--kv-held", "8",
         "--explore", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["sizes"]
    assert [r["n"] for r in rows] == [2, 8]
    assert [(r["prefills"], r["decodes"]) for r in rows] == [(1, 1), (4, 4)]
    for r in rows:
        assert r["errors"] == 0 and r["refused_registrations"] == 0
        for key in ("gross_cpu_ms_per_request", "proxy_p50_ms", "proxy_p99_ms", "direct_p50_ms", "rss_bytes",
                    "idle_cpu_core_share"):
            assert r[key] > 0, key
        assert 0 < r["new_engine"]["prefill_s"] <= 10 and 0 < r["new_engine"]["decode_s"] <= 10
        kv = r["kv"]
        assert kv["entries"] >= 0.9 * r["n"] * 8 and kv["rss_bytes"] > 0 and kv["decode_failures"] == 0
    assert rows[1]["rss_per_engine_bytes"] is not None and rows[0]["rss_per_engine_bytes"] is None
    assert len(doc["targets"]) == 4 and "target fleet:" in proc.stdout


def test_sizes_are_checked_with_a_clear_message():
    with pytest.raises(Exception, match="--sizes: every size must be at least 2"):
        fleet._sizes("1,8")
    with pytest.raises(Exception, match="--sizes: expected engine counts"):
        fleet._sizes("two")
