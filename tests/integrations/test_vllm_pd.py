"""vLLM's real v1 Scheduler on both sides of a P/D pair, with AtomKVConnector
loaded by ``kv_connector_module_path``: whole request lives over real tcp and
cma reads between CPU KV caches, every byte checked, every block given back;
and engines whose KV layouts differ refusing each other at the handshake."""

from __future__ import annotations

import logging

import msgspec

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable here; `make test-engines` runs these tests "
                                   "in their own environment (see docs/vllm.md)")

import torch  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from atom_kv.connector import ConnectorScheduler, create_worker  # noqa: E402
from atom_kv.transfer import BackendUnavailable, create_backend  # noqa: E402
from atom_kv.wire import CompatInfo, KVTransferParams  # noqa: E402
from tests.connector.engines import Engine, LocalRank  # noqa: E402
from tests.connector.engines import run_until as connector_run_until  # noqa: E402
from tests.connector.kvutil import config as kv_config  # noqa: E402
from tests.connector.kvutil import port_range  # noqa: E402
from tests.integrations.vllm_engine import (  # noqa: E402
    BLOCK,
    HEAD,
    LAYERS,
    SENTINEL,
    VllmEngine,
    make_request,
    make_vllm_config,
    run_until,
    write_tiny_model,
)

NUM_BLOCKS = 64


def _cma_reason() -> str:
    try:
        create_backend("cma").close()
        return ""
    except BackendUnavailable as exc:
        return str(exc)


CMA_UNAVAILABLE = _cma_reason()
BACKENDS = ["tcp", pytest.param("cma", marks=pytest.mark.skipif(bool(CMA_UNAVAILABLE), reason=CMA_UNAVAILABLE))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def extra(backend: str, port: int, **overrides) -> dict:
    base = dict(backend=backend, handshake_port=port, host_ip="127.0.0.1", handshake_timeout_s=2.0,
                transfer_timeout_s=2.0, abort_timeout_s=30.0, transfer_retries=1, transfer_retry_backoff_ms=20.0)
    base.update(overrides)
    return base


class Pair:
    """A producer and a consumer engine; closes both."""

    def __init__(self, model_dir, backend: str = "tcp", *, p_tp: int = 1, d_tp: int = 1,
                 policy: str = "fail", p_overrides: dict | None = None, d_overrides: dict | None = None,
                 async_scheduling: bool = True, d_blocks: int = NUM_BLOCKS,
                 p_attention: str = "CPU_ATTN", d_attention: str = "CPU_ATTN") -> None:
        self.P = VllmEngine(make_vllm_config(model_dir, "kv_producer",
                                             extra(backend, port_range(p_tp), **(p_overrides or {})),
                                             tp_size=p_tp, async_scheduling=async_scheduling,
                                             attention_backend=p_attention), NUM_BLOCKS)
        try:
            self.D = VllmEngine(make_vllm_config(model_dir, "kv_consumer",
                                                 extra(backend, port_range(d_tp), **(d_overrides or {})),
                                                 tp_size=d_tp, failure_policy=policy,
                                                 async_scheduling=async_scheduling, attention_backend=d_attention),
                                d_blocks)
        except BaseException:
            self.P.close()
            raise
        self.snapshots: dict[str, list] = {}

    def prefill(self, rid: str, prompt: list[int], **params) -> dict:
        """Run the prefill leg; returns the kv_transfer_params the decode leg gets (and snapshots its blocks)."""
        self.P.add(make_request(rid, prompt, max_tokens=1,
                                kv_transfer_params={"do_remote_decode": True, **params}))
        found: dict = {}

        def on_step(engine, result):
            for out in result.outputs:
                if out.request_id == rid and out.finish_reason is not None:
                    found["out"] = out

        run_until([self.P], lambda: "out" in found, on_step=on_step)
        out = found["out"]
        assert out.new_token_ids == [7]
        params = out.kv_transfer_params
        assert params is not None and params["do_remote_prefill"] is True
        assert params["remote_block_ids"] == self.P.blocks_of(rid)  # still held for the decode engine
        assert rid in self.P.scheduler.requests
        self.snapshots[params["transfer_id"]] = self.P.block_bytes(params["remote_block_ids"])
        return params

    def close(self) -> None:
        self.D.close()
        self.P.close()


@pytest.fixture
def pair_factory(model_dir):
    pairs: list[Pair] = []

    def make(backend: str = "tcp", **kwargs) -> Pair:
        pair = Pair(model_dir, backend, **kwargs)
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        pair.close()


def prompt_of(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 11) % 250 + 1 for i in range(n)]


