"""The scheduler side split by role: the factory picks one class per ``kv_role``, each holds
only its own role's state, deadlines are :class:`TimerKind` members, and
``get_num_new_matched_tokens`` is idempotent (twice changes nothing more than once)."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from atom_kv.connector.scheduler import (
    ConnectorScheduler,
    ConsumerScheduler,
    LoadState,
    ProducerScheduler,
    RoleScheduler,
    SendState,
    TimerKind,
)
from atom_kv.connector.types import KVConnectorOutput as Out
from tests.connector.kvutil import config
from tests.connector.test_scheduler import params


def build(role: str, sent: list) -> RoleScheduler:
    port = 7000 if role == "kv_producer" else 7100
    return ConnectorScheduler(config(role, port, abort_timeout_s=1.0), engine_id="E", host="10.0.0.1", tp_size=2,
                              dp_rank=1, block_size=16, release_sender=lambda spec, reason: sent.append((spec, reason)))


def test_the_factory_picks_one_class_per_role():
    p, c = build("kv_producer", []), build("kv_consumer", [])
    assert type(p) is ProducerScheduler and type(c) is ConsumerScheduler
    assert isinstance(p, RoleScheduler) and isinstance(c, RoleScheduler)


def test_a_role_class_refuses_the_other_roles_config():
    with pytest.raises(ValueError, match="ProducerScheduler serves kv_role 'kv_producer', got 'kv_consumer'"):
        ProducerScheduler(config("kv_consumer", 7100), engine_id="E", host="10.0.0.1", tp_size=1, block_size=16)
    with pytest.raises(ValueError, match="ConsumerScheduler serves kv_role 'kv_consumer', got 'kv_producer'"):
        ConsumerScheduler(config("kv_producer", 7000), engine_id="E", host="10.0.0.1", tp_size=1, block_size=16)


def test_each_role_holds_only_its_own_state():
    p, c = vars(build("kv_producer", [])), vars(build("kv_consumer", []))
    shared = set(p) & set(c)
    # what both share: identity, the notice sender, the releases, a deadline heap
    assert shared == {"config", "engine_id", "host", "tp_size", "dp_rank", "dp_size", "pp_size", "block_size",
                      "_sender", "_releases", "_timers"}
    assert {"_sends", "_early_done", "_recent_tids", "_step", "_announce_sends"} <= set(p) - shared
    assert {"_matched", "_loads", "_to_start", "_to_fail", "_cancelled_out", "_budget"} <= set(c) - shared


def test_timer_kinds_and_states_are_enums():
    p = build("kv_producer", [])
    p.get_num_new_matched_tokens("r1", 40, {"do_remote_decode": True})
    assert p._sends.of_request("r1").state is SendState.ADMITTED
    p.request_finished("r1", [1, 2])
    assert p._sends.of_request("r1").state is SendState.LEASED
    assert [(t.kind, t.key) for t in p._timers.pending()] == [(TimerKind.LEASE, "E-r1")]

    c = build("kv_consumer", [])
    c.get_num_new_matched_tokens("d1", 40, params())
    c.update_state_after_alloc("d1", [1, 2, 3], 40)
    assert c._loads["d1"].state is LoadState.QUEUED
    c.build_connector_meta()
    assert c._loads["d1"].state is LoadState.LOADING
    assert [(t.kind, t.key) for t in c._timers.pending()] == [(TimerKind.LOAD, "d1")]
    c.request_finished("d1", [1, 2, 3], aborted=True)
    assert c._loads["d1"].state is LoadState.CANCELLED


def test_a_producer_transfer_is_one_record_found_by_request_and_by_transfer_id():
    p = build("kv_producer", [])
    p.get_num_new_matched_tokens("r1", 40, {"do_remote_decode": True, "transfer_id": "t-1"})
    assert p._sends.of_request("r1") is p._sends.of_transfer("t-1")
    p.request_finished("r1", [1])
    assert p._sends.of_request("r1") is p._sends.of_transfer("t-1") and p.num_leases() == 1
    assert p.update_connector_output(Out(finished_sending=["t-1"])).free == ["r1"]
    assert p._sends.of_request("r1") is None and p._sends.of_transfer("t-1") is None and p.num_leases() == 0


def _drive(s: RoleScheduler, admit: Callable[[RoleScheduler], Any]) -> list:
    """Everything observable after ``admit``: its answers, then a request's whole life."""
    seen = [admit(s), s.has_metadata(), s.has_pending()]
    s.update_state_after_alloc("x", [1, 2, 3, 4], 40)
    meta = s.build_connector_meta()
    seen += [meta.loads, meta.coming, s.request_finished("x", [1, 2, 3])]
    seen += [s.build_connector_meta(), s.update_connector_output(Out(finished_sending=["E-x", "t-x"],
                                                                      finished_recving=["x"]))]
    return seen + [s.build_connector_meta(), s.has_pending(), s.num_leases(), s.num_loads()]


@pytest.mark.parametrize("role,raw", [
    ("kv_producer", {"do_remote_decode": True}),
    ("kv_producer", {"do_remote_decode": True, "transfer_id": "t-x"}),
    ("kv_consumer", params(tid="t-x")),
    ("kv_consumer", {**params(tid="t-x"), "remote_block_ids": "refused: released"}),
    ("kv_consumer", {**params(tid="t-x"), "remote_host": None}),
])
@pytest.mark.parametrize("computed", [0, 16, 40])
def test_get_num_new_matched_tokens_twice_changes_nothing_more_than_once(role, raw, computed):
    """The hook registers sends (producer) and may send a release (consumer): asked twice about
    a request, an engine sees exactly what it sees when it asks once."""
    once_sent: list = []
    twice_sent: list = []
    once = _drive(build(role, once_sent), lambda s: s.get_num_new_matched_tokens("x", 40, dict(raw), computed))

    def twice(s: RoleScheduler) -> Any:
        first = s.get_num_new_matched_tokens("x", 40, dict(raw), computed)
        assert s.get_num_new_matched_tokens("x", 40, dict(raw), computed) == first
        return first

    assert _drive(build(role, twice_sent), twice) == once
    assert [(spec.transfer_id, spec.targets(), reason) for spec, reason in twice_sent] == \
        [(spec.transfer_id, spec.targets(), reason) for spec, reason in once_sent]


def test_get_num_new_matched_tokens_asked_again_while_loading_answers_the_load():
    c = build("kv_consumer", [])
    assert c.get_num_new_matched_tokens("d1", 40, params()) == (40, True)
    c.update_state_after_alloc("d1", [1, 2, 3], 40)
    meta = c.build_connector_meta()
    assert c.get_num_new_matched_tokens("d1", 40, params(), 16) == (40, True)  # the load's count, not a new match
    assert c.get_num_new_matched_tokens("d1", 40, None) == (40, True)
    assert len(meta.loads) == 1 and c.build_connector_meta().loads == [] and c.num_loads() == 1
