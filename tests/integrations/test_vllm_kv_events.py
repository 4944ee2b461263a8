"""Real vLLM servers publishing their KV cache events, followed by atom-kv's proxy that routes on them.

Three ``python -m vllm.entrypoints.openai.api_server`` processes on 127.0.0.1
(vLLM's CPU build, the tiny local Llama of ``examples/vllm_tiny_model.py``): a
prefill and a decode engine with ``AtomKVConnector`` and
``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:PORT"}'`` (``*``: with a host address vLLM's publisher
connects instead of binding, and the proxy could not follow it), and a plain
one. One proxy knows the pair from static specs with ``events=`` and routes
with :data:`POLICY`. Greedy completions through it equal the plain server's;
its index (``/metrics``) holds exactly the blocks vLLM caches, worked out from
the token ids (every full block of each prompt on the prefill engine, of each
prompt and its answer on the decode engine); a second round adds none, and
vLLM's cache reset empties it.

The servers take two to three minutes to start on two CPU cores; this module
runs in ``make test-engines`` only (``make test`` has no vLLM).
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable here; `make test-engines` runs these tests "
                                   "in their own environment (see docs/vllm.md)")

from atom_kv.testing.polling import wait_until  # noqa: E402
from atom_kv.testing.vllm_servers import VllmServers, write_tiny_model  # noqa: E402
from atom_kv.testing.web import http_json  # noqa: E402
from tests.e2e.helpers import generate  # noqa: E402
from tests.integrations.vllm_env import platform_reason  # noqa: E402

_REASON = platform_reason()
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)

START_TIMEOUT_S = 900.0  # three vLLM servers starting at once on two busy cores
pytestmark = pytest.mark.timeout(START_TIMEOUT_S + 300)  # the first test also waits for the servers to start

#: the proxy's routing policy: routes on the KV event index
POLICY = "kv_aware"
TOKEN = "test-engines-kv-events-secret"
BLOCK = 32  # --block-size (vLLM's CPU build prefers multiples of 32)
MAX_TOKENS = 12
INDEX_WAIT_S = 30.0
_S = "The capital of France is Paris. "
_P = "Prefill and decode run on different engines. "
_K = "KV cache blocks move between engines. "
PROMPTS = [  # 30 to 120 tokens each; the last two share their first blocks
    _S * 8 + _K,
    _P * 5 + "The capital of France is",
    _K * 12,
    "Blocks, engines, caches: " + _P * 10 + _S,
    "Blocks, engines, caches: " + _P * 10 + _K * 3,
]

AFTER_RESET = "Caches: " + _K * 5  # a prompt of its own


@pytest.fixture(scope="module")
def servers():
    log_dir = tempfile.mkdtemp(prefix="atom-kv-vllm-kv-events-")
    model = os.path.join(log_dir, "tiny-llama")
    write_tiny_model(sys.executable, model)
    s = VllmServers(log_dir, model, TOKEN, proxies={}, static_proxies={"proxy": ["--policy", POLICY]},
                    kv_events=True, vllm_args=["--block-size", str(BLOCK)],
                    vllm_env=["VLLM_SERVER_DEV_MODE=1"])  # POST /reset_prefix_cache
    try:
        s.start(START_TIMEOUT_S)
        yield s
    finally:
        s.stop()


def _plain_ids(servers, prompt: str) -> tuple[list[int], list[int]]:
    """The prompt's token ids and the plain server's greedy answer's, from vLLM itself."""
    status, body = http_json("POST", servers.url("plain") + "/v1/completions", {
        "model": servers.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}, timeout=120)
    assert status == 200, body
    choice = body["choices"][0]
    return list(choice["prompt_token_ids"]), list(choice["token_ids"])


