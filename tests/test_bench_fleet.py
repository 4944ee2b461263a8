"""``python -m atom_kv.bench fleet`` at tiny sizes: it runs end to end (a real proxy, a real fake fleet on
loopback addresses, signed pings, KV events) and its JSON has every figure, each positive."""

from __future__ import annotations

import argparse
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


def _row(n: int) -> dict:
    """A measured row as ``_plain`` returns it (figures made up: this test is about what happens to rows)."""
    return {"n": n, "prefills": n // 2, "decodes": n - n // 2, "idle_cpu_core_share": 0.01, "cpu_ms_per_request": 0.3,
            "gross_cpu_ms_per_request": 0.4, "direct_p50_ms": 1.0, "direct_p99_ms": 2.0, "proxy_p50_ms": 1.5,
            "proxy_p99_ms": 3.0, "added_p50_ms": 0.5, "added_p99_ms": 1.0, "rss_idle_bytes": 50 << 20,
            "rss_bytes": (50 << 20) + 1000 * n, "new_engine": {"prefill_s": 0.1, "decode_s": 0.1, "max_s": 0.1,
                                                              "errors": 0}, "errors": 0, "refused_registrations": 0}


def test_a_failed_size_is_a_row_with_its_error_and_the_rows_before_it_are_on_disk(tmp_path, monkeypatch, capsys):
    out = tmp_path / "fleet.json"
    on_disk_when_asked: dict[int, list] = {}

    async def plain(args, n, log, token_file):  # type: ignore[no-untyped-def]
        on_disk_when_asked[n] = [r["n"] for r in json.loads(out.read_text())["sizes"]] if out.exists() else []
        if n == 64:
            raise TimeoutError("64 engines did not all register within 39.6 s")
        return _row(n)

    async def kv(args, n, log, token_file, plain_row):  # type: ignore[no-untyped-def]
        if n == 256:
            raise RuntimeError("no /metrics")
        return {"entries": n, "rss_bytes": 1, "index_bytes": 1, "index_bytes_per_entry": 1.0, "cpu_core_share": 0.1,
                "ingest_cpu_core_share": 0.05, "blocks_per_s": 1.0, "ingest_us_per_block": 1.0, "decode_failures": 0}

    monkeypatch.setattr(fleet, "_plain", plain)
    monkeypatch.setattr(fleet, "_kv", kv)
    parser = argparse.ArgumentParser()
    fleet.add_arguments(parser)
    args = parser.parse_args(["--sizes", "2,64,256,1000", "--explore", "--json", str(out)])
    assert fleet.run(args) == 1  # a size failed
    # each size's row was written as it completed: the next size found the ones before it on disk
    assert on_disk_when_asked == {2: [], 64: [2], 256: [2, 64], 1000: [2, 64, 256]}
    rows = json.loads(out.read_text())["sizes"]
    assert [r["n"] for r in rows] == [2, 64, 256, 1000]
    assert rows[1] == {"n": 64, "error": "the run without KV events: TimeoutError('64 engines did not all register "
                                         "within 39.6 s')"}
    assert rows[2]["kv"] == {"error": "the KV event run: RuntimeError('no /metrics')"}
    assert rows[3]["rss_per_engine_bytes"] == 1000 and rows[3]["kv"]["entries"] == 1000
    err = capsys.readouterr().err
    assert "fleet: N=64 failed: the run without KV events" in err and "fleet: N=256 failed: the KV event run" in err


def test_the_start_up_bound_grows_with_the_fleet_unless_given():
    parser = argparse.ArgumentParser()
    fleet.add_arguments(parser)
    assert fleet.startup_timeout(parser.parse_args([]), 1000) == 180.0
    assert fleet.startup_timeout(parser.parse_args([]), 2) < 31
    assert fleet.startup_timeout(parser.parse_args(["--startup-timeout", "5"]), 1000) == 5.0