def empty(engine: VllmEngine) -> bool:
    """Every block back in the pool (vLLM keeps one null block) and no request left."""
    return not engine.scheduler.requests and engine.num_free_blocks() == NUM_BLOCKS - 1


def decode(pair: Pair, drid: str, prompt: list[int], params: dict, *, max_tokens: int = 3,
           verify_load: bool = True) -> dict:
    """Run the decode leg to its end; at the step the load is reported, compare every byte."""
    D, P = pair.D, pair.P
    D.add(make_request(drid, prompt, max_tokens=max_tokens, kv_transfer_params=params))
    seen: dict = {"tokens": []}

    def on_step(engine, result):
        if engine is D:
            if drid in result.finished_recving:
                seen["recv_step"] = True
                seen["invalid"] = set(result.invalid_block_ids)
                if drid in D.scheduler.requests:
                    seen["blocks"] = D.blocks_of(drid)
                    seen["bytes"] = D.block_bytes(seen["blocks"])
                if verify_load and not result.invalid_block_ids:
                    n = len(params["remote_block_ids"])
                    got = D.block_bytes(D.blocks_of(drid)[:n])
                    want = pair.snapshots[params["transfer_id"]]
                    seen["bytes_equal"] = all(g.equal(w) for g, w in zip(got, want))
                    seen["pattern"] = D.kv_mismatch(drid, prompt, len(prompt))
            if result.stats:
                seen.setdefault("stats", []).append(result.stats)
            for out in result.outputs:
                if out.request_id == drid:
                    seen["tokens"].extend(out.new_token_ids)
                    if out.finish_reason is not None:
                        seen["finish"] = out.finish_reason
    run_until([P, D], lambda: "finish" in seen, on_step=on_step)
    return seen


