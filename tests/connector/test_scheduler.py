import logging
import time

import pytest

from atom_kv.connector.scheduler import ConnectorScheduler, ConsumerScheduler, ProducerScheduler, load_backstop_s, load_budget_s
from atom_kv.connector.types import KVConnectorOutput as Out
from tests.connector.kvutil import config


def producer(**kw) -> ProducerScheduler:
    s = ConnectorScheduler(config("kv_producer", 7000, abort_timeout_s=1.0, **kw), engine_id="P",
                           host="10.0.0.1", tp_size=2, dp_rank=1, block_size=16)
    assert isinstance(s, ProducerScheduler)  # the factory picks the role's class
    return s


class Consumer(ConsumerScheduler):
    """A consumer scheduler whose releases are recorded in ``sent`` (no sockets)."""

    def __init__(self, **kw) -> None:
        self.sent: list = []
        super().__init__(config("kv_consumer", 7100, **kw), engine_id="D", host="10.0.0.2", tp_size=1,
                         block_size=16, release_sender=lambda spec, reason: self.sent.append((spec, reason)))


def consumer(**kw) -> Consumer:
    return Consumer(**kw)


def params(blocks=(5, 6, 7), tid="P-r1") -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(blocks),
            "remote_engine_id": "P", "remote_host": "10.0.0.1", "remote_port": 7000,
            "remote_handshake_port": 7000, "remote_tp_size": 2, "remote_dp_rank": 1, "tp_size": 2,
            "dp_rank": 1, "transfer_id": tid}


def later(seconds: float) -> float:
    return time.monotonic() + seconds


# --- producer -----------------------------------------------------------------
def test_producer_params_and_lease_freed_once_after_finished_sending():
    s = producer()
    assert s.get_num_new_matched_tokens("r1", 40, {"do_remote_decode": True}) == (0, False)
    delay, p = s.request_finished("r1", [5, 6, 7])
    assert delay
    assert p == params()
    meta = s.build_connector_meta()
    assert [(x.transfer_id, x.block_ids) for x in meta.sends] == [("P-r1", [5, 6, 7])]
    assert s.update_connector_output(Out()).free == []
    ev = s.update_connector_output(Out(finished_sending=["P-r1"]))
    assert ev.free == ["r1"]
    assert s.build_connector_meta().released == ["P-r1"]
    assert s.update_connector_output(Out(finished_sending=["P-r1"]), later(5)).free == []
    assert not s.has_pending()


def test_lease_expires_once_and_logs_request_id(caplog):
    s = producer()
    s.get_num_new_matched_tokens("r1", 40, {"do_remote_decode": True})
    s.request_finished("r1", [1])
    assert s.update_connector_output(Out(), later(0.5)).free == []
    ev = s.update_connector_output(Out(), later(1.5))
    assert ev.free == ["r1"]
    assert "r1" in caplog.text and "expired" in caplog.text
    assert s.update_connector_output(Out(finished_sending=["P-r1"]), later(3)).free == []
    assert s.num_leases() == 0


def test_requests_without_remote_decode_are_not_held():
    s = producer()
    s.get_num_new_matched_tokens("r2", 10, None)
    assert s.request_finished("r2", [1, 2]) == (False, None)


def test_producer_abort_before_finish_frees_immediately():
    s = producer()
    s.get_num_new_matched_tokens("r1", 40, {"do_remote_decode": True})
    assert s.request_finished("r1", [1], aborted=True) == (False, None)
    assert not s.has_pending()


def test_producer_abort_after_finish_keeps_the_lease():
    s = producer()
    s.get_num_new_matched_tokens("r1", 40, {"do_remote_decode": True})
    assert s.request_finished("r1", [1])[0]
    assert s.request_finished("r1", [1], aborted=True) == (True, None)
    assert s.update_connector_output(Out(finished_sending=["P-r1"])).free == ["r1"]


