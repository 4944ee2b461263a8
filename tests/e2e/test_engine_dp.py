"""The reference engine with ``--data-parallel-size 2``: two engine cores behind one
address, each request on the rank it names (body field or header), else the
least-loaded one; /health and /metrics per rank."""

from __future__ import annotations

import json
import urllib.request

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json, scrape_metrics
from tests.e2e.helpers import PROMPTS, generate, get_json


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    c = Cluster([EngineSpec("colocated", dp=2, num_blocks=64)], with_proxy=False,
                log_dir=str(tmp_path_factory.mktemp("dp2-engine")))
    c.start()
    try:
        yield c
    finally:
        c.close()


def _served(url: str) -> list[float]:
    m = scrape_metrics(url + "/metrics")
    return [m.get(f'atom_kv_requests_ok_total{{dp_rank="{r}"}}', 0.0) for r in (0, 1)]


def test_each_rank_serves_what_it_is_named_and_matches_the_reference(engine, colocated):
    url = engine.engine_url(0)
    for rank in (0, 1):
        before = _served(url)
        res = generate(url, PROMPTS[0], chat=False, stream=False, extra={"data_parallel_rank": rank})
        assert res.error is None and res.text == colocated.text(PROMPTS[0], chat=False)
        after = _served(url)
        assert [a - b for a, b in zip(after, before)] == [1.0 if r == rank else 0.0 for r in (0, 1)]
    before = _served(url)
    status, _ = http_json("POST", url + "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                          headers={"X-data-parallel-rank": "1"})
    assert status == 200 and [a - b for a, b in zip(_served(url), before)] == [0.0, 1.0]


@pytest.mark.parametrize("body,headers,where", [
    ({"data_parallel_rank": 2}, {}, "`data_parallel_rank` must be an integer in 0..1"),
    ({"data_parallel_rank": "0"}, {}, "`data_parallel_rank` must be an integer in 0..1"),
    ({}, {"X-data-parallel-rank": "-1"}, "header X-data-parallel-rank must be an integer in 0..1"),
])
def test_rank_out_of_range_is_a_400_naming_the_range(engine, body, headers, where):
    status, answer = http_json("POST", engine.engine_url(0) + "/v1/completions",
                               {"prompt": "hi", "max_tokens": 2, **body}, headers=headers)
    assert status == 400 and answer["error"]["message"].startswith(where), answer


def test_unnamed_requests_go_to_the_least_loaded_rank(engine):
    url = engine.engine_url(0)
    # a long streaming request pinned to rank 0 keeps it loaded
    req = urllib.request.Request(url + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": "x" * 16, "max_tokens": 900, "stream": True,
                                                  "data_parallel_rank": 0}).encode())
    resp = urllib.request.urlopen(req, timeout=60)
    try:
        resp.readline()  # the first event: the request is running
        _, health = get_json(url + "/health")
        assert [r["load"]["requests"] for r in health["dp_ranks"]] == [1, 0]
        before = _served(url)
        for _ in range(3):
            status, _ = http_json("POST", url + "/v1/completions", {"prompt": "hello", "max_tokens": 2})
            assert status == 200
        assert [a - b for a, b in zip(_served(url), before)] == [0.0, 3.0]
    finally:
        resp.close()  # the client goes away: rank 0 aborts the request and frees its blocks
    wait_until(lambda: all(r["kv_blocks"]["free"] == 64 and r["load"]["requests"] == 0
                           for r in get_json(url + "/health")[1]["dp_ranks"]), 20, what="rank 0 freed")


def test_health_and_metrics_per_rank(engine):
    url = engine.engine_url(0)
    status, health = get_json(url + "/health")
    assert status == 200 and health["dp_size"] == 2
    assert [r["dp_rank"] for r in health["dp_ranks"]] == [0, 1]
    assert all(r["kv_blocks"]["total"] == 64 for r in health["dp_ranks"])
    assert health["kv_blocks"]["total"] == 128
    assert health["dp_ranks"][0]["engine_id"] != health["dp_ranks"][1]["engine_id"]
    m = scrape_metrics(url + "/metrics")
    for r in (0, 1):
        assert m[f'atom_kv_kv_blocks_total{{dp_rank="{r}"}}'] == 64
        assert f'atom_kv_load_prompt_tokens{{dp_rank="{r}"}}' in m


@pytest.mark.parametrize("argv,line", [
    (["--data-parallel-size", "0"], "error: --data-parallel-size must be >= 1"),
    (["--dp", "4", "--tp", "2", "--kv-transfer-config", '{"kv_role": "kv_producer", "handshake_port": 65530}'],
     "error: kv-transfer-config: the handshake ports (`handshake_port` = 65530, one per rank, 8 ranks) run "
     "past 65535"),
    (["--port", "7301", "--kv-transfer-config", '{"kv_role": "kv_producer", "handshake_port": 6301}'],
     "error: --port 7301 is also the tcp listener of rank pp0/dp0/tp0 (`tcp_port`); pick another HTTP port or "
     "move `tcp_port`"),
])
def test_bad_dp_flags_are_refused_in_one_line(argv, line, capsys):
    from atom_kv.reference.__main__ import main

    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == line
