from atom_kv.connector.aggregator import KVOutputAggregator
from atom_kv.connector.types import KVConnectorOutput as Out


def test_emitted_only_when_every_rank_reported():
    agg = KVOutputAggregator(2)
    assert agg.aggregate([Out(finished_recving=["a"], finished_sending=["t"]), None]).is_empty()
    out = agg.aggregate([None, Out(finished_recving=["a"], finished_sending=["t"])])
    assert out.finished_recving == ["a"] and out.finished_sending == ["t"]
    assert agg.pending_count() == 0


def test_duplicate_reports_from_one_rank_count_once():
    agg = KVOutputAggregator(3)
    for _ in range(3):
        assert agg.aggregate([Out(finished_recving=["a"]), None, None]).is_empty()
    assert agg.aggregate([None, Out(finished_recving=["a"]), None]).is_empty()
    assert agg.aggregate([None, None, Out(finished_recving=["a"])]).finished_recving == ["a"]


def test_failure_on_any_rank_wins_once_all_ranks_reported():
    agg = KVOutputAggregator(2)
    assert agg.aggregate([Out(failed_recving={"a": "boom"}), None]).is_empty()
    out = agg.aggregate([None, Out(finished_recving=["a"])])
    assert out.finished_recving == [] and "boom" in out.failed_recving["a"] and "rank 0" in out.failed_recving["a"]


def test_single_rank_failure_reason_is_kept_verbatim():
    agg = KVOutputAggregator(1)
    assert agg.aggregate([Out(failed_recving={"a": "bad layout"})]).failed_recving == {"a": "bad layout"}


def test_late_duplicates_after_emission_are_ignored():
    agg = KVOutputAggregator(1)
    assert agg.aggregate([Out(finished_sending=["t"])]).finished_sending == ["t"]
    assert agg.aggregate([Out(finished_sending=["t"])]).is_empty()
    assert agg.pending_count() == 0


def test_sending_and_receiving_ids_are_separate_namespaces():
    agg = KVOutputAggregator(1)
    out = agg.aggregate([Out(finished_sending=["x"], finished_recving=["x"])])
    assert out.finished_sending == ["x"] and out.finished_recving == ["x"]


def test_emitted_memory_is_bounded():
    agg = KVOutputAggregator(1, max_remembered=4)
    for i in range(10):
        agg.aggregate([Out(finished_recving=[f"r{i}"])])
    assert len(agg._recv.emitted) == 4
    # the newest are still remembered (duplicates ignored), the oldest forgotten
    assert agg.aggregate([Out(finished_recving=["r9"])]).is_empty()
    assert agg.aggregate([Out(finished_recving=["r0"])]).finished_recving == ["r0"]


def test_pending_partial_reports_are_bounded():
    agg = KVOutputAggregator(2, max_pending=3)
    for i in range(5):
        agg.aggregate([Out(finished_recving=[f"r{i}"]), None])
    assert agg.pending_count() == 3
    assert agg.aggregate([None, Out(finished_recving=["r4"])]).finished_recving == ["r4"]
    assert agg.aggregate([None, Out(finished_recving=["r0"])]).is_empty()  # dropped, restarted


def test_too_many_outputs_is_an_error():
    import pytest

    with pytest.raises(ValueError):
        KVOutputAggregator(1).aggregate([Out(), Out()])


def test_the_prefills_first_token_passes_on_from_the_first_rank_that_learned_it():
    agg = KVOutputAggregator(2)
    out = agg.aggregate([Out(first_tokens={"d": [65]}), None])
    assert out.first_tokens == {"d": [65]} and not out.finished_recving  # not held for the other rank
    out = agg.aggregate([Out(finished_recving=["d"]),
                         Out(finished_recving=["d"], first_tokens={"d": [65]})])
    assert out.finished_recving == ["d"] and out.first_tokens == {"d": [65]}  # the scheduler side takes it once


def test_a_handshake_one_rank_completed_is_said_with_the_loads_end():
    agg = KVOutputAggregator(2)
    assert agg.aggregate([Out(failed_recving={"a": "boom"}, reached=["a"]), None]).reached == []  # not ended yet
    out = agg.aggregate([None, Out(failed_recving={"a": "boom too"})])
    assert list(out.failed_recving) == ["a"] and out.reached == ["a"]
    out = agg.aggregate([Out(failed_recving={"b": "no reply"}), Out(failed_recving={"b": "no reply"})])
    assert list(out.failed_recving) == ["b"] and out.reached == []  # no rank got an answer