def test_finished_sending_before_request_finished_frees_on_next_update():
    s = producer()
    s.get_num_new_matched_tokens("r1", 40, {"do_remote_decode": True})
    assert s.update_connector_output(Out(finished_sending=["P-r1"])).free == []
    s.request_finished("r1", [1])
    assert s.update_connector_output(Out()).free == ["r1"]
    assert s.update_connector_output(Out(), later(5)).free == []


# --- consumer -----------------------------------------------------------------
def test_consumer_load_spec_and_ready():
    s = consumer()
    assert s.get_num_new_matched_tokens("d1", 40, params()) == (40, True)
    assert s.get_num_new_matched_tokens("d2", 40, None) == (0, False)
    s.update_state_after_alloc("d1", [9, 10, 11, 12], 40)
    meta = s.build_connector_meta()
    (spec,) = meta.loads
    assert spec.block_ids == [9, 10, 11] and spec.remote_block_ids == [5, 6, 7]
    assert (spec.remote_tp_size, spec.remote_dp_rank, spec.remote_handshake_port) == (2, 1, 7000)
    assert s.build_connector_meta().loads == []
    ev = s.update_connector_output(Out(finished_recving=["d1"]))
    assert ev.ready == ["d1"] and not ev.free
    assert s.request_finished("d1", [9, 10, 11, 12]) == (False, None)
    assert not s.has_pending()


def test_partial_block_prompt_loads_its_one_block():
    s = consumer()
    assert s.get_num_new_matched_tokens("d1", 3, params(blocks=[4])) == (3, True)
    s.update_state_after_alloc("d1", [2], 3)
    (spec,) = s.build_connector_meta().loads
    assert spec.block_ids == [2] and spec.remote_block_ids == [4] and spec.num_tokens == 3


def test_bad_params_fall_back_to_local_prefill(caplog):
    s = consumer()
    bad = params()
    del bad["remote_host"]
    assert s.get_num_new_matched_tokens("d1", 40, bad) == (0, False)
    assert "d1" in caplog.text and "remote_host" in caplog.text


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_load_applies_policy_once(policy):
    s = consumer(load_failure_policy=policy)
    s.get_num_new_matched_tokens("d1", 40, params())
    s.update_state_after_alloc("d1", [1, 2, 3], 40)
    s.build_connector_meta()
    ev = s.update_connector_output(Out(failed_recving={"d1": "peer died"}))
    if policy == "fail":
        assert "peer died" in ev.failed["d1"] and ev.recompute == []
    else:
        assert ev.recompute == ["d1"] and ev.failed == {}
    assert s.update_connector_output(Out(failed_recving={"d1": "again"}, finished_recving=["d1"]), later(999)).is_empty()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_load_timeout_applies_policy_and_cancels_workers(policy):
    s = consumer(load_failure_policy=policy)
    s.get_num_new_matched_tokens("d1", 40, params())
    s.update_state_after_alloc("d1", [1, 2, 3], 40)
    s.build_connector_meta()
    budget = load_budget_s(s.config)
    assert s.update_connector_output(Out(), later(budget)).is_empty()
    ev = s.update_connector_output(Out(), later(load_backstop_s(s.config) + 1))
    assert (ev.recompute == ["d1"]) if policy == "recompute" else ("timed out" in ev.failed["d1"])
    assert s.build_connector_meta().cancelled == ["d1"]
    assert s.update_connector_output(Out(finished_recving=["d1"]), later(999)).is_empty()


def test_load_timeout_waits_for_a_failed_read_to_settle():
    """A worker's last read may end at its budget and then take up to one
    transfer_timeout_s to stop writing (a stalled socket); the scheduler must
    not hand the blocks back before that."""
    s = consumer(transfer_timeout_s=10.0)
    s.get_num_new_matched_tokens("d1", 40, params())
    s.update_state_after_alloc("d1", [1, 2, 3], 40)
    s.build_connector_meta()
    # ... and a finished read may then wait handshake_timeout_s for the producer's confirmation
    worker_done_by = load_budget_s(s.config) + s.config.transfer_timeout_s + s.config.handshake_timeout_s
    assert s.update_connector_output(Out(), later(worker_done_by + 1)).is_empty()
    assert "timed out" in s.update_connector_output(Out(), later(worker_done_by + 3)).failed["d1"]


