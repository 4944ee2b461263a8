"""The reference engines with ``--device cuda``: proxy + prefill + decode on
GPU memory equal a colocated GPU engine token for token, over gpu_ipc (auto
on one node) and staged tcp, for TP 1/1 and 2/1 (ranks share a GPU when
there are fewer GPUs); a decode engine killed mid-load gives the prefill's
GPU blocks back within 2 s. Marked ``gpu``: ``make test-gpu``."""

from __future__ import annotations

import threading
import time

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.transfer.memory import gpu_unavailable_reason
from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json, scrape_metrics
from tests.e2e.helpers import PROMPTS, generate, get_json, kv_read_floor

_NO_GPU = gpu_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_NO_GPU is not None, reason=_NO_GPU or "")]

CUDA = ["--device", "cuda"]
ABORT_TIMEOUT_S = 1.5
#: room for the long prompt of the kill test (PROMPTS[2] * 8: 3,529 tokens, 221 blocks of 16)
NUM_BLOCKS = 320

COMBOS = [
    pytest.param((tp_p, tp_d, backend, route), id=f"P{tp_p}-D{tp_d}-{backend}")
    for backend, route in (("auto", "gpu_ipc"), ("tcp", "tcp"))
    for tp_p, tp_d in ((1, 1), (2, 1))
]


@pytest.fixture(scope="module")
def colocated_gpu(tmp_path_factory):
    c = Cluster([EngineSpec("colocated", num_blocks=256, extra_args=CUDA)], with_proxy=False,
                log_dir=str(tmp_path_factory.mktemp("colocated-gpu")))
    c.start()
    memo: dict[tuple[str, bool], str] = {}

    def text(prompt: str, chat: bool) -> str:
        if (prompt, chat) not in memo:
            res = generate(c.engine_url(0), prompt, chat=chat, stream=False)
            assert res.status == 200 and res.error is None, res
            memo[(prompt, chat)] = res.text
        return memo[(prompt, chat)]

    try:
        yield text
    finally:
        c.close()


@pytest.fixture(scope="module", params=COMBOS)
def gpu_cluster(request, tmp_path_factory):
    tp_p, tp_d, backend, route = request.param
    c = Cluster([
        EngineSpec("P", tp=tp_p, backend=backend, num_blocks=NUM_BLOCKS, extra_args=CUDA,
                   extra_config={"abort_timeout_s": ABORT_TIMEOUT_S}),
        EngineSpec("D", tp=tp_d, backend=backend, num_blocks=NUM_BLOCKS, extra_args=CUDA,
                   extra_config={"handshake_timeout_s": 5.0, "transfer_timeout_s": 5.0}),
    ], log_dir=str(tmp_path_factory.mktemp(f"gpu-{tp_p}-{tp_d}-{backend}")))
    c.start()
    try:
        yield c, route
    finally:
        c.close()


def _free(c: Cluster, i: int) -> tuple[int, int]:
    status, body = get_json(c.engine_url(i) + "/health")
    assert status == 200, body
    return body["kv_blocks"]["free"], body["kv_blocks"]["total"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_pd_on_gpu_equals_colocated_on_gpu(gpu_cluster, colocated_gpu, chat, stream):
    c, route = gpu_cluster
    d = c.index_of("D")
    m0 = scrape_metrics(c.engine_url(d) + "/metrics")
    for prompt in PROMPTS:
        res = generate(c.proxy_url, prompt, chat=chat, stream=stream)
        assert res.status == 200 and res.error is None, res
        assert res.text == colocated_gpu(prompt, chat)
    m1 = scrape_metrics(c.engine_url(d) + "/metrics")
    moved = m1.get("atom_kv_transfer_bytes", 0.0) - m0.get("atom_kv_transfer_bytes", 0.0)
    # the KV really moved, but for what the decode engine's prefix cache held
    assert moved > 0 and moved >= kv_read_floor(m0, m1, sum(len(p) for p in PROMPTS))
    log = c.engines[d].log_text()
    assert "gpu:0 memory" in log  # the decode engine registered its KV cache as GPU memory
    if route == "gpu_ipc":
        assert "uses gpu_ipc" in log  # auto chose GPU IPC for a same-node GPU peer


def test_decode_killed_mid_load_gives_prefill_gpu_blocks_back_within_2s(gpu_cluster):
    c, _ = gpu_cluster
    p, d = c.index_of("P"), c.index_of("D")
    status, body = http_json("POST", c.engine_url(p) + "/v1/completions", {
        "prompt": PROMPTS[2] * 8, "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, body
    params = body["kv_transfer_params"]
    free, total = _free(c, p)
    assert free == total - len(params["remote_block_ids"])
    load = threading.Thread(target=generate, args=(c.engine_url(d), PROMPTS[2] * 8),
                            kwargs={"chat": False, "stream": False, "timeout": 10,
                                    "extra": {"kv_transfer_params": {**params, "do_remote_prefill": True,
                                                                     "do_remote_decode": False}}},
                            name="decode-load", daemon=True)
    load.start()
    c.engines[d].kill()
    t0 = time.monotonic()
    wait_until(lambda: (lambda f, t: f == t)(*_free(c, p)), 2.0, what="the prefill's GPU blocks to come back")
    assert time.monotonic() - t0 <= 2.0
    load.join(15)
    c.restart_engine(d)
    c.wait_registered(60)
