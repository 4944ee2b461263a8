"""Registry and circuit breaker state machines (explicit clocks, no sleeping)."""

from __future__ import annotations

from atom_kv.proxy.registry import CircuitBreaker, Registration, Registry


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


def test_registry_refresh_expiry_and_dp_resize():
    evicted = []
    r = Registry(heartbeat_timeout=5.0, circuit_failures=3, circuit_cooldown_s=1.0, on_evict=evicted.append)
    assert r.upsert(_reg("P", 1), now=0.0) and r.upsert(_reg("D", 2), now=0.0)
    assert not r.upsert(_reg("P", 1, dp=3), now=4.0)  # refresh, not a new instance
    assert len(r.live("P", now=4.0)[0].outstanding_tokens) == 3
    assert r.counts(now=6.0) == {"prefill": 1, "decode": 0}  # D is silent past the timeout
    gone = r.evict_expired(now=6.0)
    assert [i.role for i in gone] == ["D"] and evicted == gone
    assert r.evict_expired(now=6.0) == []
    assert r.wait_for(lambda reg: reg.counts(now=6.0)["prefill"] == 1, timeout=0.1)
    assert not r.wait_for(lambda reg: reg.counts(now=6.0)["decode"] == 1, timeout=0.1)
