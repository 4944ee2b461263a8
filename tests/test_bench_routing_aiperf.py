"""``bench routing``'s outside-client row (aiperf), without aiperf: the row is not run and says why, aiperf's
summary export is parsed from a small recorded one (``tests/data/aiperf_profile_export_small.json``, written by
aiperf 0.13.0 against this bench's cluster, trimmed to the keys the parser reads and a few around them), the
target's arithmetic, and the subprocess's failures as one line. With aiperf installed (on PATH, or the
executable in ``ATOM_KV_AIPERF``) a short real run of both policies; skipped otherwise."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from atom_kv.bench import hf_byte_tokenizer
from atom_kv.bench.__main__ import main
from atom_kv.bench.routing_aiperf import (AiperfError, AiperfResult, find_aiperf, outside_client_target,
                                          parse_export, run_aiperf)
from atom_kv.reference.tokenizer import ByteTokenizer

RECORDED = Path(__file__).parent / "data" / "aiperf_profile_export_small.json"


def _aiperf() -> str | None:
    return os.environ.get("ATOM_KV_AIPERF") or shutil.which("aiperf")


def _export(tmp_path: Path, edit) -> str:
    doc = json.loads(RECORDED.read_text())
    edit(doc)
    path = tmp_path / "profile_export_aiperf.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_the_recorded_export_gives_its_figures():
    result = parse_export(str(RECORDED))
    assert result == AiperfResult(output_tok_s=48.19134636717926, ttft_p90_ms=379.7180153999999, succeeded=24,
                                  failed=0, request_rate=3.0119591479487036)
    assert result.success_rate == 1.0


def test_failed_requests_are_counted_from_error_request_count(tmp_path):
    def with_errors(doc):
        doc["error_request_count"] = {"unit": "requests", "avg": 6.0}
    result = parse_export(_export(tmp_path, with_errors))
    assert (result.succeeded, result.failed, result.success_rate) == (24, 6, 0.8)


@pytest.mark.parametrize("edit, says", [
    (lambda d: d.pop("time_to_first_token"), "time_to_first_token.p90 is missing"),
    (lambda d: d["output_token_throughput"].update(avg="fast"), "output_token_throughput.avg is missing or not"),
    (lambda d: d["time_to_first_token"].update(p90=-1.0), "time_to_first_token.p90"),
    (lambda d: d.update(was_cancelled=True), "the run was cancelled"),
    (lambda d: d["request_count"].update(avg=0.0), "no request succeeded"),
])
def test_an_export_without_a_figure_is_refused_in_one_line(tmp_path, edit, says):
    with pytest.raises(AiperfError) as err:
        parse_export(_export(tmp_path, edit))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_missing_or_broken_export_is_refused_in_one_line(tmp_path, monkeypatch):
    with pytest.raises(AiperfError, match="aiperf wrote no profile_export_aiperf.json"):
        parse_export(str(tmp_path / "profile_export_aiperf.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(AiperfError, match="not readable JSON"):
        parse_export(str(tmp_path / "bad.json"))
    monkeypatch.setattr("atom_kv.bench.routing_aiperf.MAX_EXPORT_BYTES", 100)
    with pytest.raises(AiperfError, match="more than the 100 a summary export takes"):
        parse_export(str(RECORDED))


def _result(tok_s: float, ttft: float, ok: int = 20, failed: int = 0) -> AiperfResult:
    return AiperfResult(output_tok_s=tok_s, ttft_p90_ms=ttft, succeeded=ok, failed=failed, request_rate=2.0)


def test_the_target_is_met_by_either_ratio_and_compared_only_at_equal_success():
    base = _result(100.0, 200.0)
    assert outside_client_target({"cache_aware": base, "kv_aware": _result(100.0, 100.0)}).met is True  # TTFT 0.5x
    assert outside_client_target({"cache_aware": base, "kv_aware": _result(120.0, 190.0)}).met is True  # 1.2x tok/s
    missed = outside_client_target({"cache_aware": base, "kv_aware": _result(110.0, 150.0)})
    assert missed.met is False
    assert "1.10x" in missed.text and "0.75x" in missed.text and "20/20 and 20/20 succeeded" in missed.text
    differ = outside_client_target({"cache_aware": base, "kv_aware": _result(300.0, 10.0, ok=19, failed=1)})
    assert differ.met is None and "not compared, the success rates differ" in differ.text
    not_run = outside_client_target({"cache_aware": base, "kv_aware": "aiperf exited with 1: boom"})
    assert not_run.met is None and "not run (kv_aware: aiperf exited with 1: boom)" in not_run.text


def test_without_aiperf_the_row_is_not_run_and_says_why(capsys, tmp_path, monkeypatch):
    pytest.importorskip("torch")  # the routing bench's extra
    monkeypatch.setenv("PATH", str(tmp_path))  # no aiperf here
    assert find_aiperf(None)[0] is None
    assert main(["routing", "--aiperf-only", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["cases"] == [] and list(doc["targets"]) == ["outside_client"]
    row = doc["targets"]["outside_client"]
    assert row["met"] is None and "not run (aiperf is not on PATH" in row["text"] and "--aiperf" in row["text"]
    assert doc["outside_client"]["status"] == "not_run"
    assert "1 not measured" in captured.err


def test_an_aiperf_path_that_is_no_executable_is_refused_in_one_line(capsys, tmp_path):
    pytest.importorskip("torch")  # the routing bench's extra
    not_exe = tmp_path / "aiperf"
    not_exe.write_text("")
    assert main(["routing", "--aiperf-only", "--aiperf", str(not_exe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--aiperf {not_exe}: not an executable file" in err[0]


def test_a_run_that_fails_or_hangs_is_one_line(tmp_path):
    with pytest.raises(AiperfError) as err:
        run_aiperf(["/bin/sh", "-c", "echo starting; echo 'no such model' >&2; exit 3"], str(tmp_path / "a"), 30)
    assert str(err.value).startswith("aiperf exited with 3: no such model (output in ")
    with pytest.raises(AiperfError, match="aiperf did not start"):
        run_aiperf([str(tmp_path / "nothing-here")], str(tmp_path / "b"), 30)
    started = time.monotonic()
    # a child that outlives its shell: the whole process group goes
    with pytest.raises(AiperfError, match=r"aiperf ran past 0.5 s and was stopped"):
        run_aiperf(["/bin/sh", "-c", "sleep 60 & wait"], str(tmp_path / "c"), 0.5)
    assert time.monotonic() - started < 20
    with pytest.raises(AiperfError, match="aiperf wrote no profile_export_aiperf.json"):
        run_aiperf(["/bin/sh", "-c", "exit 0"], str(tmp_path / "d"), 30)


def test_the_tokenizer_directory_maps_text_to_the_engines_byte_ids(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    folder = hf_byte_tokenizer.write(str(tmp_path / "tok"))
    tok = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    text = "Shall I compare thee\n\t to a summer's day? <|eos|> é \x00\x7f"
    assert tok.encode(text).ids == ByteTokenizer().encode(text, add_bos=False)
    assert tok.decode(tok.encode(text).ids) == text
    assert json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"


def test_a_short_real_aiperf_run_fills_the_row(capsys):
    exe = _aiperf()
    if exe is None:
        pytest.skip("aiperf is not installed (pip install aiperf into its own virtualenv; put it on PATH or "
                    "name the executable in ATOM_KV_AIPERF)")
    pytest.importorskip("torch")
    count = 6
    assert main(["routing", "--aiperf-only", "--aiperf", exe, "--aiperf-request-count", str(count),
                 "--aiperf-request-rate", "2", "--aiperf-turns", "2", "--aiperf-system-prompt-tokens", "64",
                 "--aiperf-num-blocks", "128", "--json", "--explore"]) == 0
    doc = json.loads(capsys.readouterr().out)
    runs = doc["outside_client"]["runs"]
    assert list(runs) == ["cache_aware", "kv_aware"]
    for run in runs.values():
        assert run["status"] == "ok", run
        assert (run["succeeded"], run["failed"]) == (count, 0)
        assert run["output_tok_s"] > 0 and run["ttft_p90_ms"] > 0
    row = doc["targets"]["outside_client"]
    assert row["met"] in (True, False) and f"{count}/{count} and {count}/{count} succeeded" in row["text"]


@pytest.mark.parametrize("flags, says", [
    (["--aiperf-request-rate", "0"], "--aiperf-request-rate: must be a number > 0"),
    (["--aiperf-timeout", "inf"], "--aiperf-timeout: must be a number > 0"),
    (["--aiperf-turns", "-1"], "--aiperf-turns: must be a number > 0"),
    (["--no-aiperf", "--aiperf-only"], "--no-aiperf leaves out what --aiperf and --aiperf-only ask for"),
    (["--aiperf-only", "--png", "chart.png"], "--png draws the policies' runs, which --aiperf-only leaves out"),
])
def test_bad_aiperf_flags_are_refused_in_one_line(capsys, flags, says):
    pytest.importorskip("torch")  # the routing bench's extra
    assert main(["routing", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]