def _blocks(sequences: list[list[int]]) -> int:
    """Distinct full blocks of ``sequences`` (a block is its whole prefix: shared first blocks count once)."""
    return len({tuple(seq[:(i + 1) * BLOCK]) for seq in sequences for i in range(len(seq) // BLOCK)})


def _indexed(servers, role: str) -> float:
    """Blocks the proxy's index holds for the ``role`` instance (its ``/metrics``)."""
    metrics = servers.metrics("proxy")
    return sum(v for k, v in metrics.items()
               if k.startswith("atom_kv_proxy_kv_indexed_blocks{") and f'role="{role}"' in k)


def _until_indexed(servers, prefill: int, decode: int, what: str) -> None:
    try:
        wait_until(lambda: (_indexed(servers, "prefill"), _indexed(servers, "decode")) == (prefill, decode),
                   INDEX_WAIT_S, interval=0.5, what=what)
    except TimeoutError:
        raise AssertionError(f"{what}: the proxy's index holds {_indexed(servers, 'prefill')} prefill and "
                             f"{_indexed(servers, 'decode')} decode blocks, vLLM caches {prefill} and {decode}")


def _round(servers) -> None:
    for prompt in PROMPTS:
        for stream in (False, True):
            pd = generate(servers.url("proxy"), prompt, chat=False, stream=stream, max_tokens=MAX_TOKENS,
                          timeout=120, extra={"model": servers.model, "ignore_eos": True})
            plain = generate(servers.url("plain"), prompt, chat=False, stream=stream, max_tokens=MAX_TOKENS,
                             timeout=120, extra={"model": servers.model, "ignore_eos": True})
            assert pd.status == plain.status == 200 and pd.error is None, (pd, plain)
            assert pd.text == plain.text and pd.finish_reason == plain.finish_reason == "length", (prompt, pd, plain)


def test_the_proxys_index_follows_what_vllm_caches_and_outputs_equal_plain_vllm(servers):
    ids = [_plain_ids(servers, p) for p in PROMPTS]
    assert all(len(prompt) >= BLOCK for prompt, _ in ids), [len(p) for p, _ in ids]
    # the prefill engine computes each prompt (max_tokens 1): its full blocks; the decode engine reads the prompt
    # and computes the answer's KV but the last token's: every full block of prompt + answer[:-1]
    prefill = _blocks([prompt for prompt, _ in ids])
    decode = _blocks([prompt + answer[:-1] for prompt, answer in ids])
    assert _blocks([ids[3][0], ids[4][0]]) < _blocks([ids[3][0]]) + _blocks([ids[4][0]])  # a shared prefix

    _round(servers)
    _until_indexed(servers, prefill, decode, "the index after the first round")
    metrics = servers.metrics("proxy")
    assert metrics['atom_kv_proxy_kv_events_total{kind="BlockStored"}'] > 0
    assert metrics.get("atom_kv_proxy_kv_event_decode_failures_total", 0.0) == 0.0
    assert metrics.get("atom_kv_proxy_kv_skipped_runs_total", 0.0) == 0.0

    _round(servers)  # the same prompts and answers: vLLM caches nothing new, and the index holds what it held
    _until_indexed(servers, prefill, decode, "the index after the second round")

    usage = 'vllm:kv_cache_usage_perc{engine="0",model_name="%s"}' % servers.model
    for name in ("prefill", "decode"):  # vLLM resets its cache only with no block held
        wait_until(lambda n=name: servers.metrics(n)[usage] == 0.0, 30, what=f"{name}: every KV block free")
        status, body = http_json("POST", servers.url(name) + "/reset_prefix_cache", timeout=30)
        assert status == 200 and body == {"success": True}, (name, status, body)
    # vLLM publishes a step's events after the step: its AllBlocksCleared goes out with the next request's
    prompt, answer = _plain_ids(servers, AFTER_RESET)
    pd = generate(servers.url("proxy"), AFTER_RESET, chat=False, stream=False, max_tokens=MAX_TOKENS, timeout=120,
                  extra={"model": servers.model, "ignore_eos": True})
    assert pd.status == 200 and pd.error is None, pd
    _until_indexed(servers, _blocks([prompt]), _blocks([prompt + answer[:-1]]),
                   "the index after vLLM's cache reset (AllBlocksCleared) and one more request")
    assert servers.metrics("proxy")['atom_kv_proxy_kv_index_resets_total{reason="cleared"}'] >= 2

