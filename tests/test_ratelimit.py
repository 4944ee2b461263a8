"""atom_kv._ratelimit: every event counted, log lines bounded, summaries on an injected clock."""

from __future__ import annotations

import logging

from atom_kv._ratelimit import RateLimitedLog


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_first_event_logged_rest_counted_then_one_summary(caplog):
    clock = _Clock()
    log = RateLimitedLog(logging.getLogger("test.rl"), "refused pings", interval_s=10.0, clock=clock)
    caplog.set_level(logging.WARNING, logger="test.rl")
    assert log.event("auth", "bad mac from a")
    assert not any(log.event("auth", f"bad mac from {i}") for i in range(999))
    assert log.event("limits", "dp_size too big")  # another key has its own budget
    assert [r.getMessage() for r in caplog.records] == ["bad mac from a", "dp_size too big"]
    clock.now = 5.0
    log.flush()  # interval not over: nothing yet
    assert len(caplog.records) == 2
    clock.now = 10.5
    log.flush()
    assert caplog.records[-1].getMessage() == (
        "999 more refused pings (auth) in the last 10.5s; last: bad mac from 998")
    assert log.counts() == {"auth": 1000, "limits": 1}
    clock.now = 11.0
    assert not log.event("auth", "again")  # the summary opened a quiet interval
    clock.now = 30.0
    assert log.event("auth", "later")  # a new interval: its summary first, then the event
    assert [r.getMessage() for r in caplog.records][-2:] == [
        "1 more refused pings (auth) in the last 19.5s; last: again", "later"]


def test_burst_and_bounded_keys(caplog):
    clock = _Clock()
    log = RateLimitedLog(logging.getLogger("test.rl2"), "events", interval_s=1.0, burst=3, max_keys=2, clock=clock)
    caplog.set_level(logging.INFO, logger="test.rl2")
    logged = [log.event("a", f"a{i}") for i in range(5)]
    assert logged == [True, True, True, False, False]
    log.event("b", "b0")
    log.event("c", "c0")  # beyond max_keys: shares the "other" bucket
    log.event("d", "d0")
    assert log.counts() == {"a": 5, "b": 1, "other": 2}
