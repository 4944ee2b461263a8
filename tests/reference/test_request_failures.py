"""One request's failure stays its own (issue 38, F1): the scheduler and the engine core in-process.

A request that raises in its admission, its sampling, its token handling or
its end gets a 500; its blocks are freed (or held while a peer may still use
them) and the connector drops or releases what it holds for it; every other
request finishes and the engine keeps running. Before this change any such
exception stopped the engine ("engine loop crashed")."""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest

from atom_kv.config import KVTransferConfig
from atom_kv.connector.scheduler import ConnectorScheduler, RoleScheduler
from atom_kv.engine_hooks import KVConnectorOutput
from atom_kv.reference.engine import EngineArgs, EngineCore
from atom_kv.reference.faults import FaultInjector, FaultStage, InjectedFault
from atom_kv.reference.request import Request
from atom_kv.reference.sampling import Sampler
from atom_kv.reference.scheduler import Scheduler

PRODUCER_PARAMS = {"do_remote_decode": True}


def _consumer_params(tid="p-1"):
    return {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_engine_id": "p",
            "remote_host": "127.0.0.1", "remote_handshake_port": 7000, "transfer_id": tid, "remote_tp_size": 1}


class _Hooks:
    """Builds real scheduler hooks with a recording release sender, closed after the test."""

    def __init__(self) -> None:
        self.made: list[RoleScheduler] = []
        self.releases: list[tuple[str, str]] = []

    def __call__(self, role: str) -> RoleScheduler:
        cfg = KVTransferConfig(kv_role=role, abort_timeout_s=5.0)
        hooks = ConnectorScheduler(cfg, engine_id="eng-test", host="127.0.0.1", tp_size=1, block_size=4,
                                   release_sender=lambda spec, reason: self.releases.append((spec.transfer_id, reason)))
        self.made.append(hooks)
        return hooks


@pytest.fixture
def hooks():
    h = _Hooks()
    yield h
    for made in h.made:
        made.close()


def _sched(hooks=None, faults=FaultInjector(), num_blocks=8):
    return Scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=8, max_model_len=1024,
                     max_num_batched_tokens=4096, hooks=hooks, faults=faults)


def _req(rid, prompt=b"abcdef", max_tokens=2, params=None):
    return Request(request_id=rid, prompt_ids=list(prompt), max_tokens=max_tokens, kv_transfer_params=params)


def test_a_prefill_that_fails_while_sampling_frees_its_blocks_and_drops_its_handoff(hooks):
    h = hooks("kv_producer")
    s = _sched(h)
    s.add(_req("p1", max_tokens=1, params=PRODUCER_PARAMS))
    s.add(_req("ok", max_tokens=1, params=PRODUCER_PARAMS))
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["p1", "ok"]
    failed = s.fail(s.running["p1"], "sampling", RuntimeError("boom"))
    assert (failed.finished, failed.error_status) == (True, 500) and "sampling" in failed.error
    (done,) = s.update_from_output({"ok": 66}, 0.0)
    assert done.error is None and done.kv_transfer_params["transfer_id"]
    meta = h.build_connector_meta()
    assert meta.dropped == ["eng-test-p1"]  # a decode engine waiting on its rendezvous is answered at once
    tid = done.kv_transfer_params["transfer_id"]
    assert [x.transfer_id for x in meta.sends] == [tid]
    assert h.num_leases() == 1 and s.blocks.num_free == 8 - 2  # only the good request's prompt is lent
    s.apply_events(h.update_connector_output(KVConnectorOutput(finished_sending=[tid])))
    assert s.blocks.num_free == 8 and s.num_unfinished == 0


def test_a_decode_request_that_fails_on_admission_releases_its_producer_once(hooks):
    h = hooks("kv_consumer")
    s = _sched(h, FaultInjector(((FaultStage.ADMIT, b"bad"),)))
    s.add(_req("d1", prompt=b"bad prompt", params=_consumer_params("p-bad")))
    out = s.schedule()
    assert out.chunks == [] and len(out.failed) == 1
    assert out.failed[0].error_status == 500 and "InjectedFault" in out.failed[0].error
    assert s.blocks.num_free == 8 and s.num_unfinished == 0
    assert [tid for tid, _ in hooks.releases] == ["p-bad"]


def test_a_decode_request_that_fails_after_its_load_frees_its_blocks(hooks):
    h = hooks("kv_consumer")
    s = _sched(h)
    s.add(_req("d1", params=_consumer_params()))
    assert s.schedule().chunks == []
    h.build_connector_meta()
    s.apply_events(h.update_connector_output(KVConnectorOutput(finished_recving=["d1"])))
    (chunk,) = s.schedule().chunks
    s.fail(s.running[chunk.request_id], "sampling", RuntimeError("boom"))
    assert s.blocks.num_free == 8 and s.num_unfinished == 0 and h.num_loads() == 0


class _FailingFinish:
    """Scheduler hooks whose ``request_finished`` raises the first ``failures`` times (a connector fault),
    then answers ``delay`` (whether the blocks are lent)."""

    def __init__(self, failures: int, delay: bool) -> None:
        self.failures = failures
        self.delay = delay
        self.finished: list[tuple[str, bool]] = []

    def get_num_new_matched_tokens(self, *args, **kwargs):
        return 0, False

    def request_finished(self, request_id, block_ids, *, aborted=False, first_token_ids=()):
        self.finished.append((request_id, aborted))
        if self.failures:
            self.failures -= 1
            raise RuntimeError("connector fault")
        return self.delay, None

    def request_rejected(self, params):
        pass


