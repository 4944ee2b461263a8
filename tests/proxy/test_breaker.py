"""The breaker's rules on its own clock (atom_kv.proxy.fleet.breaker): volume, ratio, window, verdicts."""

from __future__ import annotations

from atom_kv.proxy.fleet.breaker import CircuitBreaker, OutcomeWindow, RequestOutcomes


def test_a_failure_ratio_opens_only_past_the_minimum_volume():
    b = CircuitBreaker(threshold=100, cooldown_s=5.0, min_requests=10, failure_ratio=0.5, window_s=10.0)
    for i in range(5):
        b.record_success(0.1 * i)
    for i in range(4):
        assert not b.record_failure(1.0, request=i)  # 4 of 9: under the volume and the ratio
    assert b.record_failure(1.0, request=4)  # 5 of 10: both reached
    assert b.state(1.0) == "open"


def test_old_outcomes_leave_the_window():
    b = CircuitBreaker(threshold=100, cooldown_s=5.0, min_requests=4, failure_ratio=0.5, window_s=10.0)
    for i in range(3):
        b.record_failure(0.0, request=i)
    assert b.state(0.0) == "closed"
    assert not b.record_failure(20.0, request=3)  # the first three are 20 s old: 1 outcome in the window
    assert b.window.totals(20.0) == (0, 1, 0)


def test_unresolved_suspects_count_only_while_nobody_is_served():
    b = CircuitBreaker(threshold=3, cooldown_s=5.0, min_requests=4, failure_ratio=0.5, window_s=10.0)
    b.record_success(0.0)
    for _ in range(20):  # a stream of poison requests on the only instance, which serves others
        assert not b.record_unresolved(1.0)
    assert b.state(1.0) == "closed" and b.failures == 0
    dead = CircuitBreaker(threshold=3, cooldown_s=5.0, min_requests=4, failure_ratio=0.5, window_s=10.0)
    assert [dead.record_unresolved(1.0) for _ in range(4)] == [False, False, False, True]  # serves nobody


def test_consecutive_instance_failures_of_different_requests_open_it():
    b = CircuitBreaker(threshold=3, cooldown_s=5.0, min_requests=100)
    assert not b.record_failure(0.0, request="a")
    assert not b.record_failure(0.0, request="a")  # the same request again: counted once
    assert not b.record_failure(0.0, request="b")
    assert b.record_failure(0.0, request="c")
    assert b.last_failure == 0.0 and not b.allows(1.0) and b.allows(5.0)  # half-open after the cooldown
    b.on_dispatch(5.0)
    assert not b.allows(5.0)  # one trial at a time
    b.record_unresolved(6.0)  # a trial that told nothing frees the slot
    assert b.allows(6.0)
    b.record_success(7.0)
    assert b.state(7.0) == "closed" and b.window.totals(7.0) == (1, 0, 0)  # closed: a fresh window


def test_window_memory_is_fixed():
    w = OutcomeWindow(10.0, buckets=10)
    for i in range(10_000):
        w.add(i * 0.01, ok=1)
    assert w.totals(99.99) == (1000, 0, 0) and len(w._ok) == 10


def test_a_suspect_is_judged_by_the_other_instances_of_its_role():
    out = RequestOutcomes(1)
    p1, p2, d1 = ("P", "http://a"), ("P", "http://b"), ("D", "http://c")
    out.suspects.append(("P", p1, None))
    assert out.verdict("P", p1) == "unresolved"
    out.served.add(d1)  # another role serving it says nothing about p1
    assert out.verdict("P", p1) == "unresolved"
    out.suspects.append(("P", p2, None))
    assert out.verdict("P", p1) == "request" and out.verdict("P", p2) == "request"
    out.served.add(p2)
    assert out.verdict("P", p1) == "instance"


def test_the_reason_it_opened_is_kept_for_the_log():
    b = CircuitBreaker(threshold=2, cooldown_s=5.0, min_requests=100)
    b.record_failure(0.0, "a")
    b.record_failure(0.0, "b")
    assert b.trip_reason == "2 consecutive instance failures"
    b.on_dispatch(5.0)
    b.record_failure(5.0, "c")
    assert b.trip_reason == "a failed trial request"
    r = CircuitBreaker(threshold=100, cooldown_s=5.0, min_requests=2, failure_ratio=0.5, window_s=10.0)
    r.record_unresolved(0.0)
    r.record_unresolved(0.0)
    assert r.trip_reason == "a failure ratio of at least 0.5 within 10s, serving nobody well"
