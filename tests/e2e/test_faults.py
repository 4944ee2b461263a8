"""P/D with real processes: concurrency, what crosses the two legs, killed engines, bad config.

The tests in this module share one cluster and run in file order: the
concurrency and protocol tests first, then the kill tests (which restart
what they kill).
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.ports import free_port
from atom_kv.testing.web import http_json
from tests.e2e.helpers import PROMPTS, generate, get_json

ABORT_TIMEOUT_S = 2.0
HEARTBEAT_S = 2.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(
        [
            EngineSpec("P", num_blocks=160, extra_config={"abort_timeout_s": ABORT_TIMEOUT_S}),
            EngineSpec("D", num_blocks=160, extra_config={"handshake_timeout_s": 2.0, "transfer_timeout_s": 2.0,
                                                          "transfer_retries": 1}),
            # not registered with the proxy: used directly by the load-failure tests
            EngineSpec("D", num_blocks=64, register=False, extra_config={
                "load_failure_policy": "recompute", "handshake_timeout_s": 1.0, "transfer_timeout_s": 1.0,
                "transfer_retries": 0}),
        ],
        heartbeat_timeout=HEARTBEAT_S,
        ping_interval_s=0.3,
        log_dir=str(tmp_path_factory.mktemp("faults")),
    )
    c.start()
    try:
        yield c
    finally:
        c.close()


def _free_blocks(c: Cluster, i: int) -> tuple[int, int]:
    status, body = get_json(c.engine_url(i) + "/health")
    assert status == 200, body
    return body["kv_blocks"]["free"], body["kv_blocks"]["total"]


def _wait_all_free(c: Cluster, i: int, timeout: float) -> None:
    wait_until(lambda: (lambda f, t: f == t)(*_free_blocks(c, i)), timeout,
               what=f"every KV block of engine {i} to be free")


def test_32_concurrent_requests_then_every_block_is_free(cluster, colocated):
    prompts = [(PROMPTS[i % 3] * 4)[: 20 + 17 * i] for i in range(32)]  # 20..547 bytes
    kinds = [(i % 2 == 0, i % 3 == 0) for i in range(32)]  # (chat, stream)
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(
            lambda a: generate(cluster.proxy_url, a[0], chat=a[1][0], stream=a[1][1], max_tokens=8, timeout=120),
            zip(prompts, kinds)))
    for prompt, (chat, _), res in zip(prompts, kinds, results):
        assert res.status == 200 and res.error is None, res
        assert res.text == colocated.text(prompt, chat=chat, max_tokens=8)
    for role in ("P", "D"):
        _wait_all_free(cluster, cluster.index_of(role), timeout=10)


def test_kv_transfer_params_appear_only_in_answers_of_a_pd_exchange(cluster):
    p, d = cluster.index_of("P"), cluster.index_of("D", 0)
    body = {"prompt": PROMPTS[0], "max_tokens": 4}
    status, prefill = http_json("POST", cluster.engine_url(p) + "/v1/completions",
                                {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200 and prefill["kv_transfer_params"]["transfer_id"], prefill
    status, decode = http_json("POST", cluster.engine_url(d) + "/v1/completions",
                               {**body, "kv_transfer_params": prefill["kv_transfer_params"]})
    assert status == 200 and "kv_transfer_params" not in decode, decode
    status, plain = http_json("POST", cluster.engine_url(p) + "/v1/completions", body)  # no P/D exchange
    assert status == 200 and "kv_transfer_params" not in plain, plain


def test_seeded_sampling_through_pd_is_reproducible_and_equals_colocated(cluster, colocated):
    extra = {"temperature": 2.0, "seed": 1234}
    runs = [generate(cluster.proxy_url, PROMPTS[1], chat=False, stream=stream, max_tokens=12, extra=extra)
            for stream in (False, True)]
    direct = generate(colocated.url, PROMPTS[1], chat=False, stream=False, max_tokens=12, extra=extra)
    assert all(r.error is None for r in runs + [direct]), (runs, direct)
    assert runs[0].text == runs[1].text == direct.text
    assert direct.text != colocated.text(PROMPTS[1], chat=False)  # it did sample, not argmax


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_stop_string_through_pd_equals_colocated(cluster, colocated, stream):
    full = colocated.text(PROMPTS[2], chat=True)
    stop = full[4:6]
    res = generate(cluster.proxy_url, PROMPTS[2], chat=True, stream=stream, extra={"stop": stop})
    assert res.error is None and res.text == full[: full.index(stop)] and res.finish_reason == "stop", res
    for role in ("P", "D"):
        _wait_all_free(cluster, cluster.index_of(role), timeout=10)


def _unreachable_prefill_params(prompt_tokens: int) -> dict:
    dead_port = free_port()  # nothing listens here
    return {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_host": "127.0.0.1",
            "remote_port": dead_port, "remote_handshake_port": dead_port, "remote_tp_size": 1,
            "remote_block_ids": list(range((prompt_tokens + 15) // 16)), "transfer_id": "gone-1"}


def test_failed_remote_load_ends_request_with_5xx_and_frees_blocks(cluster):
    d = cluster.index_of("D", 0)
    prompt = PROMPTS[1]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(
            lambda stream: generate(cluster.engine_url(d), prompt, chat=False, stream=stream, timeout=30,
                                    extra={"kv_transfer_params": _unreachable_prefill_params(len(prompt) + 1)}),
            (False, True)))
    for res in results:  # streaming or not, the failure comes before the first token: an HTTP 5xx
        assert res.status >= 500 and "remote KV load failed" in (res.error or ""), res
    _wait_all_free(cluster, d, timeout=10)


def test_failed_remote_load_recomputes_when_configured(cluster, colocated):
    d = cluster.index_of("D", 1)
    prompt = PROMPTS[1]
    res = generate(cluster.engine_url(d), prompt, chat=False, stream=True, timeout=30,
                   extra={"kv_transfer_params": _unreachable_prefill_params(len(prompt) + 1)})
    assert res.error is None and res.text == colocated.text(prompt, chat=False)
    _wait_all_free(cluster, d, timeout=10)


def test_decode_killed_after_prefill_producer_blocks_return_after_lease(cluster):
    p, d = cluster.index_of("P"), cluster.index_of("D")
    status, body = http_json("POST", cluster.engine_url(p) + "/v1/completions", {
        "prompt": PROMPTS[2], "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, body
    params = body["kv_transfer_params"]
    assert params["remote_block_ids"] and params["transfer_id"]
    free, total = _free_blocks(cluster, p)
    assert free == total - len(params["remote_block_ids"])  # held for the reader
    cluster.engines[d].kill()
    t0 = time.monotonic()
    _wait_all_free(cluster, p, timeout=ABORT_TIMEOUT_S + 5)
    assert time.monotonic() - t0 >= ABORT_TIMEOUT_S - 1.0  # freed by the lease expiring, not early
    cluster.restart_engine(d)
    cluster.wait_registered(30)


def test_prefill_killed_mid_run_then_restarted(cluster, colocated):
    p, d = cluster.index_of("P"), cluster.index_of("D")
    long_prompt = "A long prompt keeps the prefill engine busy for a while. " * 21  # ~1200 tokens
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(generate, cluster.proxy_url, long_prompt + str(i), chat=False, stream=bool(i % 2),
                               max_tokens=8, timeout=60) for i in range(4)]
        wait_until(lambda: sum(get_json(cluster.engine_url(p) + "/health")[1]["requests"].values()) > 0, 20,
                   interval=0.05, what="the prefill engine to start working")
        cluster.engines[p].kill()
        results = [f.result() for f in futures]
    failed = [r for r in results if r.error is not None]
    assert failed, results  # the requests in flight on the killed engine end with an error
    for i, r in enumerate(results):
        if r.error is None:  # finished before the kill: must still be right
            assert r.text == colocated.text(long_prompt + str(i), chat=False, max_tokens=8)
    # the proxy evicts the dead prefill engine
    wait_until(lambda: http_json("GET", cluster.proxy_url + "/health", timeout=2)[0] == 503,
               HEARTBEAT_S + 5, what="the proxy to evict the killed prefill engine")
    # the decode engine gave back every block of the requests that never got their KV
    _wait_all_free(cluster, d, timeout=15)
    cluster.restart_engine(p)
    cluster.wait_registered(30)
    res = generate(cluster.proxy_url, PROMPTS[1], chat=True, stream=True)
    assert res.error is None and res.text == colocated.text(PROMPTS[1], chat=True)


@pytest.mark.parametrize("config,key", [
    ('{"kv_role": "kv_producer", "tcp": {"streams": 0}}', "tcp.streams"),
    ('{"kv_role": "kv_producer", "abort_timeout": 3}', "abort_timeout"),
    ('{"kv_role": "decoder"}', "kv_role"),
    ('{"handshake_port": 6401}', "kv_role"),  # never guessed: a decode engine must not become a producer
])
def test_bad_kv_transfer_config_exits_with_one_line(config, key):
    proc = subprocess.run([sys.executable, "-m", "atom_kv.reference", "--port", "1", "--kv-transfer-config", config],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"`{key}`" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_config_json_is_reported_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "atom_kv.reference", "--kv-transfer-config", "{nope"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_moriio_unavailable_fails_engine_start_with_one_line():
    """Selecting MORI-IO on a machine without it: exit non-zero, one line saying what is missing."""
    try:
        import mori.io  # noqa: F401
    except Exception:
        pass
    else:  # pragma: no cover - only on a ROCm machine
        pytest.skip("mori.io imports here; the unavailability path cannot be exercised")
    config = f'{{"kv_role": "kv_producer", "backend": "moriio", "handshake_port": {free_port()}}}'
    proc = subprocess.run(
        [sys.executable, "-m", "atom_kv.reference", "--host", "127.0.0.1", "--port", str(free_port()),
         "--kv-transfer-config", config],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    output = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(output) == 1, output
    assert "MORI-IO unavailable: No module named 'mori'" in output[0]
    assert '"backend": "tcp"' in output[0]  # and it names the way out
    assert "Traceback" not in proc.stderr
