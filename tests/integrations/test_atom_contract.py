"""(a) The ATOM adapter under exactly the calls ATOM makes, without ATOM installed.

``fake_atom`` is ATOM main's connector contract written from reading ATOM
(ffdf3bb5d): its factory, types, aggregator, ``Sequence``, ``BlockManager``
and a ``Scheduler`` making the same connector calls in the same order. On it,
both roles at TP 1 and 2 exchange real KV over tcp and cma, every prompt byte
checked on every consumer rank, every block of both engines freed; plus a
failed load under each policy, an abort during a load and a lease expiry.
``test_atom_real.py`` runs the same scenarios against ATOM's own classes.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from types import SimpleNamespace

import msgspec
import pytest

from tests.integrations.atom_env import use_fake_atom

_SKIP = use_fake_atom()
if _SKIP:
    pytest.skip(_SKIP, allow_module_level=True)

import torch  # noqa: E402

from atom.config import KVCacheTensor  # noqa: E402
from atom.kv_transfer.disaggregation import KVConnectorFactory, KVConnectorOutput  # noqa: E402
from atom.model_engine.sequence import Sequence  # noqa: E402
from atom_kv.config import ConfigError  # noqa: E402
from atom_kv.connector.cache_layouts import LayoutMismatch  # noqa: E402
from atom_kv.integrations.atom.scheduler import AtomKVScheduler  # noqa: E402
from atom_kv.integrations.atom.settings import require_completion_contract  # noqa: E402
from atom_kv.integrations.atom.worker import AtomKVWorker  # noqa: E402
from atom_kv.wire import KVTransferParams  # noqa: E402
from tests.integrations import atom_scenarios as sc  # noqa: E402
from tests.integrations.atom_pd import atom_config  # noqa: E402
from tests.integrations.atom_scenario_tests import *  # noqa: E402,F401,F403  (the shared P/D scenarios)


# ----------------------------------------------------------------------
# the contract, call by call
# ----------------------------------------------------------------------
def test_atom_builds_both_sides_by_name():
    assert KVConnectorFactory.canonical_name("atom_kv") == "atom_kv"
    assert KVConnectorFactory.canonical_name(" ATOM-KV ") == "atom_kv"
    cfg = atom_config("kv_producer", tp=1, block_size=16, num_blocks=8, port=1, backend="tcp")
    sched = KVConnectorFactory.create_connector(cfg, role="scheduler")
    try:
        assert isinstance(sched, AtomKVScheduler) and sched.is_producer and sched.is_offload is False
    finally:
        sched.close()


def test_a_bad_config_is_one_line_naming_the_key():
    cfg = atom_config("kv_consumer", tp=1, block_size=16, num_blocks=8, port=1, backend="tcp", handshake_prot=1)
    with pytest.raises(ConfigError, match=r"^kv-transfer-config: unknown key `handshake_prot`; did you mean "
                                          r"`handshake_port`\?$"):
        AtomKVScheduler(cfg, block_manager=object())


def test_an_atom_without_the_failed_load_contract_is_refused():
    @dataclass
    class FirstPDCommitOutput:  # ATOM 0c982ea92's KVConnectorOutput: no failed_recving
        finished_sending: set = field(default_factory=set)
        finished_recving: set = field(default_factory=set)
        expected_finished_count: int = 0

    with pytest.raises(RuntimeError, match="needs ATOM's failed-load contract"):
        require_completion_contract(FirstPDCommitOutput)
    require_completion_contract(KVConnectorOutput)


def test_a_consumer_needs_the_schedulers_block_manager():
    cfg = atom_config("kv_consumer", tp=1, block_size=16, num_blocks=8, port=1, backend="tcp")
    with pytest.raises(RuntimeError, match="needs the BlockManager of the ATOM Scheduler"):
        AtomKVScheduler(cfg)  # not built inside a Scheduler


def test_producer_answers_for_every_finished_request():
    """ATOM defers every finished request of a producer; requests that lend nothing are named at the next poll,
    and the parameters of one that lends its blocks are set only once although ATOM reports it twice."""
    cfg = atom_config("kv_producer", tp=1, block_size=4, num_blocks=8, port=1, backend="tcp")
    sched = AtomKVScheduler(cfg, host="127.0.0.1")
    try:
        plain = Sequence([1, 2, 3], 4)
        lent = Sequence([1, 2, 3, 4, 5], 4, kv_transfer_params={"do_remote_decode": True})
        for seq, blocks in ((plain, [0]), (lent, [1, 2])):
            assert sched.get_num_new_matched_tokens(seq) == (0, False)
            seq.block_table = blocks
            sched.update_state_after_alloc(seq)
            seq.append_token(42)
        for seq in (plain, lent, lent):
            sched.request_finished(seq)
        params = lent.kv_transfer_params_output
        assert params["remote_block_ids"] == [1, 2] and params["first_token_id"] == 42
        assert params["remote_host"] == "127.0.0.1" and params["remote_engine_id"] == sched.engine_id
        assert plain.kv_transfer_params_output is None
        assert sched.should_defer_free(lent) and sched.has_pending_work()
        out = sched.process_completions(KVConnectorOutput())
        assert out.finished_sending == {plain.id}
        out = sched.process_completions(KVConnectorOutput(finished_sending={params["transfer_id"]}))
        assert out.finished_sending == {lent.id} and not sched.has_pending_work()
    finally:
        sched.close()


def test_has_pending_work_is_a_query_and_the_next_poll_holds_the_ranks_notices():
    """ATOM asks has_pending_work() when idle, as often as it likes: asking changes nothing. The notices for the
    ranks (here: a lent transfer's send) leave the hooks at the next poll, and go out with the next batch."""
    cfg = atom_config("kv_producer", tp=1, block_size=4, num_blocks=8, port=1, backend="tcp")
    sched = AtomKVScheduler(cfg, host="127.0.0.1")
    try:
        lent = Sequence([1, 2, 3, 4, 5], 4, kv_transfer_params={"do_remote_decode": True})
        sched.get_num_new_matched_tokens(lent)
        lent.block_table = [1, 2]
        sched.update_state_after_alloc(lent)
        lent.append_token(42)
        sched.request_finished(lent)
        tid = lent.kv_transfer_params_output["transfer_id"]
        assert sched._hooks.has_metadata()
        for _ in range(3):
            assert sched.has_pending_work()  # the lease
        assert sched._hooks.has_metadata(), "has_pending_work() took the ranks' notices out of the hooks"
        sched.process_completions(KVConnectorOutput())
        assert not sched._hooks.has_metadata()
        step = sched.build_connector_meta().step
        assert [s.transfer_id for s in step.sends] == [tid]
        assert sched.build_connector_meta().step.sends == []  # once
    finally:
        sched.close()


def test_each_sequence_has_one_state_from_match_to_free():
    """One record per sequence: a producer's lent request is LENT until its read is reported, a plain one
    FREE_NOW until the next poll names it, and neither is remembered after."""
    from atom_kv.integrations.atom.sequences import SeqState

    cfg = atom_config("kv_producer", tp=1, block_size=4, num_blocks=8, port=1, backend="tcp")
    sched = AtomKVScheduler(cfg, host="127.0.0.1")
    try:
        plain = Sequence([1, 2, 3], 4)
        lent = Sequence([1, 2, 3, 4, 5], 4, kv_transfer_params={"do_remote_decode": True})
        sched.get_num_new_matched_tokens(plain)
        sched.get_num_new_matched_tokens(lent)
        assert sched._seqs.states() == {lent.id: SeqState.MATCHED}
        for seq, blocks in ((plain, [0]), (lent, [1, 2])):
            seq.block_table = blocks
            sched.update_state_after_alloc(seq)
            seq.append_token(42)
        assert sched._seqs.states() == {}
        sched.request_finished(plain)
        sched.request_finished(lent)
        assert sched._seqs.states() == {plain.id: SeqState.FREE_NOW, lent.id: SeqState.LENT}
        assert sched.process_completions(KVConnectorOutput()).finished_sending == {plain.id}
        assert sched._seqs.states() == {lent.id: SeqState.LENT}
        tid = lent.kv_transfer_params_output["transfer_id"]
        assert sched.process_completions(KVConnectorOutput(finished_sending={tid})).finished_sending == {lent.id}
        assert sched._seqs.states() == {}
    finally:
        sched.close()


def test_a_decode_requests_params_are_parsed_once(monkeypatch):
    """ATOM asks the connector at admission and again after its allocation (with its prefix-cache hit):
    the request's kv_transfer_params are parsed at the first ask only, and its load comes from that parse."""
    cfg = atom_config("kv_consumer", tp=1, block_size=4, num_blocks=8, port=1, backend="tcp")
    sched = AtomKVScheduler(cfg, host="127.0.0.1", block_manager=object())
    parsed: list = []
    real_convert = msgspec.convert

    def convert(obj, type_, *args, **kwargs):
        if type_ is KVTransferParams:
            parsed.append(obj)
        return real_convert(obj, type_, *args, **kwargs)

    monkeypatch.setattr(msgspec, "convert", convert)
    try:
        params = {"do_remote_prefill": True, "remote_block_ids": [5, 6, 7], "remote_engine_id": "P",
                  "remote_host": "127.0.0.1", "remote_handshake_port": 7000, "transfer_id": "t-1"}
        seq = Sequence(list(range(12)), 4, kv_transfer_params=params)
        assert sched.get_num_new_matched_tokens(seq) == (12, True)
        seq.block_table, seq.num_cached_tokens = [1, 2, 3], 4  # ATOM found the first block in its cache
        sched.update_state_after_alloc(seq)
        assert sched.should_park_for_load_after_alloc(seq)
        (load,) = sched.build_connector_meta().step.loads
        assert (load.block_ids, load.remote_block_ids, load.transfer_id) == ([2, 3], [6, 7], "t-1")
        assert parsed == [params]
    finally:
        sched.close()


#: kv_transfer_params ATOM hands over as the client sent them; before, those that are not an object raised
#: AttributeError in ATOM's scheduler (issue 38: a bad kv_transfer_params must fail its own request only)
MALFORMED_PARAMS = [[1, 2], "do_remote_prefill", 5, True, 1.5, {"do_remote_prefill": "yes"},
                    {"do_remote_prefill": True, "remote_block_ids": "abc"},
                    {"do_remote_prefill": True, "remote_block_ids": [-1, 2**70], "remote_host": "127.0.0.1",
                     "remote_handshake_port": 7000, "transfer_id": "t", "remote_engine_id": "P"},
                    {"do_remote_decode": [1]}, {"do_remote_decode": True, "remote_tp_size": "x"}]


def _good_decode_params(tid):
    return {"do_remote_prefill": True, "remote_block_ids": [5, 6, 7], "remote_engine_id": "P",
            "remote_host": "127.0.0.1", "remote_handshake_port": 7000, "transfer_id": tid}


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_malformed_kv_transfer_params_cost_only_their_request_its_transfer(role):
    cfg = atom_config(role, tp=1, block_size=4, num_blocks=8, port=1, backend="tcp")
    sched = AtomKVScheduler(cfg, host="127.0.0.1", block_manager=object())
    try:
        for params in MALFORMED_PARAMS:
            seq = Sequence(list(range(12)), 4, kv_transfer_params=params)
            assert sched.get_num_new_matched_tokens(seq) == (0, False), params
            seq.block_table = [1, 2, 3]
            sched.update_state_after_alloc(seq)
            assert not sched.should_park_for_load_after_alloc(seq)
            sched.build_connector_meta()
            seq.append_token(42)
            sched.request_finished(seq)
            assert seq.kv_transfer_params_output is None
        good = Sequence(list(range(12)), 4, kv_transfer_params=(
            {"do_remote_decode": True} if role == "kv_producer" else _good_decode_params("t-good")))
        expected = (0, False) if role == "kv_producer" else (12, True)
        assert sched.get_num_new_matched_tokens(good) == expected  # the next request is served as before
    finally:
        sched.close()


def test_a_connector_failure_on_one_request_leaves_atoms_scheduler_running(monkeypatch, caplog):
    """A connector bug reached by one request (here: its hooks raise for that request) costs it its KV
    transfer, prefilled locally, with the producer it names released; other requests load as before."""
    cfg = atom_config("kv_consumer", tp=1, block_size=4, num_blocks=8, port=1, backend="tcp")
    sched = AtomKVScheduler(cfg, host="127.0.0.1", block_manager=object())
    real = sched._hooks.get_num_new_matched_tokens
    ended = []
    real_finished = sched._hooks.request_finished

    def flaky(rid, *args, **kwargs):
        if rid == str(bad.id):
            raise RuntimeError("connector bug")
        return real(rid, *args, **kwargs)

    def finished(rid, *args, **kwargs):
        ended.append((rid, kwargs.get("aborted")))
        return real_finished(rid, *args, **kwargs)

    monkeypatch.setattr(sched._hooks, "get_num_new_matched_tokens", flaky)
    monkeypatch.setattr(sched._hooks, "request_finished", finished)
    try:
        bad = Sequence(list(range(12)), 4, kv_transfer_params=_good_decode_params("t-bad"))
        good = Sequence(list(range(12)), 4, kv_transfer_params=_good_decode_params("t-good"))
        assert sched.get_num_new_matched_tokens(bad) == (0, False)
        assert (str(bad.id), True) in ended  # the connector drops (and releases) what it holds for it
        assert "the KV connector failed on its kv_transfer_params" in caplog.text
        assert sched.get_num_new_matched_tokens(good) == (12, True)
        good.block_table = [1, 2, 3]
        sched.update_state_after_alloc(good)
        assert sched.should_park_for_load_after_alloc(good)
        assert [x.transfer_id for x in sched.build_connector_meta().step.loads] == ["t-good"]
    finally:
        sched.close()


def test_metadata_pickles_for_the_model_runners():
    cfg = atom_config("kv_producer", tp=1, block_size=4, num_blocks=8, port=1, backend="tcp")
    sched = AtomKVScheduler(cfg, host="127.0.0.1")
    try:
        meta = pickle.loads(pickle.dumps(sched.build_connector_meta()))
        assert meta.engine_id == sched.engine_id and meta.step.loads == [] and meta.reqs_to_recv == {}
    finally:
        sched.close()


def _caches(k_shape, v_shape, layers=2):
    return {f"layer_{i}": KVCacheTensor(layer_num=i, k_cache=torch.zeros(k_shape, dtype=torch.bfloat16),
                                        v_cache=None if v_shape is None else torch.zeros(v_shape, dtype=torch.bfloat16))
            for i in range(layers)}


def test_unsupported_caches_are_refused_in_one_line():
    cfg = atom_config("kv_consumer", tp=1, block_size=16, num_blocks=4, port=1, backend="tcp")
    worker = AtomKVWorker(cfg, tp_rank=0, tp_size=1, dp_rank=0, host="127.0.0.1")
    with pytest.raises(LayoutMismatch, match=r"^layer_0: v cache has shape \[4, 2, 2, 8, 8\], expected "
                                             r"\[4, 2, 2, 16, 8\] \[blocks, heads, block/x, head_dim, x\] "
                                             r"for layout aiter-shuffle$"):
        worker.register_kv_caches(_caches((4, 2, 2, 16, 8), (4, 2, 2, 8, 8)), None, num_blocks=4)
    with pytest.raises(LayoutMismatch, match="ATOM's scheduler has 8"):
        worker.register_kv_caches(_caches((4, 2, 2, 16, 8), (4, 2, 2, 16, 8)), None, num_blocks=8)

    class Regions:  # ATOM's KVTransferTensors of a model with per-request state
        slot_regions = [object()]
        swa_block_regions: list = []
        staging_region = None

    with pytest.raises(LayoutMismatch, match="per-request state outside the paged KV blocks"):
        worker.register_kv_caches(_caches((4, 2, 2, 16, 8), (4, 2, 2, 16, 8)), Regions(), num_blocks=4)
    worker.close()


@pytest.mark.parametrize("events", [None, "tcp://*:5557"], ids=["no-events", "events"])
def test_registers_with_the_proxy_once_atoms_http_server_listens(events):
    """... and announces ATOM's KV event publisher when its events are on (a bind address: the proxy connects to
    the engine's host)."""
    import socket

    import msgpack
    import zmq

    from tests.conftest import free_port

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    discovery = router.bind_to_random_port("tcp://127.0.0.1")
    http_port = free_port()
    cfg = atom_config("kv_producer", tp=2, block_size=16, num_blocks=8, port=1, backend="tcp",
                      proxy_ip=f"127.0.0.1:{discovery}", http_port=http_port, ping_interval_s=0.2)
    if events is not None:
        cfg.kv_events_config = _events_on()
        cfg.kv_events_config.endpoint = events
    sched = AtomKVScheduler(cfg, host="127.0.0.1")
    http = socket.socket()
    try:
        assert not router.poll(1000), "registered before ATOM's HTTP server listens"
        http.bind(("127.0.0.1", http_port))
        http.listen()
        assert router.poll(5000), "no registration after ATOM's HTTP server started listening"
        ping = msgpack.unpackb(router.recv_multipart()[-1])
        assert ping["type"] == "register" and ping["role"] == "P" and ping["tp_size"] == 2
        assert ping["request_address"] == f"http://127.0.0.1:{http_port}/v1/completions"
        assert ping["engine_id"] == sched.engine_id
        assert ping.get("kv_events") == events
    finally:
        sched.close()
        http.close()
        router.close(0)
        ctx.term()


def test_registering_again_starts_over_on_the_same_ports():
    from tests.connector.kvutil import port_range

    cfg = atom_config("kv_producer", tp=1, block_size=16, num_blocks=4, port=port_range(1), backend="tcp")
    worker = AtomKVWorker(cfg, tp_rank=0, tp_size=1, dp_rank=0, host="127.0.0.1")
    try:
        for _ in range(2):  # ATOM reallocated its cache: the handshake port is free for the new registration
            worker.register_kv_caches(_caches((4, 2, 2, 16, 8), (4, 2, 2, 16, 8)), None, num_blocks=4)
    finally:
        worker.close()


# ----------------------------------------------------------------------
# the workarounds, behind the check of the ATOM they were verified against
# ----------------------------------------------------------------------
def test_abort_while_queued_with_the_upstream_change():
    """ATOM with docs/atom-upstream.md: its BlockManager passed in, queued aborts reported to the connector."""
    from tests.integrations import atom_scenarios as sc

    sc.aborted_while_queued(rounds=1, upstream=True)


def test_a_scheduler_unlike_atoms_is_refused_in_one_line():
    from atom.model_engine.block_manager import BlockManager
    from atom.model_engine.scheduler import Scheduler

    from atom_kv.integrations.atom.contract import AtomChanged

    cfg = atom_config("kv_consumer", tp=1, block_size=16, num_blocks=8, port=1, backend="tcp")

    class NotAtomsScheduler:
        def __init__(self) -> None:
            self.block_manager = BlockManager(cfg)
            self.waiting: list = []
            self.kv_connector = AtomKVScheduler(cfg)

    class WithoutTakeRejected(Scheduler):  # an ATOM that drains ended requests some other way
        take_rejected = None

    for build, changed in [(NotAtomsScheduler, "ATOM's connector is built by "),
                           (lambda: WithoutTakeRejected(cfg), "ATOM's Scheduler no longer hands requests it ends "
                                                              "while they wait to take_rejected()")]:
        with pytest.raises(AtomChanged) as info:
            build()
        message = str(info.value)
        assert message.startswith("atom_kv: " + changed) and "\n" not in message
        assert "(verified against ATOM main ffdf3bb5d); see docs/atom-upstream.md" in message


def test_the_hook_refuses_a_changed_factory_in_one_line_and_steps_aside_for_module_paths(caplog):
    from atom_kv.integrations.atom import hook

    registered = []

    class RenamedFactory:  # register() no longer takes module and class names
        @classmethod
        def register(cls, name, *, connector_path):
            registered.append(name)

    class ModulePathFactory:  # docs/atom-upstream.md: finds connectors by kv_connector_module_path
        @classmethod
        def register(cls, name, *, worker_module, worker_class, scheduler_module, scheduler_class):
            registered.append(name)

        @classmethod
        def canonical_name(cls, value, *, path="kv_transfer_config", module_path=None):
            return value

    with caplog.at_level("ERROR", logger=hook.__name__):
        hook._hook_registers(RenamedFactory)
        hook._hook_registers(ModulePathFactory)
    assert registered == []
    (record,) = caplog.records
    assert record.getMessage().startswith("atom_kv: ATOM's KVConnectorFactory.register() no longer takes "
                                          "worker_module, worker_class, scheduler_module, scheduler_class")
    assert record.exc_info is None and "\n" not in record.getMessage()
    hook.register(ModulePathFactory)  # what importing atom_kv.integrations.atom.connector does there
    assert registered == ["atom_kv"]


# ----------------------------------------------------------------------
# ATOM's KV cache events on the decode side
# ----------------------------------------------------------------------
def _events_on() -> SimpleNamespace:
    """ATOM's ``KVEventsConfig`` with its events on (the fake publishes nowhere)."""
    return SimpleNamespace(enable=True, publisher="zmq", endpoint="tcp://127.0.0.1:5557", topic="", hwm=0,
                           buffer_steps=10_000)


def test_atom_publishes_each_completed_load_as_remote_blocks_once(caplog):
    """ATOM publishes a load's blocks (BlockStored, medium REMOTE) itself, from the scheduler, once the connector
    names the load in ``finished_recving``: every loaded request with a full prompt block appears exactly once
    (the connector never calls ``record_remote_store`` too), with its full blocks' tokens; a failed load that
    was recomputed appears not at all."""
    with caplog.at_level("WARNING", logger="atom_kv.integrations.atom.scheduler"):
        P, D = sc._engines(1, 2, "tcp", d_kv={"kv_events_config": _events_on(), "load_failure_policy": "recompute",
                                               "handshake_timeout_s": 0.3})
    assert "ATOM's KV cache events are on but its prefix caching is off" in caplog.text
    try:
        prefilled = sc.prefill_on(P, sc.PROMPTS)
        loaded = [D.add(p, 2, sc.decode_params(s)) for p, s in zip(sc.PROMPTS, prefilled)]
        failed = D.add(sc.PROMPTS[2], 2, sc._dead_params(len(sc.PROMPTS[2])))
        sc.run_until([P, D], lambda: all(s.id in D.finished for s in loaded + [failed]) and P.idle() and D.idle())
        assert D.errors == [] and failed.id in D.prefilled and not any(s.id in D.prefilled for s in loaded)
        stored = sorted(D.sched.published, key=lambda e: len(e["token_ids"]))
        assert [e["medium"] for e in stored] == ["REMOTE", "REMOTE"], stored  # 16 and 40 tokens: 1 and 2 blocks
        assert [e["token_ids"] for e in stored] == [sc.PROMPTS[1], sc.PROMPTS[2][:32]]
        assert [len(e["block_hashes"]) for e in stored] == [1, 2] and P.sched.published == []
    finally:
        P.close()
        D.close()
