"""The vLLM adapter's bookkeeping, without vLLM: each rank names each request to
vLLM exactly once, producer frees only for blocks vLLM holds for us, and loads
atom-kv gives up on are still named by every rank."""

from __future__ import annotations

from atom_kv.engine_hooks import KVConnectorOutput, LoadSpec
from atom_kv.integrations.vllm.ledger import RankLedger, SchedulerLedger


def load(rid: str, blocks: list[int]) -> LoadSpec:
    return LoadSpec(request_id=rid, transfer_id="t-" + rid, block_ids=blocks, remote_block_ids=blocks,
                    num_tokens=16 * len(blocks), remote_engine_id="P", remote_host="127.0.0.1",
                    remote_handshake_port=6301)


def test_producer_frees_only_held_requests_and_each_once():
    ledger = SchedulerLedger()
    ledger.hold("a")
    ledger.release(["a", "never-held"])
    assert ledger.frees_pending()
    ledger.release(["a"])  # a second free of the same request is not passed on
    assert ledger.take_step() == (["a"], {})
    assert ledger.take_step() == ([], {})
    assert not ledger.frees_pending() and ledger.num_held() == 0


def test_consumer_waits_are_given_up_once_and_only_while_waiting():
    ledger = SchedulerLedger()
    ledger.wait_for("x", [3, 4])
    ledger.wait_for("y", [5])
    ledger.reported(["y"])  # every rank reported it: nothing left to give up
    ledger.give_up(["x", "y", "z"])
    assert ledger.take_step() == ([], {"x": [3, 4]})
    ledger.give_up(["x"])
    assert ledger.take_step() == ([], {})
    assert ledger.loaded_before("x") and ledger.loaded_before("y")
    ledger.forget("x")
    assert not ledger.loaded_before("x")


def test_rank_names_finished_and_failed_loads_once_with_failed_blocks_invalid():
    rank = RankLedger()
    rank.step([load("a", [1, 2]), load("b", [7, 8, 9])], [], {})
    assert rank.num_loading() == 2
    rank.finished(KVConnectorOutput(finished_recving=["a"], failed_recving={"b": "read failed"}))
    report = rank.take()
    assert report.finished_recving == {"a", "b"}
    assert report.invalid_block_ids == {7, 8, 9}
    assert report.failed_recving == set()
    rank.finished(KVConnectorOutput(finished_recving=["a"]))  # a duplicate from the hooks
    assert rank.take().finished_recving == set()
    assert rank.num_loading() == 0


def test_rank_reports_frees_the_scheduler_names():
    rank = RankLedger()
    rank.step([], ["p1", "p2"], {})
    assert rank.take().finished_sending == {"p1", "p2"}
    assert rank.take().finished_sending == set()


def test_abandoned_loads_are_named_unless_this_rank_does_or_did_it_itself():
    rank = RankLedger()
    rank.step([load("live", [1])], [], {})
    rank.finished(KVConnectorOutput(finished_recving=["live"]))
    rank.take()
    rank.step([load("running", [2])], [], {})
    rank.step([], [], {"live": [1], "running": [2], "never-started": [5, 6]})
    report = rank.take()
    assert report.finished_recving == {"never-started"}
    assert report.invalid_block_ids == {5, 6}
    # the running load is reported by this rank when it ends, once
    rank.finished(KVConnectorOutput(failed_recving={"running": "cancelled"}))
    assert rank.take().finished_recving == {"running"}


def test_a_failed_load_this_rank_never_started_fails_the_whole_request():
    rank = RankLedger()
    rank.finished(KVConnectorOutput(failed_recving={"ghost": "no such load"}))
    report = rank.take()
    assert report.finished_recving == {"ghost"} and report.failed_recving == {"ghost"}
    assert report.invalid_block_ids == set()


def test_remembered_names_are_bounded():
    rank = RankLedger(max_remembered=2)
    for rid in ("a", "b", "c"):
        rank.step([load(rid, [1])], [], {})
        rank.finished(KVConnectorOutput(finished_recving=[rid]))
    assert rank.take().finished_recving == {"a", "b", "c"}
    assert len(rank._reported) == 2
