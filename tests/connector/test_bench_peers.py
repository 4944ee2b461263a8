"""Smoke test of ``python -m atom_kv.bench connector --peers``: the JSON document's shape and figures that
are positive, at tiny sizes over tcp; no figure is compared with a target here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_peers_mode_prints_a_row_per_peer_count_with_positive_figures() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "atom_kv.bench", "connector", "--peers", "1", "2", "--backend", "tcp",
         "--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--peer-tokens", "32", "--peer-procs", "2",
         "--repeats", "1", "--json", "--explore"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)  # stdout: the document alone; the target lines go to stderr
    assert doc["mode"] == "peers"
    assert [(r["backend"], r["peers"]) for r in doc["results"]] == [("tcp", 1), ("tcp", 2)]
    for r in doc["results"]:
        assert r["peers_held"] == r["peers"] + 1, r  # and the warm-up producer
        for key in ("memory_per_peer_bytes", "contact_p50_ms", "contact_p99_ms", "gbps_all_peers",
                    "gbps_one_peer", "ratio_to_one_peer"):
            assert r[key] > 0, (key, r)
        assert r["contact_p99_ms"] >= r["contact_p50_ms"]
    assert "target tcp 1 peers memory per peer: " in out.stderr
    assert "first contact with 64 peers at once, p99: not measured" in out.stderr


def test_peers_mode_refuses_a_count_below_one() -> None:
    out = subprocess.run([sys.executable, "-m", "atom_kv.bench", "connector", "--peers", "0", "--backend", "tcp"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--peers takes counts >= 1" in out.stdout + out.stderr