@pytest.mark.parametrize("scheduling", ["async", "sync"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_whole_life_prefill_hold_load_decode_free(pair_factory, backend, scheduling):
    pair = pair_factory(backend, async_scheduling=scheduling == "async")
    assert type(pair.D.scheduler).__name__ == ("AsyncScheduler" if scheduling == "async" else "Scheduler")
    P, D = pair.P, pair.D
    prompt = prompt_of(1, 45)  # 3 blocks, the last one partial
    params = pair.prefill("p-1", prompt)
    assert params["remote_engine_id"] == P.connector.scheduler_side.place.engine_id
    assert params["remote_request_id"] == "p-1"
    assert len(params["remote_block_ids"]) == 3
    held = P.num_free_blocks()
    assert held == NUM_BLOCKS - 1 - 3, "the producer holds the prompt's blocks for the decode engine"

    seen = decode(pair, "d-1", prompt, params)

    assert seen.get("recv_step"), "the consumer never reported the load"
    assert not seen["invalid"]
    assert seen["bytes_equal"], "the consumer's blocks differ from the producer's"
    assert seen["pattern"] == ""
    assert seen["tokens"] == [7, 7, 7] and seen["finish"] == 1  # FinishReason.LENGTH
    # the decode engine computed only the last prompt token and what followed
    assert D.computed["d-1"][0] == (44, 1)
    run_until([P, D], lambda: empty(P) and empty(D))
    # stats: every byte of the three blocks read exactly once, in each of the (odd count of) layers
    nbytes = sum(s.get("bytes", 0) for s in seen["stats"])
    page = 2 * 16 * 2 * BLOCK * 4  # heads x (K|V) x block x float32
    assert nbytes == 3 * page * LAYERS
    assert sum(s.get("transfers", 0) for s in seen["stats"]) == 1


def test_producer_frees_only_after_every_consumer_rank_read(pair_factory):
    pair = pair_factory("tcp", d_tp=2)
    P, D = pair.P, pair.D
    prompt = prompt_of(2, 33)
    params = pair.prefill("p-2", prompt)
    at_free: dict = {}

    def on_step(engine, result):
        if engine is P and "p-2" in result.finished_sending:
            # the lease (30 s) cannot have expired: both decode ranks must have read their heads by now
            at_free["kv"] = D.kv_mismatch("d-2", prompt, len(prompt)) if "d-2" in D.scheduler.requests else "gone"

    D.add(make_request("d-2", prompt, max_tokens=8, kv_transfer_params=params))
    run_until([P, D], lambda: "kv" in at_free, on_step=on_step)
    assert at_free["kv"] == "", f"the producer freed its blocks before every consumer rank read: {at_free['kv']}"
    assert "p-2" not in P.scheduler.requests
    run_until([P, D], lambda: empty(P) and empty(D))


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_mixed_tensor_parallel_sizes(pair_factory, p_tp, d_tp):
    pair = pair_factory("tcp", p_tp=p_tp, d_tp=d_tp)
    prompt = prompt_of(3, 70)
    params = pair.prefill("p-3", prompt)
    assert params["tp_size"] == p_tp
    seen = decode(pair, "d-3", prompt, params)
    assert seen["bytes_equal"] and seen["pattern"] == ""
    assert seen["finish"] == 1
    # the decode ranks together read each byte of the five blocks once, however the heads were split
    page = 2 * 16 * 2 * BLOCK * 4
    assert sum(s.get("bytes", 0) for s in seen["stats"]) == 5 * page * LAYERS
    run_until([pair.P, pair.D], lambda: empty(pair.P) and empty(pair.D))


def test_local_prefix_hit_reads_only_the_uncached_blocks(pair_factory):
    pair = pair_factory("tcp")
    P, D = pair.P, pair.D
    first = prompt_of(4, 40)
    decode(pair, "d-4a", first, pair.prefill("p-4a", first), max_tokens=1)
    run_until([P, D], lambda: "d-4a" not in D.scheduler.requests)
    # the first prompt's two full blocks stay in D's prefix cache: a second prompt sharing them hits locally
    second = first[:32] + prompt_of(5, 20)
    D.add(make_request("probe", second, max_tokens=1, kv_transfer_params=None))
    hit = D.scheduler.kv_cache_manager.get_computed_blocks(D.scheduler.requests["probe"])
    D.abort("probe")
    cached = [b.block_id for b in hit[0].blocks[0]]
    assert len(cached) == 2, "the test needs a two-block local prefix hit"
    D.fill_blocks(cached, SENTINEL)  # what D holds locally; a load must not touch it

    params = pair.prefill("p-4b", second)
    assert len(params["remote_block_ids"]) == 4
    seen = decode(pair, "d-4b", second, params, verify_load=False)
    assert seen.get("recv_step") and not seen["invalid"] and seen["finish"] == 1
    assert seen["blocks"][:2] == cached
    want = pair.snapshots[params["transfer_id"]]
    for got, producer in zip(seen["bytes"], want):
        assert bool((got[:2] == SENTINEL).all()), "a locally cached block was overwritten by the load"
        assert got[2:4].equal(producer[2:4]), "an uncached block differs from the producer's"
    # only the two uncached blocks crossed the wire, and D computed just the last prompt token
    page = 2 * 16 * 2 * BLOCK * 4
    assert sum(s.get("bytes", 0) for s in seen["stats"]) == 2 * page * LAYERS
    assert D.computed["d-4b"][0] == (len(second) - 1, 1)
    run_until([P, D], lambda: empty(P) and empty(D))


def test_abort_while_loading_holds_blocks_until_every_rank_stopped(pair_factory):
    # the admitting step must not wait for the load's news (an idle step may): the abort comes while it loads
    pair = pair_factory("tcp", d_overrides={"idle_wait_ms": 0})
    P, D = pair.P, pair.D
    prompt = prompt_of(6, 50)
    params = pair.prefill("p-6", prompt)
    D.add(make_request("d-6", prompt, max_tokens=4, kv_transfer_params=params))
    before = D.num_free_blocks()
    D.step()  # admitted: blocks allocated, the load goes out to the worker
    req = D.scheduler.requests["d-6"]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    allocated = before - D.num_free_blocks()
    assert allocated == 4
    D.abort("d-6")
    # vLLM keeps the blocks: a read may still be writing into them
    assert "d-6" in D.scheduler.requests and D.num_free_blocks() == before - allocated
    run_until([P, D], lambda: empty(D))
    assert "d-6" not in D.computed, "an aborted request must never run"
    # the producer hears the consumer is done with its blocks (read or given up) and frees them
    run_until([P, D], lambda: empty(P))


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_read_recomputes_under_vllms_recompute_policy(pair_factory, backend):
    pair = pair_factory(backend, policy="recompute")
    P, D = pair.P, pair.D
    prompt = prompt_of(7, 40)
    params = pair.prefill("p-7", prompt)
    # the prefill engine "restarted": its handshake now answers for another engine id
    bad = dict(params, remote_engine_id="restarted-" + params["remote_engine_id"])
    seen = decode(pair, "d-7", prompt, bad, max_tokens=2, verify_load=False)
    assert seen.get("recv_step"), "a failed load must still be reported finished"
    assert seen["invalid"], "the failed load's blocks must be reported invalid"
    assert seen["finish"] == 1 and seen["tokens"] == [7, 7]
    # vLLM recomputed the whole prompt locally
    assert D.computed["d-7"][0][0] == 0
    assert sum(n for _, n in D.computed["d-7"]) >= len(prompt)
    covered = sorted(D.computed["d-7"])
    assert all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:]))
    run_until([P, D], lambda: empty(P) and empty(D))


