"""Every bench prints its targets with met or MISSED and exits 1 when one is missed, unless ``--explore``
(``atom_kv.bench.targets``): the helper itself, every suite's parser, and real small runs of the transfer
and connector benches with a target moved out of (or into) reach. No figure is asserted here."""

from __future__ import annotations

import argparse
import importlib
import io
import json

import pytest

from atom_kv.bench import targets as bench_targets
from atom_kv.bench.__main__ import SUITES, parse_args
from atom_kv.bench.targets import Target, Verdict


def _report(targets: list[Target], **kw) -> tuple[int, list[str]]:
    out = io.StringIO()
    status = bench_targets.report(targets, stream=out, **kw)
    return status, out.getvalue().splitlines()


def test_a_missed_target_is_exit_status_1_and_explore_makes_it_0_with_the_same_lines():
    targets = [Target("tcp 64 KiB", "1.0 GB/s >= 0.8 x socket", True), Target("tcp 1 MiB", "0.5 GB/s", False)]
    status, lines = _report(targets, explore=False)
    assert status == 1
    assert lines == ["target tcp 64 KiB: 1.0 GB/s >= 0.8 x socket: met", "target tcp 1 MiB: 0.5 GB/s: MISSED",
                     "targets: 1 met, 1 MISSED (exit status 1; --explore for 0)"]
    status, explored = _report(targets, explore=True)
    assert status == 0 and explored[:2] == lines[:2] and "MISSED" in explored[2] and "--explore" in explored[2]


def test_all_met_or_not_measured_is_exit_status_0():
    status, lines = _report([Target("proxy", "p50 <= 2 ms", True), Target("proxy", "no errors at 512", None)],
                            explore=False)
    assert status == 0
    assert lines[1] == "target proxy: no errors at 512: not measured in this run"
    assert lines[-1] == "targets: 1 met, 0 MISSED, 1 not measured"


def test_a_run_without_targets_says_why_and_exits_0():
    status, lines = _report([], explore=False, none_reason="--breakdown explains")
    assert (status, lines) == (0, ["targets: none in this run (--breakdown explains)"])


def test_lines_off_prints_the_summary_only():
    status, lines = _report([Target("a", "x", False)], explore=False, lines=False)
    assert status == 1 and lines == ["targets: 0 met, 1 MISSED (exit status 1; --explore for 0)"]


def test_with_json_the_lines_go_to_stderr(capsys: pytest.CaptureFixture[str]):
    assert bench_targets.report([Target("a", "x", True)], explore=False, json_output=True) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and "target a: x: met" in captured.err


def test_verdicts_follow_met():
    assert [Target("a", "x", m).verdict for m in (True, False, None)] == [Verdict.MET, Verdict.MISSED,
                                                                          Verdict.NOT_MEASURED]


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_every_suite_takes_explore(suite: str):
    assert parse_args([suite]).explore is False
    assert parse_args([suite, "--explore"]).explore is True


# ---------------------------------------------------------------------- real small runs
def _transfer_args(*argv: str) -> argparse.Namespace:
    from atom_kv.bench import transfer

    parser = argparse.ArgumentParser()
    transfer.add_arguments(parser)
    return parser.parse_args(["--backend", "tcp", "--total-mb", "2", "--block-kb", "4,64", "--repeat", "1", *argv])


@pytest.mark.parametrize("fraction,want", [(1000.0, 1), (0.0, 0)], ids=["out-of-reach", "always-met"])
def test_transfer_bench_exit_status_follows_its_tcp_target(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str], fraction, want):
    from atom_kv.bench import transfer

    monkeypatch.setitem(transfer.HOST_TARGETS, "tcp", ("socket_gbps", fraction, 64))
    assert transfer.run(_transfer_args()) == want
    lines = capsys.readouterr().out.splitlines()
    (row64,) = [line for line in lines if "block    64 KiB" in line]
    assert f"target >= {fraction} x socket = " in row64 and row64.endswith("MISSED" if want else "met")
    assert "target" not in next(line for line in lines if "block     4 KiB" in line)  # below 64 KiB: none
    assert lines[-1] == ("targets: 0 met, 1 MISSED (exit status 1; --explore for 0)" if want
                         else "targets: 1 met, 0 MISSED")


def test_transfer_bench_with_explore_prints_the_miss_and_exits_0(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]):
    from atom_kv.bench import transfer

    monkeypatch.setitem(transfer.HOST_TARGETS, "tcp", ("socket_gbps", 1000.0, 64))
    assert transfer.run(_transfer_args("--json", "--explore")) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]  # stdout: the JSON rows alone
    assert [r.get("meets_target") for r in rows] == [None, False]
    assert "targets: 0 met, 1 MISSED (--explore: exit status 0 all the same)" in captured.err


def test_connector_bench_exits_1_when_a_target_is_missed(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]):
    connector = importlib.import_module("atom_kv.bench.connector")
    parser = argparse.ArgumentParser()
    connector.add_arguments(parser)
    small = ["--backend", "tcp", "--tp", "1", "--tokens", "32", "--layers", "2", "--kv-heads", "2",
             "--head-dim", "16", "--repeats", "1", "--inflight", "4"]
    monkeypatch.setattr(connector, "TARGET_RATIO", 1000.0)  # out of reach: the connector never reads 1000x bare
    assert connector.run(parser.parse_args(small)) == 1
    out = capsys.readouterr().out
    assert "target TP 1 32 tokens: " in out and ": MISSED" in out
    assert out.rstrip().endswith("(exit status 1; --explore for 0)")
