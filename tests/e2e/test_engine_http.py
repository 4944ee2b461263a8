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
from atom_kv.testing.procfs import process_stat, process_stats
from atom_kv.testing.web import http_json, scrape_metrics
from tests.e2e.helpers import PROMPTS, generate, get_json


def _children(pid: int) -> list[int]:
    return [s.pid for s in process_stats() if s.ppid == pid]


def _alive(pid: int) -> bool:
    stat = process_stat(pid)
    return stat is not None and stat.state != "Z"


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


def test_a_rank_beyond_one_data_parallel_rank_is_named_in_the_singular(engine):
    status, body = http_json("POST", engine.engine_url(0) + "/v1/completions",
                             {"prompt": "hi", "max_tokens": 1, "data_parallel_rank": 1})
    assert status == 400 and body["error"]["param"] == "data_parallel_rank"
    assert "in 0..0 (this engine has 1 data-parallel rank)" in body["error"]["message"], body


def test_bad_fields_are_named(engine):
    status, body = http_json("POST", engine.engine_url(0) + "/v1/completions", {"prompt": "hi", "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body = http_json("POST", engine.engine_url(0) + "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and body["error"]["param"] == "messages"


def test_request_id_usage_models_and_metrics(engine):
    status, body = http_json("POST", engine.engine_url(0) + "/v1/completions",
                             {"prompt": "abc", "max_tokens": 3}, headers={"X-Request-Id": "rid-42"})
    assert status == 200
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # a prompt shorter than a block
    assert body["id"].startswith("rid-42")
    status, models = get_json(engine.engine_url(0) + "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "atom-kv-tiny"
    metrics = scrape_metrics(engine.engine_url(0) + "/metrics")
    assert metrics["atom_kv_kv_blocks_total"] == 64
    assert metrics["atom_kv_generation_tokens_total"] >= 3


def test_unknown_model_is_a_404_and_a_missing_model_is_served(engine):
    url = engine.engine_url(0)
    status, body = http_json("POST", url + "/v1/completions", {"model": "llama-70b", "prompt": "hi", "max_tokens": 2})
    assert status == 404 and body["error"]["message"] == "The model `llama-70b` does not exist."
    assert body["error"]["type"] == "NotFoundError" and body["error"]["code"] == 404
    status, body = http_json("POST", url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and body["model"] == "atom-kv-tiny"


def test_unknown_paths_and_methods_answer_json_in_the_openai_shape(engine):
    url = engine.engine_url(0)
    status, body = http_json("GET", url + "/v1/nothing-here")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == 404 and "/v1/nothing-here" in body["error"]["message"]
    status, body = http_json("GET", url + "/v1/completions")
    assert status == 405 and body["error"]["type"] == "MethodNotAllowedError"
    assert "POST" in body["error"]["message"]


@pytest.mark.parametrize("extra,param", [
    ({"stream": "false"}, "stream"),
    ({"logprobs": 2}, "logprobs"),
    ({"presence_penalty": 0.4}, "presence_penalty"),
    ({"echo": True}, "echo"),
])
def test_what_the_engine_does_not_do_is_refused_not_ignored(engine, extra, param):
    status, body = http_json("POST", engine.engine_url(0) + "/v1/completions",
                             {"prompt": "hi", "max_tokens": 2, **extra})
    assert status == 400 and body["error"]["param"] == param, body


def test_tokenize_counts_what_a_completion_would_run(engine):
    url = engine.engine_url(0)
    prompt = PROMPTS[1]
    status, tok = http_json("POST", url + "/tokenize", {"model": "atom-kv-tiny", "prompt": prompt})
    assert status == 200 and set(tok) == {"count", "max_model_len", "tokens"}
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 10240
    status, body = http_json("POST", url + "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert status == 200 and body["usage"]["prompt_tokens"] == tok["count"]
    messages = [{"role": "user", "content": prompt}]
    status, tok = http_json("POST", url + "/tokenize", {"messages": messages})
    status2, body = http_json("POST", url + "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == status2 == 200 and body["usage"]["prompt_tokens"] == tok["count"]
    status, body = http_json("POST", url + "/tokenize", {"model": "nope", "prompt": "x"})
    assert status == 404


def test_colocated_answers_carry_no_kv_transfer_params(engine):
    status, body = http_json("POST", engine.engine_url(0) + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and "kv_transfer_params" not in body


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_stop_string_cuts_the_output_before_it(engine, colocated, stream):
    full = colocated.text(PROMPTS[0], chat=False, max_tokens=16)
    stop = full[6:8]
    res = generate(engine.engine_url(0), PROMPTS[0], chat=False, stream=stream, max_tokens=16,
                   extra={"stop": ["zzzz", stop]})
    assert res.error is None and res.text == full[: full.index(stop)] and res.finish_reason == "stop", res


def test_seeded_sampling_repeats_and_unseeded_sampling_does_not(engine):
    def sample(seed):
        extra = {"temperature": 3.0, **({"seed": seed} if seed is not None else {})}
        res = generate(engine.engine_url(0), PROMPTS[0], chat=False, stream=False, max_tokens=16, extra=extra)
        assert res.error is None, res
        return res.text

    assert sample(11) == sample(11)
    assert sample(None) != sample(None)


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