def test_too_few_allocated_blocks_fails_clearly():
    s = consumer()
    s.get_num_new_matched_tokens("d1", 40, params())
    s.update_state_after_alloc("d1", [1], 40)
    assert s.build_connector_meta().loads == []
    assert "allocated 1 blocks" in s.update_connector_output(Out()).failed["d1"]


def test_abort_before_allocation():
    s = consumer()
    s.get_num_new_matched_tokens("d1", 40, params())
    assert s.request_finished("d1", [], aborted=True) == (False, None)
    s.update_state_after_alloc("d1", [1, 2, 3], 40)  # late alloc of a forgotten request: ignored
    assert s.build_connector_meta().loads == [] and not s.has_pending()


def test_abort_after_alloc_before_metadata():
    s = consumer()
    s.get_num_new_matched_tokens("d1", 40, params())
    s.update_state_after_alloc("d1", [1, 2, 3], 40)
    assert s.request_finished("d1", [1, 2, 3], aborted=True) == (False, None)
    meta = s.build_connector_meta()
    assert meta.loads == [] and meta.cancelled == []
    assert s.update_connector_output(Out(), later(999)).is_empty()


@pytest.mark.parametrize("report", ["finished", "failed"])
def test_abort_mid_read_frees_once_after_ranks_report(report):
    s = consumer()
    s.get_num_new_matched_tokens("d1", 40, params())
    s.update_state_after_alloc("d1", [1, 2, 3], 40)
    s.build_connector_meta()
    assert s.request_finished("d1", [1, 2, 3], aborted=True) == (True, None)
    assert s.request_finished("d1", [1, 2, 3], aborted=True) == (True, None)
    assert s.build_connector_meta().cancelled == ["d1"]
    assert s.update_connector_output(Out()).is_empty()
    out = Out(finished_recving=["d1"]) if report == "finished" else Out(failed_recving={"d1": "x"})
    ev = s.update_connector_output(out)
    assert ev.free == ["d1"] and not ev.ready and not ev.failed
    assert s.update_connector_output(out, later(999)).is_empty()


def test_abort_mid_read_frees_after_bounded_timeout_if_ranks_never_report():
    s = consumer()
    s.get_num_new_matched_tokens("d1", 40, params())
    s.update_state_after_alloc("d1", [1, 2, 3], 40)
    s.build_connector_meta()
    s.request_finished("d1", [1, 2, 3], aborted=True)
    ev = s.update_connector_output(Out(), later(load_backstop_s(s.config) + 1))
    assert ev.free == ["d1"] and not ev.failed and not ev.recompute
    assert s.update_connector_output(Out(), later(999)).is_empty()
    assert not s.has_pending() or s.build_connector_meta().cancelled


def test_consumer_ignores_remote_decode_and_producer_ignores_remote_prefill():
    assert consumer().get_num_new_matched_tokens("x", 10, {"do_remote_decode": True}) == (0, False)
    assert producer().get_num_new_matched_tokens("x", 10, params()) == (0, False)


