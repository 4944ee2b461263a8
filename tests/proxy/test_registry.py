"""Registry and circuit breaker state machines (explicit clocks, no sleeping)."""

from __future__ import annotations

import logging

import pytest

from atom_kv.proxy.fleet.registry import CircuitBreaker, ProbeFailure, Registration, Registry, RegistryFull
from atom_kv.proxy.fleet.static import parse_engine_spec


def test_breaker_open_half_open_closed():
    b = CircuitBreaker(threshold=2, cooldown_s=10.0)
    assert b.allows(0.0) and not b.record_failure(0.0)
    assert b.record_failure(1.0) and b.state(1.0) == "open" and not b.allows(5.0)
    assert b.state(11.0) == "half_open" and b.allows(11.0)
    b.on_dispatch(11.0)
    assert not b.allows(11.5)  # one trial at a time
    assert b.record_failure(12.0) and b.state(12.0) == "open"  # failed trial re-opens at once
    b.on_dispatch(22.5)
    b.record_success()
    assert b.state(22.6) == "closed" and b.failures == 0


def test_breaker_success_resets_consecutive_count():
    b = CircuitBreaker(threshold=3, cooldown_s=1.0)
    b.record_failure(0.0)
    b.record_failure(0.0)
    b.record_success()
    assert not b.record_failure(0.0) and b.state(0.0) == "closed"


def test_abandoned_trial_frees_the_slot_after_cooldown():
    b = CircuitBreaker(threshold=1, cooldown_s=10.0)
    b.record_failure(0.0)
    b.on_dispatch(10.0)  # the trial's client went away: no outcome ever recorded
    assert not b.allows(15.0)
    assert b.allows(20.0)


def _reg(role: str, port: int, dp: int = 1) -> Registration:
    return Registration(role=role, base_url=f"http://10.0.0.1:{port}", host="10.0.0.1", http_port=port,
                        handshake_port=1, dp_size=dp, tp_size=1)


def test_registry_pending_until_probed_refresh_expiry_and_dp_resize():
    evicted = []
    r = Registry(heartbeat_timeout=5.0, circuit_failures=3, circuit_cooldown_s=1.0, on_evict=evicted.append)
    assert r.upsert(_reg("P", 1), now=0.0) and r.upsert(_reg("D", 2), now=0.0)
    assert r.live("P", now=0.0) == [] and r.counts(now=0.0) == {"prefill": 0, "decode": 0}  # not probed yet
    for inst in r.known("P") + r.known("D"):
        r.mark_up(inst, now=0.0)
    assert not r.upsert(_reg("P", 1, dp=3), now=4.0)  # refresh, not a new instance
    assert len(r.live("P", now=4.0)[0].outstanding_tokens) == 3
    assert r.counts(now=6.0) == {"prefill": 1, "decode": 0}  # D is silent past the timeout
    gone = r.evict_expired(now=6.0)
    assert [i.role for i in gone] == ["D"] and evicted == gone
    assert r.evict_expired(now=6.0) == []


def test_down_is_immediate_and_only_a_probe_brings_it_back():
    r = Registry(heartbeat_timeout=5.0, circuit_failures=3, circuit_cooldown_s=1.0)
    r.upsert(_reg("D", 2), now=0.0)
    (inst,) = r.known("D")
    r.mark_up(inst, now=0.0)
    assert r.mark_down(inst, "connection refused") and not r.mark_down(inst, "again")
    assert r.live("D", now=0.1) == [] and r.snapshot(now=0.1)[0]["state"] == "down"
    r.upsert(_reg("D", 2), now=1.0)  # a ping keeps it registered...
    assert r.live("D", now=1.0) == []  # ...but not routable
    r.mark_up(inst, now=1.0)
    assert r.live("D", now=1.0) == [inst]


