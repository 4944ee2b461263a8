"""The ATOM connector's sequence table: one state per sequence id, LOCAL records bounded, nothing else evicted.
Needs no ATOM (the table imports none)."""

from __future__ import annotations

import pytest

from atom_kv.integrations.atom.sequences import SeqState, SequenceTable


def test_a_sequence_has_one_state_and_take_checks_it():
    table = SequenceTable()
    seq = object()
    table.put(7, seq, SeqState.MATCHED)
    table.put(7, seq, SeqState.LOADING)  # replaces, never adds a second record
    assert table.states() == {7: SeqState.LOADING} and len(table) == 1
    assert table.take(7, SeqState.MATCHED) is None and table.state(7) is SeqState.LOADING
    assert table.take(7, SeqState.MATCHED, SeqState.LOADING) is seq and table.state(7) is None
    assert table.take(7) is None


def test_local_records_keep_no_sequence_and_only_they_are_forgotten_past_the_bound():
    table = SequenceTable(remembered=2)
    table.put(1, object(), SeqState.LOADING)
    for sid in (2, 3, 4):
        table.put(sid, object(), SeqState.LOCAL)
    assert table.states() == {1: SeqState.LOADING, 3: SeqState.LOCAL, 4: SeqState.LOCAL}
    assert table.each(SeqState.LOCAL) == [(3, None), (4, None)]
    table.put(3, None, SeqState.LOADED)  # leaves LOCAL: the bound counts LOCAL records only
    table.put(5, None, SeqState.LOCAL)
    assert table.count(SeqState.LOCAL) == 2 and table.state(3) is SeqState.LOADED and table.state(1) is not None


@pytest.mark.parametrize("state,pending", [(SeqState.MATCHED, True), (SeqState.LOADING, True),
                                           (SeqState.LOADED, True), (SeqState.DRAINING, True),
                                           (SeqState.FREE_NOW, True), (SeqState.LOCAL, False),
                                           (SeqState.LENT, False)])
def test_pending_states_keep_atom_polling(state, pending):
    table = SequenceTable()
    assert not table.has_pending()
    table.put(1, object(), state)
    assert table.has_pending() is pending


def test_a_bound_below_one_is_refused():
    with pytest.raises(ValueError, match="remembered must be >= 1, got 0"):
        SequenceTable(remembered=0)