def warning_for(caplog, raw: dict) -> str:
    """The one-line warning a consumer logs for ``raw`` while it prefills locally."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="atom_kv.connector.scheduler"):
        assert consumer().get_num_new_matched_tokens("d1", 40, raw) == (0, False)
    (record,) = [r for r in caplog.records if r.name.startswith("atom_kv.connector.scheduler.")]
    text = record.getMessage()
    assert "\n" not in text and "d1" in text and "prefilling locally" in text
    return text


@pytest.mark.parametrize(
    "change,key",
    [
        ({"remote_handshake_port": 0}, "`remote_handshake_port` must be a TCP port in 1..65535, got 0"),
        ({"remote_tp_size": 0}, "`remote_tp_size` must be an integer in 1..1024, got 0"),
        ({"remote_tp_size": 2_000_000}, "`remote_tp_size` must be an integer in 1..1024, got 2000000"),
        ({"remote_pp_size": 64, "remote_tp_size": 32},
         "`remote_pp_size` times `remote_tp_size` must be at most 1024 (the producer ranks one request may name)"),
        ({"remote_handshake_port": 65535}, "`remote_handshake_port` must leave room for every producer rank it names"),
        ({"remote_dp_size": 5000}, "`remote_dp_size` must be an integer in 1..1024, got 5000"),
        ({"remote_block_ids": []}, "`remote_block_ids` must be a list of 1..1048576 block numbers"),
        ({"remote_block_ids": [1, -2]}, "`remote_block_ids` must be a list of 1..1048576 block numbers"),
        ({"remote_block_ids": [1, 1 << 40]}, "`remote_block_ids` must be a list of 1..1048576 block numbers"),
        ({"remote_host": ""}, "`remote_host` must be a host name or address of 1..255 characters"),
        ({"remote_host": "h" * 256}, "`remote_host` must be a host name or address of 1..255 characters"),
        ({"remote_engine_id": "e" * 257}, "`remote_engine_id` must be 1..256 characters"),
        ({"transfer_id": "t" * 129}, "`transfer_id` must be 1..128 characters"),
        ({"transfer_id": None}, "missing `transfer_id`"),
        ({"remote_port": None, "remote_handshake_port": None}, "missing `remote_handshake_port`"),
    ],
)
def test_each_bad_consumer_key_is_named(caplog, change, key):
    assert key in warning_for(caplog, dict(params(), **change))


def test_unknown_keys_are_tolerated_and_params_are_not_modified():
    s = consumer()
    raw = dict(params(), router_hint="abc", another={"x": 1})
    before = dict(raw)
    assert s.get_num_new_matched_tokens("d1", 40, raw) == (40, True)
    assert raw == before  # nothing slipped into the caller's dict
    s.update_state_after_alloc("d1", [1, 2, 3], 40)
    assert s.build_connector_meta().loads[0].num_tokens == 40


def test_atom_style_params_fall_back_to_the_unprefixed_keys():
    s = consumer()
    raw = {k: v for k, v in params().items() if k not in ("remote_handshake_port", "remote_tp_size", "remote_dp_rank")}
    assert s.get_num_new_matched_tokens("d1", 40, raw) == (40, True)
    s.update_state_after_alloc("d1", [1, 2, 3], 40)
    (spec,) = s.build_connector_meta().loads
    assert (spec.remote_handshake_port, spec.remote_tp_size, spec.remote_dp_rank) == (7000, 2, 1)


# --- local prefix-cache hits (num_computed_tokens) -----------------------------
def test_prefix_hit_loads_only_the_uncached_blocks():
    s = consumer()
    remote = [20, 21, 22, 23]
    assert s.get_num_new_matched_tokens("d1", 60, params(blocks=remote), num_computed_tokens=32) == (28, True)
    assert s.get_num_new_matched_tokens("d1", 60, params(blocks=remote), num_computed_tokens=32) == (28, True)
    s.update_state_after_alloc("d1", [5, 6, 7, 8], 28)  # all the request's blocks
    (spec,) = s.build_connector_meta().loads
    assert spec.block_ids == [7, 8] and spec.remote_block_ids == [22, 23] and spec.num_tokens == 60
    assert s.get_num_new_matched_tokens("d1", 60, params(blocks=remote), num_computed_tokens=32) == (28, True)
    assert s.update_connector_output(Out(finished_recving=["d1"])).ready == ["d1"]


def test_whole_prompt_cached_loads_nothing_and_releases_the_transfer():
    s = consumer()
    assert s.get_num_new_matched_tokens("d1", 40, params(), num_computed_tokens=40) == (0, False)
    s.update_state_after_alloc("d1", [1, 2, 3], 0)
    meta = s.build_connector_meta()
    assert meta.loads == []
    ((spec, reason),) = s.sent
    # a producer never read from: its first rank only (TP rank 0 of DP rank 1)
    assert (spec.transfer_id, spec.targets()) == ("P-r1", [("10.0.0.1", 7002)])
    assert "cached" in reason and not s.has_pending()
    assert s.request_finished("d1", [1, 2, 3]) == (False, None)
    assert len(s.sent) == 1  # once


def test_whole_prompt_cached_without_alloc_call_releases_at_finish():
    s = consumer()
    assert s.get_num_new_matched_tokens("d1", 40, params(), num_computed_tokens=40) == (0, False)
    assert s.request_finished("d1", [1, 2, 3]) == (False, None)
    assert [spec.transfer_id for spec, _ in s.sent] == ["P-r1"]


def test_cached_tokens_beyond_the_remote_blocks_fail_clearly():
    s = consumer()
    assert s.get_num_new_matched_tokens("d1", 60, params(blocks=[5, 6]), num_computed_tokens=32) == (28, True)
    s.update_state_after_alloc("d1", [1, 2, 3, 4], 28)
    assert s.build_connector_meta().loads == []
    assert "all within the 32 tokens cached here" in s.update_connector_output(Out()).failed["d1"]


def test_negative_num_computed_tokens_is_a_caller_bug():
    with pytest.raises(ValueError, match="num_computed_tokens"):
        consumer().get_num_new_matched_tokens("d1", 40, params(), num_computed_tokens=-1)


# --- transfer ids ---------------------------------------------------------------
def test_producer_adopts_a_usable_incoming_transfer_id():
    s = producer()
    assert s.get_num_new_matched_tokens("r1", 40, {"do_remote_decode": True, "transfer_id": "proxy-7f3a"}) == (0, False)
    _, p = s.request_finished("r1", [5, 6, 7])
    assert p["transfer_id"] == "proxy-7f3a"
    assert [x.transfer_id for x in s.build_connector_meta().sends] == ["proxy-7f3a"]
    assert s.update_connector_output(Out(finished_sending=["proxy-7f3a"])).free == ["r1"]


@pytest.mark.parametrize("offered", ["x" * 129, "tab\there", "naïve", "", 42, None])
def test_producer_mints_its_own_for_an_unusable_transfer_id(offered):
    s = producer()
    s.get_num_new_matched_tokens("r1", 40, {"do_remote_decode": True, "transfer_id": offered})
    _, p = s.request_finished("r1", [5])
    assert p["transfer_id"] == "P-r1"


def test_producer_mints_its_own_when_the_transfer_id_is_taken():
    s = producer()
    s.get_num_new_matched_tokens("r1", 40, {"do_remote_decode": True, "transfer_id": "same"})
    s.get_num_new_matched_tokens("r2", 40, {"do_remote_decode": True, "transfer_id": "same"})  # r1 is live
    assert s.request_finished("r2", [9])[1]["transfer_id"] == "P-r2"
    assert s.request_finished("r1", [5])[1]["transfer_id"] == "same"
    s.get_num_new_matched_tokens("r3", 40, {"do_remote_decode": True, "transfer_id": "same"})  # r1's lease holds it
    assert s.request_finished("r3", [6])[1]["transfer_id"] == "P-r3"
    assert s.update_connector_output(Out(finished_sending=["same"])).free == ["r1"]
    s.get_num_new_matched_tokens("r4", 40, {"do_remote_decode": True, "transfer_id": "same"})  # just released
    assert s.request_finished("r4", [7])[1]["transfer_id"] == "P-r4"
    s.get_num_new_matched_tokens("r5", 40, {"do_remote_decode": True, "transfer_id": "fresh"})
    assert s.request_finished("r5", [8])[1]["transfer_id"] == "fresh"


def test_an_aborted_request_frees_its_adopted_transfer_id():
    s = producer()
    s.get_num_new_matched_tokens("r1", 40, {"do_remote_decode": True, "transfer_id": "retry-me"})
    assert s.request_finished("r1", [5], aborted=True) == (False, None)
    s.get_num_new_matched_tokens("r2", 40, {"do_remote_decode": True, "transfer_id": "retry-me"})
    assert s.request_finished("r2", [5])[1]["transfer_id"] == "retry-me"


# --- releases: every end of a remote prefill on the decode side tells the producer -----
def _released(s: Consumer) -> list[tuple[str, str]]:
    return [(spec.transfer_id, reason) for spec, reason in s.sent]


def test_release_when_aborted_before_the_load_started():
    s = consumer()
    s.get_num_new_matched_tokens("d1", 40, params())
    s.update_state_after_alloc("d1", [1, 2, 3], 40)
    assert s.request_finished("d1", [1, 2, 3], aborted=True) == (False, None)
    ((spec, reason),) = s.sent
    assert spec.targets() == [("10.0.0.1", 7002)]  # dp rank 1 of tp 2, never read from: its first rank
    assert "aborted before its load started" in reason and s.build_connector_meta().loads == []


def test_release_when_aborted_while_loading_and_only_once():
    s = consumer()
    s.get_num_new_matched_tokens("d1", 40, params())
    s.update_state_after_alloc("d1", [1, 2, 3], 40)
    s.build_connector_meta()
    assert s.request_finished("d1", [1, 2, 3], aborted=True) == (True, None)
    assert _released(s) == [("P-r1", "the request was aborted while loading")]
    assert s.update_connector_output(Out(failed_recving={"d1": "cancelled"})).free == ["d1"]
    assert len(s.sent) == 1


def test_release_when_matched_but_never_allocated():
    s = consumer()
    assert s.get_num_new_matched_tokens("d1", 40, params()) == (40, True)
    assert s.request_finished("d1", [], aborted=True) == (False, None)
    assert _released(s) == [("P-r1", "the request ended before its blocks were allocated")]


def test_release_when_the_engine_loads_none_of_the_remote_tokens():
    s = consumer()
    assert s.get_num_new_matched_tokens("d1", 40, params()) == (40, True)
    s.update_state_after_alloc("d1", [1, 2, 3], 0)  # vLLM: prompt logprobs, or a partial local hit
    assert _released(s) == [("P-r1", "the decode engine loads none of the remote tokens")]
    assert s.build_connector_meta().loads == [] and not s.has_pending()


@pytest.mark.parametrize("change", [{"remote_block_ids": "abc"}, {"remote_block_ids": None},
                                    {"remote_engine_id": 7}])
def test_release_when_the_params_are_refused(change):
    s = consumer()
    assert s.get_num_new_matched_tokens("d1", 40, {**params(), **change}) == (0, False)
    assert [tid for tid, _ in _released(s)] == ["P-r1"]


def test_release_for_a_request_the_engine_rejected_before_scheduling():
    s = consumer()
    s.request_rejected(params(tid="P-r9"))
    s.request_rejected(params(tid="P-r9"))  # once
    s.request_rejected(None)
    s.request_rejected("garbage")  # type: ignore[arg-type]
    s.request_rejected({**params(tid="P-r8"), "do_remote_prefill": False})
    s.request_rejected({**params(tid="P-r7"), "remote_tp_size": 100_000})  # would be 100k messages: refused
    s.request_rejected({**params(tid="P-r6"), "remote_handshake_port": 65535})  # ports past 65535
    s.request_rejected({**params(tid="P-r5"), "remote_block_ids": "not a list", "remote_dp_size": "x"})
    assert _released(s) == [("P-r9", "the decode engine rejected the request"),
                            ("P-r5", "the decode engine rejected the request")]


def _read(s: Consumer, rid: str, raw: dict) -> None:
    """A load of ``raw`` that every rank read."""
    s.get_num_new_matched_tokens(rid, 40, raw)
    s.update_state_after_alloc(rid, [1, 2, 3], 40)
    s.build_connector_meta()
    assert s.update_connector_output(Out(finished_recving=[rid])).ready == [rid]


def test_releases_reach_every_rank_only_of_a_producer_this_engine_read_from():
    s = consumer()
    s.request_rejected(params(tid="before"))  # the params are a client's word: the first rank only
    _read(s, "d1", params(tid="read"))        # every rank answered its handshake: all of them from now on
    s.request_rejected(params(tid="after"))
    # the same host and port with another layout was never read: its first rank only
    s.request_rejected({**params(tid="other"), "remote_tp_size": 8, "tp_size": 8})
    s.request_rejected({**params(tid="dp0"), "remote_dp_rank": 0, "dp_rank": 0})
    assert [(spec.transfer_id, [p for _, p in spec.targets()]) for spec, _ in s.sent] == [
        ("before", [7002]), ("read", [7002, 7003]), ("after", [7002, 7003]), ("other", [7008]), ("dp0", [7000])]


def test_a_failed_load_of_a_producer_never_read_from_releases_one_port_whatever_the_params_say():
    s = consumer()
    raw = {**params(tid="wide"), "remote_tp_size": 1024, "tp_size": 1024, "remote_dp_rank": 0, "dp_rank": 0}
    s.get_num_new_matched_tokens("d1", 40, raw)
    s.update_state_after_alloc("d1", [1, 2, 3], 40)
    (load,) = s.build_connector_meta().loads
    assert load.remote_tp_size == 1024  # in bounds: the workers may try it (one handshake first)
    s.update_connector_output(Out(failed_recving={"d1": "the layouts do not match"}))
    ((spec, reason),) = s.sent
    assert spec.targets() == [("10.0.0.1", 7000)] and reason.startswith("the load failed")


def test_a_failed_load_whose_producer_answered_a_handshake_releases_every_rank():
    """The ranks report a load whose producer answered a handshake (``reached``): the layout its
    params named is where a producer listens, so its other ranks are released too."""
    s = consumer()
    for rid in ("d1", "d2"):
        s.get_num_new_matched_tokens(rid, 40, params(tid=f"t-{rid}"))
        s.update_state_after_alloc(rid, [1, 2, 3], 40)
    s.build_connector_meta()
    s.update_connector_output(Out(failed_recving={"d1": "read failed"}))  # no rank reached the producer
    s.update_connector_output(Out(failed_recving={"d2": "read failed"}, reached=["d2"]))
    assert [(spec.transfer_id, [p for _, p in spec.targets()]) for spec, _ in s.sent] == [
        ("t-d1", [7002]), ("t-d2", [7002, 7003])]


def test_release_after_every_end_of_a_load():
    s = consumer(load_failure_policy="recompute")
    for rid, tid in (("ok", "t-ok"), ("bad", "t-bad"), ("slow", "t-slow")):
        s.get_num_new_matched_tokens(rid, 40, params(tid=tid))
        s.update_state_after_alloc(rid, [1, 2, 3], 40)
    s.get_num_new_matched_tokens("short", 40, params(tid="t-short"))
    s.update_state_after_alloc("short", [1], 40)  # fewer blocks than the producer sent: fails at once
    s.build_connector_meta()
    ev = s.update_connector_output(Out(finished_recving=["ok"], failed_recving={"bad": "read failed"}))
    assert ev.ready == ["ok"] and sorted(ev.recompute) == ["bad", "short"]
    ev = s.update_connector_output(Out(), later(load_backstop_s(s.config) + 1))
    assert ev.recompute == ["slow"]
    reasons = dict(_released(s))
    assert reasons["t-ok"] == "read"
    assert reasons["t-bad"] == "the load failed: read failed"
    assert reasons["t-short"].startswith("the load failed: allocated 1 blocks")
    assert reasons["t-slow"].startswith("the load failed: timed out")
    assert len(s.sent) == 4
