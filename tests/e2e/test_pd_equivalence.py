"""Greedy outputs through proxy + prefill + decode equal a colocated engine's, token for token.

One cluster per (prefill TP, decode TP, backend): every TP mix over tcp, the unequal
ones over cma, one over nixl. Every cluster serves
completions and chat, streaming and not, in both modes: through a proxy that
forwards the prefill's first token (the decode engine continues from it),
through one started with ``--no-first-token-forwarding`` (sequential legs, the
decode engine computes the first token again) and through one started with
``--concurrent-dispatch`` (both legs at once; the decode engine learns the
blocks and the prefill's first token from the prefill engine and continues
from it; a streamed answer's first token comes from the prefill's answer, and
the decode engine, told so up front, leaves it out).
"""

from __future__ import annotations

import time

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.web import scrape_metrics
from atom_kv.transfer.nixl.probe import nixl_unavailable_reason
from tests.e2e.helpers import PROMPTS, generate, get_json, kv_read_floor

COMBOS = [
    pytest.param((tp_p, tp_d, backend), id=f"P{tp_p}-D{tp_d}-{backend}")
    for backend, mixes in (("tcp", ((1, 1), (2, 2), (2, 1), (1, 2))),
                           # the TP mixing is the connector's, the same over every backend: cma runs the two
                           # unequal mixes, where its reads are split and merged across ranks
                           ("cma", ((2, 1), (1, 2))))
    for tp_p, tp_d in mixes
] + [
    # real NIXL (UCX on loopback), one TP mix: the backend is what differs
    pytest.param((2, 1, "nixl"), id="P2-D1-nixl",
                 marks=pytest.mark.skipif(bool(nixl_unavailable_reason()), reason=nixl_unavailable_reason() or "")),
]


@pytest.fixture(scope="module", params=COMBOS)
def cluster(request, tmp_path_factory):
    tp_p, tp_d, backend = request.param
    c = Cluster([
        EngineSpec("P", tp=tp_p, backend=backend, num_blocks=128,
                   extra_config={"abort_timeout_s": 10.0}),
        EngineSpec("D", tp=tp_d, backend=backend, num_blocks=128,
                   extra_config={"handshake_timeout_s": 3.0, "transfer_timeout_s": 3.0}),
    ], extra_proxies=[["--no-first-token-forwarding"], ["--concurrent-dispatch"]], log_dir=str(tmp_path_factory.mktemp(f"pd-{tp_p}-{tp_d}-{backend}")))
    c.start()
    try:
        yield c
    finally:
        c.close()
    # every engine (and with nixl, every process that used NIXL) shut down cleanly on one SIGTERM
    codes = {f"{s.role}{i}": p.proc.returncode for i, (s, p) in enumerate(zip(c.specs, c.engines))}
    assert set(codes.values()) == {0}, f"engine exit statuses: {codes}"


def _blocks_all_free(c: Cluster) -> bool:
    for i in range(len(c.specs)):
        status, body = get_json(c.engine_url(i) + "/health")
        if status != 200 or body["kv_blocks"]["free"] != body["kv_blocks"]["total"]:
            return False
    return True


_FORWARDED = "atom_kv_proxy_first_tokens_forwarded_total"
_GENERATED = "atom_kv_generation_tokens_total"
_CONCURRENT = "atom_kv_proxy_concurrent_dispatches_total"
_PROXIES = {"first_token": None, "sequential": 0, "concurrent": 1}  # None: the cluster's own proxy


@pytest.mark.parametrize("mode", ["first_token", "sequential", "concurrent"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_pd_output_equals_colocated(cluster, colocated, chat, stream, mode):
    d = cluster.index_of("D")
    n = _PROXIES[mode]
    proxy = cluster.proxy_url if n is None else cluster.extra_proxy_urls[n]
    before = scrape_metrics(cluster.engine_url(d) + "/metrics")
    proxy_before = scrape_metrics(proxy + "/metrics")
    extra = {"stream_options": {"include_usage": True}} if stream else None
    for prompt in PROMPTS:
        res = generate(proxy, prompt, chat=chat, stream=stream, extra=extra)
        assert res.status == 200 and res.error is None, res
        assert res.text == colocated.text(prompt, chat=chat)
        assert len(res.text) == 12 and res.finish_reason == "length"
        assert res.usage is not None and res.usage["completion_tokens"] == 12, res
        assert res.usage["prompt_tokens"] == colocated.usage(prompt, chat=chat)["prompt_tokens"], res
    after = scrape_metrics(cluster.engine_url(d) + "/metrics")
    # the decode engine really read the prompts' KV (4 KiB per token in total), but for what it had cached
    moved = after.get("atom_kv_transfer_bytes", 0.0) - before.get("atom_kv_transfer_bytes", 0.0)
    assert moved > 0 and moved >= kv_read_floor(before, after, sum(len(p) for p in PROMPTS))
    # continuing from the prefill's token (first-token forwarding, or the rendezvous), the decode engine samples
    # 11 of the 12 tokens; sequential, all 12
    per_request = 11 if mode in ("first_token", "concurrent") else 12
    assert after[_GENERATED] - before[_GENERATED] == per_request * len(PROMPTS)
    proxy_after = scrape_metrics(proxy + "/metrics")
    forwarded = proxy_after.get(_FORWARDED, 0.0) - proxy_before.get(_FORWARDED, 0.0)
    assert forwarded == (len(PROMPTS) if stream and mode in ("first_token", "concurrent") else 0)
    concurrent = proxy_after.get(_CONCURRENT, 0.0) - proxy_before.get(_CONCURRENT, 0.0)
    assert concurrent == (len(PROMPTS) if mode == "concurrent" else 0)


def test_every_block_is_free_afterwards(cluster):
    deadline = time.monotonic() + 10
    while not _blocks_all_free(cluster):
        assert time.monotonic() < deadline, [get_json(cluster.engine_url(i) + "/health")[1]
                                             for i in range(len(cluster.specs))]
        time.sleep(0.2)


def test_a_normal_start_logs_no_false_alarm(cluster):
    """Engines register only once they serve, and the proxy calls an instance it never reached "starting":
    starting the cluster logged no "down" and no "up again"."""
    assert cluster.proxy is not None
    log = cluster.proxy.log_text()
    assert "registered prefill instance" in log and "registered decode instance" in log
    assert " is down" not in log and "up again" not in log and " is starting" not in log, log
