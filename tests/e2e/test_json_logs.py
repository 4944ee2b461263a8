"""``--log-format json`` on a real proxy and real reference engines (a prefill engine with two TP rank
processes, a decode engine with two DP cores): every line of every log file is one JSON object with
``ts``, ``level``, ``logger`` and ``msg``; the lines about a request carry its id in both processes that
served it, and the engines' lines name their engine (the TP ranks' with their ``tp_rank``)."""

from __future__ import annotations

import json
import re

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.web import http_json

TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
JSON_DEBUG = ["--log-format", "json", "--log-level", "DEBUG"]
RID = "json-logs-e2e-1"


def _records(text: str, name: str) -> list[dict]:
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            raise AssertionError(f"{name} line {n} is not JSON: {line[:300]!r}") from None
        assert isinstance(record, dict), (name, n, line)
        for key in ("ts", "level", "logger", "msg"):
            assert isinstance(record.get(key), str), (name, n, key, line)
        assert TS.match(record["ts"]), (name, n, line)
        records.append(record)
    assert records, f"{name} wrote nothing"
    return records


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    cluster = Cluster([EngineSpec("P", tp=2, num_blocks=64, extra_args=JSON_DEBUG),
                       EngineSpec("D", dp=2, num_blocks=64, extra_args=JSON_DEBUG)],
                      proxy_args=JSON_DEBUG, log_dir=str(tmp_path_factory.mktemp("json-logs")))
    cluster.start()
    try:
        ids = {role: cluster.engine_health(cluster.index_of(role))["engine_id"] for role in ("P", "D")}
        status, body = http_json("POST", cluster.proxy_url + "/v1/completions",
                                 {"prompt": "hello json logs", "max_tokens": 4}, headers={"X-Request-Id": RID})
        assert status == 200, body
    finally:
        cluster.close()  # every process has exited: its log is complete
    assert cluster.proxy is not None
    yield ids, {"proxy": _records(cluster.proxy.log_text(), "proxy"),
                "P": _records(cluster.engines[cluster.index_of("P")].log_text(), "prefill engine"),
                "D": _records(cluster.engines[cluster.index_of("D")].log_text(), "decode engine")}


def test_the_request_id_is_on_the_lines_of_each_process_that_served_it(logs):
    _, records = logs
    proxy = [r for r in records["proxy"] if RID in r["msg"]]
    assert proxy and all(r.get("request_id") == RID for r in proxy), proxy
    for role in ("P", "D"):
        carried = [r for r in records[role] if r.get("request_id") == RID]
        assert carried, (role, records[role])
        # the HTTP side of the engine: every line naming the request (its own id starts with the proxy's)
        served = [r for r in records[role] if r["logger"] == "atom_kv.reference.server" and RID in r["msg"]]
        assert served and all(r.get("request_id") == RID for r in served), (role, served)


def test_engine_lines_name_their_engine_and_tp_ranks_their_rank(logs):
    ids, records = logs
    prefill, decode = ids["P"], ids["D"]
    ranks = [r for r in records["P"] if "tp_rank" in r]
    assert {r["tp_rank"] for r in ranks} == {0, 1}, records["P"]
    assert all(r["engine"] == prefill for r in ranks), ranks
    serving = [r for r in records["D"] if r["msg"].startswith("serving ")]
    assert serving and all(r.get("engine") == decode for r in serving), serving
    # the decode engine's two DP cores log from their own loop threads, each under its own id
    cores = {r["engine"] for r in records["D"] if r.get("engine", "").startswith(f"{decode}-dp")}
    assert cores <= {f"{decode}-dp0", f"{decode}-dp1"} and cores, records["D"]
    assert not any("engine" in r for r in records["proxy"])