def test_failed_read_fails_the_request_under_the_fail_policy(pair_factory):
    pair = pair_factory("tcp", policy="fail")
    P, D = pair.P, pair.D
    prompt = prompt_of(8, 20)
    params = pair.prefill("p-8", prompt)
    bad = dict(params, remote_engine_id="gone")
    seen = decode(pair, "d-8", prompt, bad, verify_load=False)
    assert seen["finish"] == 3  # FinishReason.ERROR
    assert seen["tokens"] == []
    assert "d-8" not in D.computed
    run_until([P, D], lambda: empty(P) and empty(D))


def test_producer_lease_expires_when_no_decode_engine_reads(pair_factory):
    pair = pair_factory("tcp", p_overrides={"abort_timeout_s": 0.5})
    P = pair.P
    pair.prefill("p-9", prompt_of(9, 30))
    assert "p-9" in P.scheduler.requests
    run_until([P], lambda: empty(P), steps=400, wait_s=0.01)


def test_aborted_prefill_frees_at_once(pair_factory):
    pair = pair_factory("tcp")
    P = pair.P
    P.add(make_request("p-10", prompt_of(10, 30), max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    P.abort("p-10")
    assert empty(P)


@pytest.mark.parametrize("policy,finish", [("fail", 3), ("recompute", 1)])
def test_load_the_hooks_refuse_is_still_reported_by_every_rank(pair_factory, policy, finish):
    """A load atom-kv ends before any rank starts it (here: the producer lists more blocks than the
    decode engine allocated) must still reach vLLM from every rank, or the request would wait forever."""
    pair = pair_factory("tcp", policy=policy, d_tp=2)
    P, D = pair.P, pair.D
    prompt = prompt_of(11, 40)
    params = pair.prefill("p-11", prompt)
    bad = dict(params, remote_block_ids=params["remote_block_ids"] + [params["remote_block_ids"][-1]])
    seen = decode(pair, "d-11", prompt, bad, max_tokens=2, verify_load=False)
    assert seen.get("recv_step") and seen["invalid"]
    assert seen["finish"] == finish
    run_until([D], lambda: empty(D))


def test_a_transfer_id_minted_by_the_router_names_both_legs(pair_factory):
    """Routers that mint one transfer_id per request (atom-kv's proxy, vLLM's MoRIIO proxy) see it kept."""
    pair = pair_factory("tcp")
    prompt = prompt_of(12, 24)
    params = pair.prefill("p-12", prompt, transfer_id="router-0001", do_remote_prefill=False,
                          remote_engine_id=None, remote_block_ids=None, remote_host=None, remote_port=None)
    assert params["transfer_id"] == "router-0001"
    seen = decode(pair, "d-12", prompt, params)
    assert seen["bytes_equal"] and seen["finish"] == 1
    run_until([pair.P, pair.D], lambda: empty(pair.P) and empty(pair.D))


def test_a_decode_requests_params_are_parsed_once_while_it_waits_for_blocks(pair_factory, monkeypatch):
    """vLLM asks the connector again at every step a remote-prefill request waits for free blocks:
    its kv_transfer_params are parsed at the first ask only, and the load, the transfer id and the
    producer's release all come from that one parse."""
    pair = pair_factory("tcp", d_blocks=8)  # 7 usable blocks
    P, D = pair.P, pair.D
    prompt = prompt_of(13, 40)  # 3 blocks
    params = pair.prefill("p-13", prompt)
    hog = prompt_of(14, 76)  # 5 blocks, then one more while it decodes
    D.add(make_request("hog", hog, max_tokens=100, kv_transfer_params=None))
    run_until([D], lambda: D.scheduler.requests["hog"].num_computed_tokens >= len(hog))

    parsed: list = []
    real_convert = msgspec.convert

    def convert(obj, type_, *args, **kwargs):
        if type_ is KVTransferParams:
            parsed.append(obj)
        return real_convert(obj, type_, *args, **kwargs)

    monkeypatch.setattr(msgspec, "convert", convert)
    hooks = D.connector.scheduler_side.hooks
    asked: list[str] = []
    real_ask = hooks.get_num_new_matched_tokens

    def ask(request_id, *args, **kwargs):
        asked.append(request_id)
        return real_ask(request_id, *args, **kwargs)

    monkeypatch.setattr(hooks, "get_num_new_matched_tokens", ask)
    D.add(make_request("d-13", prompt, max_tokens=3, kv_transfer_params=params))
    for _ in range(3):
        D.step()
    assert asked.count("d-13") >= 2, "vLLM did not ask again while the request waited for blocks"
    assert not D.blocks_of("d-13")
    D.abort("hog")
    seen: dict = {"tokens": []}

    def on_step(engine, result):
        for out in result.outputs:
            if engine is D and out.request_id == "d-13":
                seen["tokens"].extend(out.new_token_ids)
                seen["finish"] = out.finish_reason

    run_until([P, D], lambda: seen.get("finish") is not None, on_step=on_step)
    assert seen["tokens"] == [7, 7, 7]
    assert D.computed["d-13"][0] == (39, 1)  # loaded: only the last prompt token was computed here
    run_until([P, D], lambda: empty(P))  # the producer was told the transfer was read
    assert len(parsed) == 1 and parsed[0] == params


class LogLines(logging.Handler):
    """The atom_kv warnings logged while it is installed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def atom_kv_warnings():
    handler = LogLines()
    logging.getLogger("atom_kv").addHandler(handler)
    yield handler.lines
    logging.getLogger("atom_kv").removeHandler(handler)


def test_vllm_engines_whose_backends_order_kv_differently_refuse_each_other(pair_factory, atom_kv_warnings):
    """CPU_ATTN keeps a block's K rows then its V rows, TRITON_ATTN each token's K then V: the same tensor
    shape with other bytes. The handshake refuses in one line naming both layouts; nothing is read, vLLM
    recomputes, every block comes back."""
    pair = pair_factory("tcp", policy="recompute", p_attention="CPU_ATTN", d_attention="TRITON_ATTN")
    P, D = pair.P, pair.D
    prompt = prompt_of(13, 40)
    params = pair.prefill("p-13", prompt)
    seen = decode(pair, "d-13", prompt, params, max_tokens=2, verify_load=False)
    assert seen.get("recv_step") and seen["invalid"], "the refused load must be reported with its blocks"
    assert seen["finish"] == 1 and D.computed["d-13"][0][0] == 0  # recomputed from the first token
    assert not any(s.get("bytes") for s in seen.get("stats", [])), "nothing may be read across layouts"
    refusals = [line for line in atom_kv_warnings if "KV layout mismatch" in line]
    assert refusals and all("\n" not in line for line in refusals)
    assert any("KV layout mismatch: layout 'vllm-cpu' (prefill) vs 'vllm-hnd' (decode)" in line
               for line in refusals), refusals
    run_until([P, D], lambda: empty(P) and empty(D))


def _other_engine_caches(layout: str, num_blocks: int, model_id: str) -> tuple[list, CompatInfo]:
    """A decode rank of another engine, agreeing with the vLLM prefill engine on everything it can:
    the reference engine's ``hnd`` (separate K and V tensors of the same row width), or ATOM main's
    ``aiter-shuffle`` (AITER-packed K and shuffled V)."""
    if layout == "hnd":
        caches = [tuple(torch.full((num_blocks, 2, BLOCK, 2 * HEAD), -1.0) for _ in "kv") for _ in range(LAYERS)]
        width = 2 * HEAD
    else:
        x = 4  # 16 bytes of float32
        caches = [{"k": torch.full((num_blocks, 2, HEAD // x, BLOCK, x), -1.0),
                   "v": torch.full((num_blocks, 2, BLOCK // x, HEAD, x), -1.0)} for _ in range(LAYERS)]
        width = HEAD
    compat = CompatInfo(model_id=model_id, dtype="float32", num_layers=LAYERS, num_kv_heads=2,
                        head_dim=width, block_size=BLOCK, layout=layout)
    return caches, compat


@pytest.mark.parametrize("layout", ["hnd", "aiter-shuffle"])
def test_a_vllm_engine_and_an_engine_of_another_layout_refuse_each_other(pair_factory, atom_kv_warnings,
                                                                          layout):
    """A vLLM prefill engine and a decode engine of another layout (atom-kv's reference engine, ATOM):
    without the layout in the handshake the ``hnd`` pair would agree on every other field and exchange
    wrong bytes silently. Refused in one line naming both layouts; the decode engine recomputes."""
    pair = pair_factory("tcp")
    P = pair.P
    params = pair.prefill("p-14", prompt_of(14, 40))
    prefill_compat = P.ranks[0].connector.worker_side.hooks.compat
    assert prefill_compat.layout == "vllm-cpu"
    caches, compat = _other_engine_caches(layout, NUM_BLOCKS, prefill_compat.model_id)
    cfg = kv_config("kv_consumer", port_range(1), load_failure_policy="recompute")
    worker = create_worker(cfg, engine_id="other", host="127.0.0.1", tp_rank=0, tp_size=1, compat=compat)
    D = Engine(ConnectorScheduler(cfg, engine_id="other", host="127.0.0.1", tp_size=1, block_size=BLOCK),
               [LocalRank(worker)], NUM_BLOCKS)
    try:
        worker.register_kv_caches(caches)
        blocks = D.admit("d-14", 40, params)
        connector_run_until([D], lambda: "d-14" in D.recompute or "d-14" in D.failed)
        assert "d-14" in D.recompute
        assert all(bool((t == -1.0).all()) for layer in caches
                   for t in (layer.values() if isinstance(layer, dict) else layer)), "bytes crossed layouts"
        refusals = [line for line in atom_kv_warnings if "KV layout mismatch" in line]
        assert refusals and all("\n" not in line for line in refusals)
        assert any(f"layout 'vllm-cpu' (prefill) vs '{layout}' (decode)" in line for line in refusals), refusals
        if layout == "hnd":  # the layout is the only difference
            assert any(line.endswith("KV layout mismatch: layout 'vllm-cpu' (prefill) vs 'hnd' (decode)")
                       for line in refusals), refusals
        assert len(blocks) == 3
    finally:
        worker.close()
        D.sched.close()


def test_an_idle_step_waits_for_the_loads_news_and_reports_it_in_the_same_step(pair_factory):
    """vLLM steps again at once after a step that computed nothing; a rank instead waits (bounded) for its
    transfers' news, which the connector's wake-up brings as soon as the load is done."""
    pair = pair_factory("tcp", d_overrides={"idle_wait_ms": 1000})  # the longest allowed
    P, D = pair.P, pair.D
    prompt = prompt_of(11, 40)
    metas: list = []
    params = pair.prefill("p-11", prompt)
    D.add(make_request("d-11", prompt, max_tokens=2, kv_transfer_params=params))
    admitted = D.step(before_forward=lambda so: metas.append(so.kv_connector_metadata))
    assert admitted.scheduled == {} and metas[-1].idle and metas[-1].hooks.loads
    assert admitted.finished_recving == {"d-11"}  # the step that started the load waited for it
    assert D.kv_mismatch("d-11", prompt, len(prompt)) == ""
    computing = D.step(before_forward=lambda so: metas.append(so.kv_connector_metadata))
    assert computing.scheduled == {"d-11": 1} and not metas[-1].idle  # a step with work never waits
    run_until([P, D], lambda: empty(P) and empty(D))


def test_a_finished_load_wakes_the_rank_that_waits_for_it(pair_factory):
    pair = pair_factory("tcp", d_overrides={"idle_wait_ms": 0})
    P, D = pair.P, pair.D
    prompt = prompt_of(12, 40)
    params = pair.prefill("p-12", prompt)
    D.add(make_request("d-12", prompt, max_tokens=2, kv_transfer_params=params))
    news = D.ranks[0].connector.worker_side._news
    admitted = D.step()
    if "d-12" not in admitted.finished_recving:  # no waiting: (almost always) reported by a later step
        assert news.wait(30), "the connector never woke the rank when the load finished"
        assert D.step().finished_recving == {"d-12"}
    run_until([P, D], lambda: empty(P) and empty(D))


@pytest.mark.parametrize("endpoint,replay,announced", [
    ("tcp://*:5557", "tcp://*:5558", ("tcp://*:5557", "tcp://*:5558")),
    ("tcp://*:5557", None, ("tcp://*:5557", None)),
    ("tcp://127.0.0.1:5557", None, (None, None)),  # vLLM connects to a host address: nobody can follow it
    ("ipc:///tmp/atom-kv-events", None, (None, None)),
    (None, None, (None, None)),  # events off
], ids=["bind-with-replay", "bind", "host", "ipc", "off"])
def test_the_ping_announces_vllms_kv_event_publisher_where_a_proxy_can_follow_it(model_dir, endpoint, replay,
                                                                                  announced, caplog):
    from vllm.config import KVEventsConfig

    from atom_kv.integrations.vllm.settings import announced_kv_events

    vllm_config = make_vllm_config(model_dir, "kv_consumer", extra("tcp", 6301))
    if endpoint is not None:
        vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                      endpoint=endpoint, replay_endpoint=replay)
    with caplog.at_level(logging.WARNING, logger="atom_kv.integrations.vllm.settings"):
        assert announced_kv_events(vllm_config) == announced
    if endpoint == "tcp://127.0.0.1:5557":
        assert "use tcp://*:5557 to have the registration ping announce it" in caplog.text


def test_shutdown_stops_the_scheduler_sides_pinger_and_release_sender(pair_factory):
    """vLLM's Scheduler.shutdown() calls shutdown() on the scheduler-side connector only (0.32: EngineCore ->
    Scheduler -> connector): that must stop the threads the scheduler side owns, not only a worker side's."""
    import threading

    from atom_kv.testing.ports import free_port

    before = set(threading.enumerate())
    # a proxy to ping and an API port nobody serves: the pinger waits on its stop event for vLLM to serve
    pair = pair_factory("tcp", d_overrides={"proxy_ip": "127.0.0.1", "proxy_ping_port": free_port(),
                                            "http_port": free_port()})
    P, D = pair.P, pair.D
    prompt = prompt_of(13, 40)
    params = pair.prefill("p-13", prompt)
    seen = decode(pair, "d-13", prompt, params)  # its read is confirmed: a release goes to the producer
    assert seen["finish"] == 1
    run_until([P, D], lambda: empty(P) and empty(D))

    def ours() -> set[str]:
        return {t.name for t in set(threading.enumerate()) - before
                if t.is_alive() and t.name.startswith(("atom-kv-pinger-", "atom-kv-release"))}

    assert ours() >= {"atom-kv-pinger-D0", "atom-kv-release"}, ours()
    D.scheduler.shutdown()
    P.scheduler.shutdown()
    assert ours() == set(), "still running after shutdown()"
    assert all(rank.connector.worker_side is not None for rank in D.ranks)
    D.scheduler.shutdown()  # a second shutdown is harmless
