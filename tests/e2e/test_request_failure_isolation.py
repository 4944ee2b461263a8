"""One request's failure inside an engine fails that request, never the engine (issue 38, F1).

Real processes: a proxy, a prefill and a decode engine, both started with the
test-only fault injector (``--inject-request-fault STAGE=MARKER``: a request
whose prompt holds MARKER raises at STAGE). Asserted for each stage, on an
engine directly and across a P/D exchange: the failing request's client gets
a clean error (a 500 in the OpenAI shape, or an error event and ``[DONE]`` in
a stream that has begun), requests alongside it succeed, every KV block on
both engines comes back, and both engines keep serving. Before this change,
an exception inside a step stopped the engine and every later client got 503.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from tests.e2e.helpers import PROMPTS, generate

FAULTS = {"admit": "@ADMIT@", "sample": "@SAMPLE@", "decode": "@DECODE@", "finish": "@FINISH@"}
FAULT_ARGS = [arg for stage, marker in FAULTS.items() for arg in ("--inject-request-fault", f"{stage}={marker}")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster([EngineSpec("P", num_blocks=96, extra_args=FAULT_ARGS, extra_config={"abort_timeout_s": 3.0}),
                 EngineSpec("D", num_blocks=96, extra_args=FAULT_ARGS,
                            extra_config={"handshake_timeout_s": 2.0, "transfer_timeout_s": 2.0})],
                ping_interval_s=0.3, log_dir=str(tmp_path_factory.mktemp("failure-isolation")))
    c.start()
    try:
        yield c
    finally:
        c.close()


def _all_blocks_free(c: Cluster, timeout: float = 15.0) -> None:
    for i in range(len(c.specs)):
        def free(i=i) -> bool:
            blocks = c.engine_health(i)["kv_blocks"]
            return blocks["free"] == blocks["total"]
        wait_until(free, timeout, what=f"every KV block of engine {i} to be free")


def _still_serving(c: Cluster) -> None:
    for url in [c.engine_url(i) for i in range(len(c.specs))] + [c.proxy_url]:
        res = generate(url, PROMPTS[0], chat=False, stream=False, max_tokens=4)
        assert res.status == 200 and res.error is None and res.text, (url, res)
    for i in range(len(c.specs)):
        assert c.engines[i].alive() and c.engine_health(i)["status"] == "ok"


def _stream_events(url: str, prompt: str, timeout: float = 60.0) -> tuple[int, list]:
    body = {"prompt": prompt, "max_tokens": 6, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        events = [line[5:].strip().decode() for line in resp if line.startswith(b"data:")]
        return resp.status, [e if e == "[DONE]" else json.loads(e) for e in events]


@pytest.mark.parametrize("stage", ["admit", "sample", "finish"])
@pytest.mark.parametrize("role", ["P", "D"])
def test_a_request_failing_in_an_engine_gets_a_500_and_the_requests_beside_it_finish(cluster, stage, role):
    url = cluster.engine_url(cluster.index_of(role))
    prompts = [PROMPTS[1], f"{FAULTS[stage]} {PROMPTS[0]}", PROMPTS[2]]
    with ThreadPoolExecutor(3) as pool:
        good1, bad, good2 = pool.map(lambda p: generate(url, p, chat=False, stream=False, max_tokens=16), prompts)
    assert bad.status == 500 and "failed in the engine's" in bad.error, bad
    for res in (good1, good2):
        assert res.status == 200 and res.error is None and len(res.text) == 16, res
    _all_blocks_free(cluster)
    _still_serving(cluster)


def test_a_stream_failing_after_its_first_token_ends_with_an_error_event(cluster):
    status, events = _stream_events(cluster.engine_url(0), f"{FAULTS['decode']} {PROMPTS[0]}")
    assert status == 200  # the stream had begun
    assert events[-1] == "[DONE]" and "error" in events[-2], events
    assert "failed in the engine's sampling" in events[-2]["error"]["message"]
    assert any(e["choices"][0]["text"] for e in events[:-2] if isinstance(e, dict) and e.get("choices")), events
    _all_blocks_free(cluster)


@pytest.mark.parametrize("stage", ["sample", "finish"])
def test_a_prefill_failing_in_a_pd_exchange_fails_that_request_and_releases_every_block(cluster, stage):
    """The prefill ends as an abort: its handoff is dropped (a decode leg waiting on its blocks is answered)
    and nothing is lent, so both engines get every block back; the client gets an error, not a hang."""
    for stream in (False, True):
        res = generate(cluster.proxy_url, f"{FAULTS[stage]} {PROMPTS[2]}", chat=False, stream=stream, max_tokens=8,
                       timeout=30)
        assert res.error is not None and not res.text, res
    _all_blocks_free(cluster)
    _still_serving(cluster)


def test_a_decode_failing_after_its_load_fails_that_request_and_releases_every_block(cluster):
    res = generate(cluster.proxy_url, f"{FAULTS['decode']} {PROMPTS[1]}", chat=False, stream=True, max_tokens=8,
                   timeout=30)
    assert res.error is not None, res
    _all_blocks_free(cluster)
    _still_serving(cluster)


def test_each_failure_is_one_line_in_its_engines_log_and_no_engine_stopped(cluster):
    for i in range(len(cluster.specs)):
        log = cluster.engines[i].log_text()
        assert "stopping:" not in log and "engine loop crashed" not in log and "Traceback" not in log, log[-3000:]
        failures = [line for line in log.splitlines() if " failed in " in line and "InjectedFault" in line]
        assert failures, log[-3000:]
