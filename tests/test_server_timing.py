"""Server-Timing: what engines report about a request's time, and what the proxy accepts of it."""

import pytest

from atom_kv.server_timing import format_server_timing, parse_server_timing


def test_round_trip_in_seconds():
    text = format_server_timing({"queue": 0.0012, "compute": 0.25, "late": -1.0})
    assert text == "queue;dur=1.200, compute;dur=250.000, late;dur=0.000"
    assert parse_server_timing(text) == pytest.approx({"queue": 0.0012, "compute": 0.25, "late": 0.0})


@pytest.mark.parametrize("value", [
    "", "queue", "queue;desc=x", "queue;dur=abc", "queue;dur=-1", "queue;dur=1e12", "bad name;dur=1",
    "x" * 33 + ";dur=1",
])
def test_malformed_entries_are_skipped(value):
    assert parse_server_timing(value) == {}


def test_bounded_in_entries_and_first_name_wins():
    many = ", ".join(f"s{i};dur=1" for i in range(40))
    assert len(parse_server_timing(many)) == 16
    assert parse_server_timing("a;dur=1, a;dur=2") == {"a": 0.001}
    assert parse_server_timing('a;desc="x";dur="3"') == {"a": 0.003}
