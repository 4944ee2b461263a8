"""``python -m atom_kv.bench kv-index`` runs end to end on a small stream (no timing is asserted: the targets
are the bench's to print)."""

from __future__ import annotations

import json

from atom_kv.bench.__main__ import main


def test_the_kv_index_bench_reports_both_targets(capsys):
    assert main(["kv-index", "--json", "--explore", "--messages", "40", "--rounds", "1", "--blocks", "2000",
                 "--blocks-per-worker", "2048", "--prompt-tokens", "1024", "--lag-messages", "50"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["targets"]) == {"bytes_per_entry", "blocks_per_s", "lag_p99_s"}
    assert all(isinstance(t["met"], bool) and t["value"] > 0 for t in out["targets"].values())
    speed = out["throughput"]
    assert speed["blocks"] == 40 * 8 * 16 and speed["entries"] == 2000  # the stream's steady state
    assert out["memory"]["entries"] == 2 * 2048
    assert out["query"] == {**out["query"], "matched_workers": 1, "matched_tokens": 1024}
    lag = out["lag"]  # every published batch reached the subscriber and was stamped
    assert lag["batches"] == 50 and 0 <= lag["p50_s"] <= lag["p99_s"] and lag["mean_s"] >= 0


def test_the_kv_index_bench_prints_met_or_missed(capsys):
    assert main(["kv-index", "--explore", "--messages", "20", "--rounds", "1", "--blocks", "1000", "--blocks-per-worker", "1024",
                 "--prompt-tokens", "256", "--map", "--lag-messages", "20"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("blocks/s" in line and line.endswith(("met", "MISSED")) for line in lines)
    assert any("B per (block, instance) entry" in line and line.endswith(("met", "MISSED")) for line in lines)
    assert any(line.startswith("event lag") and line.endswith(("met", "MISSED")) for line in lines)
