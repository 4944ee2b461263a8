"""Smoke tests of ``python -m atom_kv.bench transfer`` (output shape and
verification), on a small buffer; no throughput is asserted here."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from atom_kv.bench import transfer as bench

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cli_prints_verified_json_lines() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "atom_kv.bench", "transfer", "--backend", "tcp", "--total-mb", "4",
         "--block-kb", "4,64", "--scattered", "--repeat", "1", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert [r["block_kb"] for r in rows] == [4, 64]
    for r in rows:
        assert r["backend"] == "tcp" and r["scattered"] is True and r["verified"] is True
        assert r["gbps"] > 0 and r["memcpy_gbps"] > 0 and r["socket_gbps"] > 0


def test_bench_exits_nonzero_when_bytes_differ(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = bench.pattern

    def wrong(nbytes: int, seed: int) -> np.ndarray:  # the reader expects other bytes
        return real(nbytes, seed + 1)

    monkeypatch.setattr(bench, "pattern", wrong)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--backend", "tcp", "--total-mb", "1", "--block-kb", "64", "--repeat", "1", "--json"])
    assert bench.run(args) == 1
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["verified"] is False and "differ" in row["error"]


def test_bench_unavailable_backend_exits_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from atom_kv.transfer import BackendUnavailable

    def unavailable(*a: object, **k: object) -> None:
        raise BackendUnavailable("no such hardware here")

    monkeypatch.setattr("atom_kv.transfer.create_backend", unavailable)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--backend", "moriio", "--total-mb", "1", "--block-kb", "64"])) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such hardware here" in err
