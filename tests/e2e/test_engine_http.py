"""The reference engine's HTTP surface and failure handling, on a TP=2 colocated engine."""

from __future__ import annotations

import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json, scrape_metrics
from tests.e2e.helpers import PROMPTS, generate, get_json


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    c = Cluster([EngineSpec("colocated", tp=2, num_blocks=64)], with_proxy=False,
                log_dir=str(tmp_path_factory.mktemp("tp2-engine")))
    c.start()
    try:
        yield c
    finally:
        c.close()


def test_tp2_engine_matches_tp1_reference(engine, colocated):
    for prompt in PROMPTS[:2]:
        res = generate(engine.engine_url(0), prompt, chat=False, stream=False)
        assert res.error is None and res.text == colocated.text(prompt, chat=False)


def test_request_that_never_fits_gets_a_400_in_vllm_shape(engine):
    status, body = http_json("POST", engine.engine_url(0) + "/v1/completions",
                             {"prompt": "x" * 2000, "max_tokens": 4})
    assert status == 400
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    assert "prompt needs 126 blocks" in err["message"] and "only 64" in err["message"]


def test_bad_fields_are_named(engine):
    status, body = http_json("POST", engine.engine_url(0) + "/v1/completions", {"prompt": "hi", "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body = http_json("POST", engine.engine_url(0) + "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and body["error"]["param"] == "messages"


def test_request_id_usage_models_and_metrics(engine):
    status, body = http_json("POST", engine.engine_url(0) + "/v1/completions",
                             {"prompt": "abc", "max_tokens": 3}, headers={"X-Request-Id": "rid-42"})
    assert status == 200
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert body["id"].startswith("rid-42")
    status, models = get_json(engine.engine_url(0) + "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "atom-kv-tiny"
    metrics = scrape_metrics(engine.engine_url(0) + "/metrics")
    assert metrics["atom_kv_kv_blocks_total"] == 64
    assert metrics["atom_kv_generation_tokens_total"] >= 3


def test_client_disconnect_aborts_and_frees_blocks(engine):
    url = engine.engine_url(0)
    port = int(url.rsplit(":", 1)[1])
    body = b'{"prompt": "disconnect me", "max_tokens": 400, "stream": true}'
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert b"200" in s.recv(4096)
        wait_until(lambda: get_json(url + "/health")[1]["kv_blocks"]["free"] < 64, 10, what="blocks in use")
    wait_until(lambda: get_json(url + "/health")[1]["kv_blocks"]["free"] == 64, 10,
               what="the aborted request's blocks to be freed")
    assert scrape_metrics(url + "/metrics")["atom_kv_requests_aborted_total"] >= 1


def test_dead_tp_worker_fails_requests_and_stops_the_engine(engine):
    proc = engine.engines[0]
    # engine -> fork server -> the two TP ranks
    workers = [w for c in _children(proc.pid) for w in _children(c) if _alive(w)]
    assert len(workers) == 2, workers
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(generate, engine.engine_url(0), PROMPTS[0], chat=False, stream=True,
                          max_tokens=400, timeout=30)
        wait_until(lambda: get_json(engine.engine_url(0) + "/health")[1]["requests"]["running"] > 0, 10,
                   what="a running request")
        os.kill(workers[-1], signal.SIGKILL)
        res = fut.result()
    assert res.error is not None, res
    proc.proc.wait(20)
    assert proc.proc.returncode == 1
    deadline = time.monotonic() + 10
    while any(_alive(w) for w in workers):  # no orphaned rank survives the engine
        assert time.monotonic() < deadline, [w for w in workers if _alive(w)]
        time.sleep(0.1)
