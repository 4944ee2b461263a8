"""``python -m atom_kv.bench routing`` end to end in ``--quick``: real reference engines and proxies, two policies
at half caches, the JSON's figures checked against each other and against the oracle (no timing is asserted:
the targets are the bench's to print). Refused policies, bad flags and ``--png`` without matplotlib answer
without starting an engine."""

from __future__ import annotations

import importlib.util
import json

import pytest

from atom_kv.bench.__main__ import main
from atom_kv.bench.routing_workload import Plan, PrefixOracle

pytest.importorskip("torch")


def test_a_quick_run_reports_consistent_figures_for_each_policy(capsys):
    assert main(["routing", "--quick", "--policies", "round_robin,cache_aware", "--cache-fraction", "0.5",
                 "--json", "--explore", "--no-aiperf"]) == 0
    doc = json.loads(capsys.readouterr().out)
    w = doc["workload"]
    (case,) = doc["cases"]
    assert case["cache_fraction"] == 0.5 and case["num_blocks"] < case["working_set_blocks"]  # eviction
    results = case["policies"]
    assert list(results) == ["round_robin", "cache_aware"]
    oracles = set()
    for name, r in results.items():
        assert r["status"] == "ok", r
        assert r["proxy_flags"] == ["--policy", name]
        assert r["requests"] == w["conversations"] * w["turns"]
        # every prompt was prefilled once on the prefill pool, and only there
        assert r["prefill_pool"]["queries"] == r["prompt_tokens"] > 0
        assert r["decode_pool"]["tokens_computed"] <= r["requests"]
        pools = r["prefill_pool"]["tokens_computed"] + r["decode_pool"]["tokens_computed"]
        assert r["prefill_tokens_computed"] == pools
        assert r["prefill_pool"]["tokens_computed"] == r["prompt_tokens"] - r["prefill_pool"]["hits"]
        # hits come in whole blocks, and never beat the oracle (it credits every earlier prefix)
        assert r["prefill_pool"]["hits"] % w["block_size"] == 0
        assert 0 < r["hit_rate"] <= r["oracle_hit_rate"] + 1e-6 <= 1
        oracles.add(r["oracle_hit_rate"])
        # the bytes moved are whole blocks read by the decode engines, turn by turn
        assert len(r["kv_bytes_moved_by_turn"]) == w["turns"]
        assert sum(r["kv_bytes_moved_by_turn"]) == r["kv_bytes_moved"] > 0
        assert r["kv_bytes_moved_turns_2_plus"] == sum(r["kv_bytes_moved_by_turn"][1:])
        assert r["decode_pool"]["blocks_read"] > 0 and r["kv_bytes_moved"] % r["decode_pool"]["blocks_read"] == 0
        t = r["ttft_ms"]
        assert 0 < t["p50"] <= t["p99"] and 0 < t["p50_turns_2_plus"] <= t["p99_turns_2_plus"]
        assert r["proxy_cpu_ms_per_request"] >= 0
        assert r["working_set_blocks"] == case["working_set_blocks"]  # the plan's estimate was exact
        assert r["local_prefills"] == {"atom_kv_proxy_local_prefills_total": 0.0}  # no local prefill asked
    assert len(oracles) == 1  # greedy answers: the same conversations under both policies
    targets = doc["targets"]
    assert set(targets) == {"hit_rate_full", "hit_rate_half", "kv_bytes_turns_2_plus", "ttft_p50_local",
                            "proxy_cpu", "index", "outside_client"}
    assert all(t["met"] is None for t in targets.values())  # kv_aware did not run, nor the full caches
    assert "kv_aware is not in --policies" in targets["hit_rate_half"]["text"]
    assert "--cache-fraction has no 1.0" in targets["proxy_cpu"]["text"]
    assert "not run (--no-aiperf)" in targets["outside_client"]["text"]


def test_a_policy_the_proxy_refuses_is_not_run_and_said_so(capsys):
    assert main(["routing", "--quick", "--policies", "no_such_policy,no_such_policy+local", "--json", "--no-aiperf"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    for case in doc["cases"]:
        plain, local = case["policies"]["no_such_policy"], case["policies"]["no_such_policy+local"]
        assert plain["status"] == local["status"] == "not_run"
        assert plain["reason"] == "the proxy refused --policy no_such_policy"
        assert local["proxy_flags"] == ["--policy", "no_such_policy", "--local-prefill-max-tokens",
                                        str(doc["local_prefill_max_tokens"])]
        assert plain["proxy_error"] and local["proxy_error"]
    assert "policy no_such_policy: not run, the proxy refused --policy no_such_policy" in captured.err
    assert f"--local-prefill-max-tokens {doc['local_prefill_max_tokens']}" in captured.err


@pytest.mark.parametrize("flags, says", [
    (["--policies", "round_robin,"], "--policies"),
    (["--policies", "cache_aware,cache_aware"], "named twice"),
    (["--cache-fraction", "0"], "--cache-fraction"),
    (["--turns", "0"], "--turns"),
    (["--local-prefill-max-tokens", "0"], "--local-prefill-max-tokens"),
])
def test_bad_flags_are_refused_in_one_line(capsys, flags, says):
    assert main(["routing", "--quick", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_png_without_matplotlib_says_what_to_install(capsys, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    chart = tmp_path / "routing.png"
    assert main(["routing", "--quick", "--policies", "round_robin", "--png", str(chart)]) == 2
    err = capsys.readouterr().err
    assert "--png needs matplotlib" in err and "pip install 'atom-kv[bench]'" in err
    assert not chart.exists()


def test_the_chart_is_drawn_where_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    from atom_kv.bench.routing_chart import draw

    row = {"status": "ok", "hit_rate": 0.5, "oracle_hit_rate": 0.8, "ttft_ms": {"p50": 10.0, "p99": 20.0}}
    doc = {"cases": [{"cache_fraction": 1.0, "policies": {"round_robin": {**row, "policy": "round_robin"}}}]}
    draw(doc, str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_oracle_credits_each_earlier_prefix_in_whole_blocks():
    oracle = PrefixOracle(block_size=4)
    first = list(range(10))
    assert oracle.offer(first, first + [100]) == 0  # nothing before it
    # the same conversation's next turn: its earlier prompt and answer, short of the last prompt token's block
    assert oracle.offer(first + [100, 101, 102], first + [100, 101, 102, 103]) == 8
    assert oracle.offer([0, 1, 2, 3, 9, 9, 9, 9, 9], [0, 1, 2, 3, 9, 9, 9, 9, 9]) == 4  # a shared first block only
    assert oracle.queries == 10 + 13 + 9 and oracle.hits == 12
    plan = Plan(conversations=4, turns=2, system_prompts=2, system_chars=40, user_chars=10, answer_tokens=3)
    assert sorted(t.conversation for t in plan.turn_order(2)) == [0, 1, 2, 3]
    assert plan.system_of(0) == plan.system_of(2) != plan.system_of(1)