def test_capacity_refuses_only_when_every_instance_is_up():
    r = Registry(heartbeat_timeout=5.0, circuit_failures=3, circuit_cooldown_s=1.0, max_instances=2)
    r.upsert(_reg("D", 1), now=0.0)
    r.upsert(_reg("D", 2), now=1.0)
    r.upsert(_reg("D", 3), now=2.0)  # displaces the stalest pending one
    assert [i.http_port for i in r.known("D")] == [2, 3]
    for inst in r.known("D"):
        r.mark_up(inst, now=2.0)
    with pytest.raises(RegistryFull, match="max_instances"):
        r.upsert(_reg("D", 4), now=3.0)
    assert len(r) == 2


def test_static_engines_are_never_dropped_and_go_silent_once():
    evicted = []
    r = Registry(heartbeat_timeout=5.0, circuit_failures=3, circuit_cooldown_s=1.0, max_instances=1,
                 on_evict=evicted.append)
    inst = r.add_static(parse_engine_spec("P", "http://10.0.0.9:8100,6301,tp=2"))
    assert inst.static and inst.handshake_port == 6301 and inst.tp_size == 2 and r.live("P", now=0.0) == []
    r.mark_up(inst, now=10.0)  # a successful probe is its heartbeat
    assert r.live("P", now=14.0) == [inst]
    assert r.evict_expired(now=16.0) == [inst] and evicted == [inst]
    assert r.evict_expired(now=17.0) == []  # reported once
    assert r.known("P") == [inst] and r.live("P", now=17.0) == []
    r.mark_up(inst, now=18.0)
    assert r.live("P", now=18.0) == [inst]
    r.upsert(_reg("D", 5), now=18.0)  # the cap counts discovered instances only
    assert len(r) == 2


def test_engine_spec_parsing():
    e = parse_engine_spec("P", "http://10.0.0.5:8100,6301,tp=4,dp=2,engine_id=p0,notify_port=61005")
    assert (e.base_url, e.host, e.http_port, e.handshake_port, e.tp_size, e.dp_size, e.engine_id, e.notify_port) == (
        "http://10.0.0.5:8100", "10.0.0.5", 8100, 6301, 4, 2, "p0", 61005)
    e = parse_engine_spec("D", "http://h:9000/v1/completions")
    assert (e.base_url, e.handshake_port, e.tp_size, e.dp_size) == ("http://h:9000", None, None, None)  # dp: /health
    assert parse_engine_spec("P", "http://h:1,none").handshake_port is None
    for bad, match in (("10.0.0.5:8100", "http URL"), ("http://h:1,99999", "HANDSHAKE_PORT"),
                       ("http://h:1,1,colour=red", "unknown key"), ("http://h:1,1,tp=0", "tp must be >= 1"),
                       ("http://h:1,1,2", "key=value")):
        with pytest.raises(ValueError, match=match):
            parse_engine_spec("P", bad)


async def test_wait_for_wakes_on_changes():
    import asyncio

    r = Registry(heartbeat_timeout=5.0, circuit_failures=3, circuit_cooldown_s=1.0)
    waiter = asyncio.create_task(r.wait_for(lambda reg: len(reg.known("P")) == 1, 5.0))
    await asyncio.sleep(0)
    assert not waiter.done()
    r.upsert(_reg("P", 1))
    assert await asyncio.wait_for(waiter, 1.0)
    assert not await r.wait_for(lambda reg: len(reg.known("D")) == 1, 0.05)


