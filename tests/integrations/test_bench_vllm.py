"""The pure parts of ``python -m atom_kv.bench vllm`` (arguments, the vLLM Python check, the table); the
bench itself starts real vLLM servers and runs by hand (docs/vllm.md), never in the test suite."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from atom_kv.bench.vllm import (
    engine_totals, format_result, mean_ms, parse_binds, parse_extra_config, parse_levels, parse_modes,
    vllm_python_problem,
)

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


def test_modes_are_sequential_and_concurrent_in_the_order_given():
    assert parse_modes("concurrent,sequential") == ["concurrent", "sequential"]
    assert parse_modes("sequential, sequential") == ["sequential"]
    for bad in ("", "both", "sequential,parallel"):
        with pytest.raises(ValueError, match="--modes"):
            parse_modes(bad)


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


def test_the_table_shows_both_ttfts_their_ratio_the_spans_and_each_engine():
    stats = {"mean": 40.0, "p50": 36.0, "min": 30.0, "max": 60.0}
    lines = format_result({
        "mode": "concurrent", "concurrency": 1, "requests": 20, "pd_ttft_ms": stats,
        "plain_ttft_ms": {"mean": 16.0, "p50": 18.0, "min": 12.0, "max": 30.0},
        "spans_ms": {"proxy_admission": 0.3, "prefill_response": 19.0},
        "engines_ms": {"prefill": {"ttft": 10.0, "queue": 0.1, "first_step": 5.0}, "decode": {"ttft": 12.0}},
    })
    text = "\n".join(lines)
    assert lines[0] == "concurrent dispatch, concurrency 1 (20 requests each side)"
    assert "TTFT mean   P/D     40.0 ms   plain     16.0 ms   x2.50" in text
    assert "TTFT p50    P/D     36.0 ms   plain     18.0 ms   x2.00" in text
    assert "TTFT min    P/D     30.0 ms   plain     12.0 ms   x2.50" in text
    assert "target: P/D TTFT p50 <= 2x plain at concurrency 1: met" in text  # p50 x2.00
    assert "proxy_admission 0.3, prefill_response 19.0" in text
    decode = next(line for line in lines if line.strip().startswith("decode"))
    assert decode.split() == ["decode", "12.0", "-", "-"]


def test_the_target_line_is_for_concurrency_1_only_and_says_when_it_is_missed():
    def table(concurrency: int, pd_p50: float) -> str:
        stats = {"mean": pd_p50, "p50": pd_p50, "min": pd_p50, "max": pd_p50}
        plain = {"mean": 10.0, "p50": 10.0, "min": 10.0, "max": 10.0}
        return "\n".join(format_result({"mode": "sequential", "concurrency": concurrency, "requests": 4,
                                        "pd_ttft_ms": stats, "plain_ttft_ms": plain, "spans_ms": {},
                                        "engines_ms": {}}))

    assert "target: P/D TTFT p50 <= 2x plain at concurrency 1: missed" in table(1, 25.0)
    assert "target" not in table(4, 25.0)
