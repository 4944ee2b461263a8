import time

import pytest

from atom_kv.connector.scheduler import ConnectorScheduler, load_backstop_s, load_budget_s
from atom_kv.engine_hooks.types import KVConnectorOutput as Out
from tests.connector.kvutil import config


def producer(**kw) -> ConnectorScheduler:
    return ConnectorScheduler(config("kv_producer", 7000, abort_timeout_s=1.0, **kw), engine_id="P",
                              host="10.0.0.1", tp_size=2, dp_rank=1, block_size=16)


def consumer(**kw) -> ConnectorScheduler:
    return ConnectorScheduler(config("kv_consumer", 7100, **kw), engine_id="D", host="10.0.0.2",
                              tp_size=1, block_size=16)


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
