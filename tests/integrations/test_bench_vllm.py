"""The pure parts of ``python -m atom_kv.bench vllm`` (arguments, the vLLM Python check, the table); the
bench itself starts real vLLM servers and runs by hand (docs/vllm.md), never in the test suite."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from atom_kv.bench.vllm import (
    default_binds, engine_totals, external_tokens, format_result, mean_ms, parse_binds, parse_extra_config,
    parse_levels, parse_modes, target_lines, vllm_python_problem,
)
from atom_kv.testing.vllm_servers import memory_problem

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script(tmp_path, name: str, status: int) -> str:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\nexit {status}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_missing_vllm_python_stops_the_bench_with_one_line_naming_it():
    out = subprocess.run([sys.executable, "-m", "atom_kv.bench", "vllm", "--vllm-python", "/nonexistent/python"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no vLLM Python at /nonexistent/python"), out.stderr
    assert "make .venv-vllm/.installed" in lines[0] and "Traceback" not in out.stderr


def test_the_vllm_python_check_tells_a_python_without_vllm_from_one_with_it(tmp_path):
    assert "cannot import vllm" in vllm_python_problem(_script(tmp_path, "no-vllm", 1))
    assert vllm_python_problem(_script(tmp_path, "with-vllm", 0)) is None
    plain_file = tmp_path / "not-executable"
    plain_file.write_text("")
    assert vllm_python_problem(str(plain_file)).startswith(f"no vLLM Python at {plain_file}")


def test_omp_bind_takes_three_values_and_names_the_flag_otherwise():
    assert parse_binds("0,1,0") == {"prefill": "0", "decode": "1", "plain": "0"}
    assert parse_binds("nobind, nobind,0-1")["plain"] == "0-1"
    for bad in ("0,1", "0,1,2,3", "0,,1"):
        with pytest.raises(ValueError, match="--omp-bind"):
            parse_binds(bad)


def test_concurrency_levels_are_positive_integers():
    assert parse_levels("1,4") == [1, 4]
    for bad in ("", "0", "1,x", "-1"):
        with pytest.raises(ValueError, match="--concurrency"):
            parse_levels(bad)


def test_modes_are_ours_and_vllms_nixl_pair_in_the_order_given():
    assert parse_modes("concurrent,sequential") == ["concurrent", "sequential"]
    assert parse_modes("sequential, sequential") == ["sequential"]
    assert parse_modes("nixl,nixl-router,concurrent") == ["nixl", "nixl-router", "concurrent"]
    for bad in ("", "both", "sequential,parallel"):
        with pytest.raises(ValueError, match="--modes"):
            parse_modes(bad)


def test_the_default_pinning_is_one_core_per_engine():
    assert default_binds([0, 1]) == "0,1,0"          # plain shares the prefill's core: never busy at once
    assert default_binds([4, 5, 6, 7]) == "4,5,6"
    assert default_binds([3]) == "nobind,nobind,nobind"


def test_the_external_kv_token_count_is_read_per_source():
    metrics = {'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"}': 120.0,
               'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"}': 7.0,
               "vllm:prompt_tokens_by_source_total": 127.0}
    assert external_tokens(metrics) == 120.0
    assert external_tokens({}) == 0.0


def test_memory_for_the_servers_is_checked_up_front_naming_the_flag():
    assert memory_problem(3, 1 << 20) is None  # 3 servers with 1 MiB of KV each fit any test machine
    why = memory_problem(5, 1 << 50)
    assert why is not None and "--kv-cache-mb" in why and "\n" not in why


def test_extra_config_is_a_json_object():
    assert parse_extra_config('{"idle_wait_ms": 0}') == {"idle_wait_ms": 0}
    for bad in ("", "[1]", "{idle_wait_ms: 0}"):
        with pytest.raises(ValueError, match="--extra-config"):
            parse_extra_config(bad)


def test_engine_means_come_from_the_histograms_deltas():
    before = engine_totals({"vllm:time_to_first_token_seconds_sum": 1.0,
                            "vllm:time_to_first_token_seconds_count": 10.0})
    after = engine_totals({"vllm:time_to_first_token_seconds_sum": 1.5, "vllm:time_to_first_token_seconds_count": 20.0,
                           "vllm:request_queue_time_seconds_sum": 0.2, "vllm:request_queue_time_seconds_count": 4.0})
    means = mean_ms(before, after)
    assert means == pytest.approx({"ttft": 50.0, "queue": 50.0})  # first_step: no new sample, left out


def _level(concurrency: int, modes: dict[str, float], plain_p50: float = 10.0, external: float = 200.0):
    plain = {"mean": plain_p50, "p50": plain_p50, "min": plain_p50, "max": plain_p50}
    return {"concurrency": concurrency, "requests": 4, "plain_ttft_ms": plain, "engines_ms": {},
            "modes": {m: {"ttft_ms": {"mean": p + 2, "p50": p, "min": p - 1, "max": p + 5},
                          "external_tokens": external, "prompt_tokens": 200,
                          **({"spans_ms": {"proxy_admission": 0.3}} if m != "nixl-router" else {})}
                      for m, p in modes.items()}}


def test_the_table_shows_each_mode_next_to_plain_with_its_ratio_and_kv_tokens():
    r = _level(1, {"sequential": 30.0, "concurrent": 18.0, "nixl": 25.0})
    r["engines_ms"] = {"prefill": {"ttft": 10.0, "queue": 0.1, "first_step": 5.0}, "decode": {"ttft": 12.0}}
    lines = format_result(r)
    text = "\n".join(lines)
    assert lines[0] == "concurrency 1 (4 requests per mode and plain, interleaved)"
    row = next(line for line in lines if line.strip().startswith("concurrent "))
    assert row.split() == ["concurrent", "18.0", "17.0", "20.0", "1.80", "200", "of", "200"]
    assert "sequential proxy spans (mean ms): proxy_admission 0.3" in text
    decode = next(line for line in lines if line.strip().startswith("decode"))
    assert decode.split() == ["decode", "12.0", "-", "-"]


def test_targets_compare_our_modes_with_the_nixl_pair_and_plain_and_check_the_kv_tokens():
    lines = target_lines(_level(4, {"sequential": 30.0, "concurrent": 18.0, "nixl": 25.0}))
    assert any(line.startswith("target concurrent: TTFT p50 18.0 ms <= 2x plain (20.0 ms) and <= nixl 25.0 ms: met")
               for line in lines), lines
    assert any(line.startswith("target sequential:") and line.endswith(": MISSED") for line in lines)  # 30 > 20, 25
    assert sum("prompt tokens from the remote KV: met" in line for line in lines) == 3
    starved = target_lines(_level(1, {"concurrent": 12.0}, external=150.0))
    assert "target concurrent: TTFT p50 12.0 ms <= 2x plain (20.0 ms): met" in starved
    assert "target concurrent: decode took 150 of 200 prompt tokens from the remote KV: MISSED" in starved


def test_start_up_progress_says_what_is_awaited_and_what_is_up(monkeypatch):
    """``bench vllm`` prints these while the servers start (two minutes of silence before)."""
    from atom_kv.testing import vllm_servers

    monkeypatch.setattr(vllm_servers, "PROGRESS_EVERY_S", 0.0)  # every poll a reminder
    lines: list[str] = []
    note = vllm_servers._Progress(lines.append)
    answers = iter([None, False, True])

    def not_up_then_up():
        value = next(answers)
        if value is None:
            raise ConnectionRefusedError  # not listening yet: "not yet", as wait_until takes it
        return value

    check = note.polling(not_up_then_up, "vLLM decode to serve /health")
    assert [check(), check(), check()] == [None, False, True]
    note.done("vLLM decode serves")
    assert [line.rsplit(" (", 1)[0] for line in lines] == ["still waiting for vLLM decode to serve /health"] * 2 + [
        "vLLM decode serves"]
    assert all(line.endswith(" s)") for line in lines)