@pytest.mark.parametrize("failures,delay,held", [(1, False, 0), (1, True, 2), (2, False, 2)],
                         ids=["abort-answers-free", "abort-answers-lent", "abort-fails-too"])
def test_a_connector_that_raises_while_a_request_ends_fails_it_and_its_blocks_are_not_reused_while_lent(
        failures, delay, held):
    """Asked again as an abort: the blocks are freed if it lent none, held (until a free event) if it did, and
    held too when it fails again (its state for them is unknown): never handed to another request while a
    peer may read them."""
    hooks = _FailingFinish(failures, delay)
    s = _sched(hooks)
    s.add(_req("a", max_tokens=1))
    s.schedule()
    (out,) = s.update_from_output({"a": 66}, 0.0)
    assert out.finished and out.error_status == 500 and "connector" in out.error
    assert hooks.finished[:2] == [("a", False), ("a", True)]
    assert s.blocks.num_free == 8 - held and sum(map(len, s.held.values())) == held
    assert s.num_unfinished == 0


class _Collector:
    def __init__(self):
        self.q: "queue.Queue" = queue.Queue()

    def __call__(self, out):
        self.q.put(out)

    def finished(self, n, timeout=30):
        done = {}
        while len(done) < n:
            out = self.q.get(timeout=timeout)
            if out.finished:
                done[out.request_id] = out
        return done


class _SamplerFailingOn(Sampler):
    """A fault: sampling raises for one request id (as a bug in its own processing would)."""

    def __init__(self, request_id: str) -> None:
        super().__init__()
        self.request_id = request_id

    def sample(self, request_id, logits, temperature, seed, position=0):
        if request_id == self.request_id:
            raise ValueError("Probabilities contain NaN")  # what a NaN temperature used to raise here
        return super().sample(request_id, logits, temperature, seed, position)


def _engine(collector, **kw):
    engine = EngineCore(EngineArgs(num_layers=2, num_blocks=32, block_size=4, **kw), None, collector)
    engine.start()
    return engine


def test_an_exception_while_sampling_one_request_fails_it_and_not_the_engine():
    c = _Collector()
    e = _engine(c)
    try:
        e._sampler = _SamplerFailingOn("bad")
        e.submit(Request(request_id="good", prompt_ids=[256, 1, 2, 3, 4], max_tokens=8))
        e.submit(Request(request_id="bad", prompt_ids=[256, 5, 6, 7], max_tokens=8))
        done = c.finished(2)
        assert done["good"].error is None and done["good"].num_output_tokens == 8
        assert done["bad"].error_status == 500 and "ValueError" in done["bad"].error
        assert e.fatal is None
        e.submit(Request(request_id="next", prompt_ids=[256, 9, 9], max_tokens=2))  # still serving
        assert c.finished(1)["next"].error is None
        deadline = time.monotonic() + 5
        while e.snapshot()["kv_free"] != 32:
            assert time.monotonic() < deadline, e.snapshot()
            time.sleep(0.05)
        assert e.counters["requests_failed"] == 1
    finally:
        e.close()


def test_injected_faults_fail_their_requests_at_each_stage():
    faults = FaultInjector.parse(["admit=A!", "sample=S!", "decode=D!", "finish=F!"])
    c = _Collector()
    e = _engine(c, faults=faults)
    try:
        for rid in ("A!", "S!", "D!", "F!", "fine"):
            e.submit(Request(request_id=rid, prompt_ids=[256, *rid.encode()], max_tokens=4))
        done = c.finished(5)
        assert done["fine"].error is None
        for rid, stage in (("A!", "admission"), ("S!", "sampling"), ("D!", "sampling"), ("F!", "token handling")):
            assert done[rid].error_status == 500 and f"engine's {stage}" in done[rid].error, done[rid]
        assert e.fatal is None and e.snapshot()["kv_free"] == 32
    finally:
        e.close()


def test_the_fault_flag_is_refused_in_one_line_unless_stage_and_marker():
    for spec in ("sample", "boom=x", "sample=", "=x"):
        with pytest.raises(ValueError, match=r"^--inject-request-fault must be STAGE=MARKER"):
            FaultInjector.parse([spec])
    assert not FaultInjector.parse([])
    req = _req("r", prompt=b"xx MARK yy")
    FaultInjector.parse(["sample=MARK"]).check(FaultStage.FINISH, req)  # another stage: nothing
    with pytest.raises(InjectedFault):
        FaultInjector.parse(["sample=MARK"]).check(FaultStage.SAMPLE, req)


def test_sampling_never_yields_nan_whatever_the_temperature_or_logits():
    """Before: 1e-310 overflowed ``logits / temperature`` to inf, then NaN (issue 38, F1)."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(260) * 30).astype(np.float32)
    odd = logits.copy()
    odd[[40, 50, 60]] = [np.nan, np.inf, -np.inf]
    allowed = {10, *range(32, 127)}
    for values in (logits, odd, np.full(260, np.nan, dtype=np.float32)):
        for t in (5e-324, 1e-310, 1e-300, 1e-3, 1.0, 1e300, float("inf")):
            for seed in (None, 3):
                assert Sampler().sample("r", values, t, seed) in allowed
    greedy = Sampler().sample("r", logits, 0.0, None)
    assert Sampler().sample("r", logits, 1e-310, 7) == greedy  # a vanishing temperature is greedy
    flat = np.zeros(260, dtype=np.float32)
    flat[[40, 50, 60]] = [np.nan, np.inf, -np.inf]  # a model fault: these tokens are never drawn
    drawn = {Sampler().sample("r", flat, 1.0, seed) for seed in range(200)}
    assert drawn <= allowed - {40, 50, 60} and len(drawn) > 50