def test_a_probe_that_times_out_is_the_reason_and_one_warning_per_change(caplog):
    """Pending or down, every failed probe sets ``down_reason``; a timeout is a WARNING once per change of
    how probes fail, never once per probe; a probe that reaches the instance clears it all."""
    caplog.set_level(logging.INFO, logger="atom_kv.proxy.fleet.registry")
    r = Registry(heartbeat_timeout=5.0, circuit_failures=3, circuit_cooldown_s=1.0)
    r.upsert(_reg("D", 2), now=0.0)
    (inst,) = r.known("D")
    caplog.clear()

    def said() -> list[tuple[str, str]]:
        lines = [(rec.levelname, rec.getMessage()) for rec in caplog.records]
        caplog.clear()
        return lines

    for _ in range(3):
        r.not_reached(inst, "health probe: refused", ProbeFailure.REFUSED)
    assert [level for level, _ in said()] == ["INFO"]  # starting, once
    for n in range(3):
        r.not_reached(inst, f"health probe timed out after 2 s ({n})", ProbeFailure.TIMED_OUT)
    (warning,) = said()
    assert warning[0] == "WARNING" and "http://10.0.0.1:2 is not reachable: health probe timed out" in warning[1]
    assert inst.state == "pending" and inst.down_reason == "health probe timed out after 2 s (2)"
    assert r.snapshot(now=0.0)[0]["down_reason"] == "health probe timed out after 2 s (2)"

    r.mark_up(inst, now=1.0)
    assert inst.down_reason == "" and inst.probe_failure is None
    r.mark_down(inst, "health probe: refused", ProbeFailure.REFUSED)
    said()
    r.not_reached(inst, "health probe: refused", ProbeFailure.REFUSED)
    assert said() == []  # down already says it
    for _ in range(3):
        r.not_reached(inst, "health probe timed out after 2 s", ProbeFailure.TIMED_OUT)
    (warning,) = said()
    assert warning[0] == "WARNING" and "is still down: health probe timed out after 2 s" in warning[1]
    assert inst.state == "down" and inst.down_reason == "health probe timed out after 2 s"


def _pinged(url: str = "http://10.0.0.7:8200", **kw) -> Registration:
    return Registration(role="D", base_url=url, host="10.0.0.7", http_port=8200, handshake_port=6301, dp_size=1,
                        tp_size=1, **kw)


async def test_removed_pinged_engine_comes_back_unless_drained():
    from atom_kv.proxy.fleet.registry import UP, Drain, Withdrawn

    r = Registry(heartbeat_timeout=5.0, circuit_failures=3, circuit_cooldown_s=1.0)
    r.upsert(_pinged(), now=100.0)
    inst = r.get("D", "http://10.0.0.7:8200")
    r.mark_up(inst, now=100.0)
    assert r.live("D", now=100.0) == [inst]
    r.remove(inst)  # not drained: its next ping registers it again
    assert r.upsert(_pinged(), now=101.0) is True
    inst = r.get("D", "http://10.0.0.7:8200")
    r.mark_up(inst, now=101.0)
    r.set_drain(inst, Drain.OPERATOR)
    assert r.live("D", now=101.0) == [] and inst.state == UP
    r.upsert(_pinged(), now=102.0)  # a ping does not end an operator's drain
    assert inst.draining and r.live("D", now=102.0) == []
    r.remove(inst)
    with pytest.raises(Withdrawn):
        r.upsert(_pinged(), now=103.0)  # drained and removed: stays out while it pings
    with pytest.raises(Withdrawn):
        r.upsert(_pinged(), now=107.0)
    assert r.get("D", "http://10.0.0.7:8200") is None
    r.evict_expired(now=112.5)  # silent past the heartbeat timeout: a later ping is a new engine
    assert r.upsert(_pinged(), now=113.0) is True


async def test_a_draining_ping_takes_the_engine_out_of_routing_and_a_fresh_one_back():
    r = Registry(heartbeat_timeout=5.0, circuit_failures=3, circuit_cooldown_s=1.0)
    r.upsert(_pinged(), now=100.0)
    inst = r.get("D", "http://10.0.0.7:8200")
    r.mark_up(inst, now=100.0)
    r.upsert(_pinged(draining=True), now=100.5)
    assert inst.draining and r.live("D", now=100.5) == [] and r.counts(now=100.5)["decode"] == 0
    r.upsert(_pinged(), now=101.0)  # restarted: its new process pings without it
    assert not inst.draining and r.live("D", now=101.0) == [inst]
