"""The bounded ordered collections behind every "remember the last N ids"."""

from __future__ import annotations

import pytest

from atom_kv._lru import BoundedDict, BoundedSet


def test_dict_evicts_the_oldest_past_capacity_and_reports_it():
    evicted = []
    d = BoundedDict(2, on_evict=lambda k, v: evicted.append((k, v)))
    d["a"], d["b"], d["c"] = 1, 2, 3
    assert list(d) == ["b", "c"] and evicted == [("a", 1)]
    assert "a" not in d and d["b"] == 2 and d.get("a") is None and len(d) == 2


def test_dict_touch_and_reinsert_make_an_entry_newest():
    d = BoundedDict(2)
    d["a"], d["b"] = 1, 2
    d.touch("a")
    d["c"] = 3
    assert list(d) == ["a", "c"]
    d["a"] = 10  # replacing refreshes too
    d["d"] = 4
    assert list(d.items()) == [("a", 10), ("d", 4)]


def test_dict_pop_delete_and_clear():
    evicted = []
    d = BoundedDict(3, on_evict=lambda k, v: evicted.append(k))
    d["a"], d["b"] = 1, 2
    assert d.pop("a") == 1 and d.pop("a", None) is None
    with pytest.raises(KeyError):
        d.pop("a")
    del d["b"]
    d["c"] = 3
    d.clear()
    assert len(d) == 0 and evicted == []  # only overflow evicts


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        BoundedDict(0)
    with pytest.raises(ValueError):
        BoundedSet(-1)


def test_set_forgets_the_oldest_and_discard_says_whether_it_was_there():
    s = BoundedSet(3)
    for x in "abcd":
        s.add(x)
    assert list(s) == ["b", "c", "d"] and "a" not in s and s.capacity == 3
    s.add("b")  # refreshed: now newest
    s.add("e")
    assert list(s) == ["d", "b", "e"]
    assert s.discard("d") and not s.discard("d") and len(s) == 2
    s.clear()
    assert len(s) == 0
