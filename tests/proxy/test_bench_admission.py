"""Smoke tests of ``python -m atom_kv.bench admission`` and ``bench proxy --admission`` (output shape, statuses
accounted for) on tiny runs; no wait time or CPU figure is asserted here (those are the benches' targets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT, PATH=os.path.dirname(sys.executable))


def _json_line(args: list[str]) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "atom_kv.bench", *args, "--json"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode in (0, 1), out.stderr[-2000:]  # 1: a target missed on a loaded machine
    (line,) = [ln for ln in out.stdout.splitlines() if ln.strip()]
    return out.returncode, json.loads(line)


def test_bench_admission_accounts_for_every_request_of_the_burst():
    rc, row = _json_line(["admission", "--cap", "2", "--over", "4", "--tokens", "4"])
    burst = row["burst_run"]
    assert row["burst"] == 8 and burst["queue_size"] == 4
    assert burst["served"] + burst["refused_429"] == 8 and burst["other"] == []
    assert burst["refused_429"] >= 1 and burst["retry_after"] == ["60"]  # past the queue: ceil(--queue-timeout)
    t = row["timeout_run"]
    assert t["served"] + t["refused_503"] == 8 and t["other"] == []
    assert set(row["targets"]) == {"burst_queued_and_served_in_order", "429_only_past_the_queue",
                                   "p99_wait_le_queue_timeout"}
    assert rc == (0 if all(row["targets"].values()) else 1)  # a missed target is exit status 1


def test_bench_proxy_admission_reports_cpu_on_and_off():
    _, row = _json_line(["proxy", "--explore", "--admission", "--latency-requests", "5", "--duration", "0.4", "--rounds", "2",
                         "--concurrency", "4", "--tokens", "4"])
    a = row["admission"]
    assert "--max-concurrent-per-engine" in a["flags"] and "--rate-limit" in a["flags"]
    assert a["on"]["errors"] == 0 and a["off"]["errors"] == 0 and a["on"]["requests"] > 0
    assert a["on"]["proxy_cpu_ms_per_req"] > 0 and a["off"]["proxy_cpu_ms_per_req"] > 0
    assert a["cpu_ratio"] > 0 and a["cpu_ratio_target"] == 1.1
    assert "admission_cpu_le_1.1x" in row["targets"]
