"""Two engine cores in one process, a prefill and a decode, whose loops never poll within the test
(``idle_tick_s`` = ``fast_tick_s`` = 60 s): every P/D exchange finishes only because the engines
step on their own news. The prefill steps at once when it lent a transfer (its ranks learn the
blocks, answer the rendezvous and confirm reads), and the decode's ranks wake its loop when a
load finishes or the rendezvous brings the prefill's first token (in-process for TP 1, over the
ranks' wake pipes for TP 2). A missed wake-up shows as a request stuck for a minute."""

from __future__ import annotations

import queue
import time

import pytest

from atom_kv.config import KVTransferConfig
from atom_kv.reference.engine import EngineArgs, EngineCore
from atom_kv.reference.request import Request, RequestOutput
from atom_kv.testing.ports import free_plan_base

NEVER_S = 60.0  # no poll falls inside a test
WAIT_S = 15.0   # what a request may take here (a lost wake-up costs NEVER_S)


class _Outputs:
    """Collects one engine's outputs per request."""

    def __init__(self) -> None:
        self.q: "queue.Queue[RequestOutput]" = queue.Queue()

    def __call__(self, out: RequestOutput) -> None:
        self.q.put(out)

    def until_finished(self, rid: str) -> tuple[list[list[int]], RequestOutput]:
        """Every output's tokens of ``rid`` (one list per output) and its last output."""
        steps: list[list[int]] = []
        while True:
            try:
                out = self.q.get(timeout=WAIT_S)
            except queue.Empty:
                raise AssertionError(f"request {rid} made no progress in {WAIT_S:g} s (a missed wake-up?)") from None
            assert out.request_id == rid, out
            assert out.error is None, out
            steps.append(out.new_token_ids)
            if out.finished:
                return steps, out


def _core(role: str, tp: int, port: int, outputs: _Outputs) -> EngineCore:
    config = KVTransferConfig.from_dict({"kv_role": role, "backend": "tcp", "handshake_port": port,
                                         "handshake_timeout_s": 5.0, "prefill_wait_timeout_s": 10.0})
    args = EngineArgs(num_layers=2, num_blocks=64, block_size=4, tp=tp, idle_tick_s=NEVER_S, fast_tick_s=NEVER_S)
    core = EngineCore(args, config, outputs, engine_id=f"{role}-tp{tp}")
    core.start()
    return core


@pytest.fixture(scope="module", params=[1, 2], ids=["D-tp1", "D-tp2"])
def pair(request):
    p_out, d_out = _Outputs(), _Outputs()
    p_port, d_port = free_plan_base(1), free_plan_base(request.param)
    prefill = _core("kv_producer", 1, p_port, p_out)
    try:
        decode = _core("kv_consumer", request.param, d_port, d_out)
    except BaseException:
        prefill.close()
        raise
    try:
        yield prefill, p_out, p_port, decode, d_out
    finally:
        decode.close()
        prefill.close()


PROMPT = [256] + [(7 * i + 3) % 96 + 32 for i in range(21)]  # 22 tokens: 6 blocks of 4


def _colocated_tokens(prefill: EngineCore, outputs: _Outputs, rid: str) -> list[int]:
    prefill.submit(Request(request_id=rid, prompt_ids=list(PROMPT), max_tokens=6))
    steps, _ = outputs.until_finished(rid)
    return [t for s in steps for t in s]


def _producer_params(prefill: EngineCore, outputs: _Outputs, rid: str, tid: str) -> dict:
    prefill.submit(Request(request_id=rid, prompt_ids=list(PROMPT), max_tokens=1,
                           kv_transfer_params={"do_remote_decode": True, "transfer_id": tid}))
    _, last = outputs.until_finished(rid)
    assert last.kv_transfer_params is not None and last.kv_transfer_params["transfer_id"] == tid, last
    return last.kv_transfer_params


def _blocks_back(core: EngineCore) -> None:
    deadline = time.monotonic() + WAIT_S
    while core.snapshot()["kv_free"] != 64 or core.snapshot()["kv_held"]:
        assert time.monotonic() < deadline, core.snapshot()
        time.sleep(0.02)


def test_sequential_legs_finish_without_polling(pair):
    prefill, p_out, _, decode, d_out = pair
    want = _colocated_tokens(prefill, p_out, "c1")
    params = _producer_params(prefill, p_out, "p1", "t-seq")
    assert params["first_token_ids"] == want[:1]  # the connector carries the sampled token
    decode.submit(Request(request_id="d1", prompt_ids=list(PROMPT), max_tokens=6, kv_transfer_params=params))
    steps, last = d_out.until_finished("d1")
    assert [t for s in steps for t in s] == want and last.num_output_tokens == 6
    _blocks_back(prefill)
    _blocks_back(decode)


def test_the_rendezvous_brings_the_first_token_before_the_kv_is_read(pair):
    prefill, p_out, p_port, decode, d_out = pair
    want = _colocated_tokens(prefill, p_out, "c2")
    sampled = decode.counters["generation_tokens"]
    # the decode leg first, without blocks: it waits for the prefill, then gets blocks and token at once
    decode.submit(Request(request_id="d2", prompt_ids=list(PROMPT), max_tokens=6, kv_transfer_params={
        "do_remote_prefill": True, "remote_blocks_pending": True, "first_token_pending": True,
        "remote_engine_id": prefill.engine_id, "remote_host": "127.0.0.1", "remote_handshake_port": p_port,
        "remote_tp_size": 1, "transfer_id": "t-rdv"}))
    _producer_params(prefill, p_out, "p2", "t-rdv")
    steps, last = d_out.until_finished("d2")
    assert steps[0] == want[:1]  # the prefill's token, out on its own before any step of the decode's
    assert [t for s in steps for t in s] == want and last.num_output_tokens == 6
    assert decode.counters["generation_tokens"] - sampled == 5  # the other five: none sampled twice
    _blocks_back(prefill)
    _blocks_back(decode)
