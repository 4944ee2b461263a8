"""The producer rank's bookkeeping: one record per transfer whose stage is an Enum, one bounded
table, and refusals whose reason is an Enum member (never read back out of the words)."""

from __future__ import annotations

from atom_kv.connector.producer_transfers import Deferred, Ending, Promise, Stage, TransferTable
from atom_kv.connector.reasons import QueryRefusal, Refusal
from atom_kv.connector.types import ConnectorMetadata, SendSpec
from atom_kv.wire import BlocksQuery, DoneReading, Release, blocks_digest
from tests.conftest import free_port
from tests.connector.inproc import producer_engine


def _done(tid: str, rank: int, tp_size: int = 2, **kw) -> DoneReading:
    return DoneReading(transfer_id=tid, engine_id="D", tp_rank=rank, tp_size=tp_size, **kw)


def _confirm(pw, msg: DoneReading):
    acks = []
    pw._on_done_reading(msg, acks.append)
    return acks


def test_a_transfers_stage_moves_through_the_enum_from_coming_to_released():
    _, pw, _ = producer_engine(free_port(), engine_id="P")
    try:
        pw.start_load_kv(ConnectorMetadata(coming=["t"]))
        assert pw.transfers.stage("t") is Stage.COMING
        pw.start_load_kv(ConnectorMetadata(sends=[SendSpec(transfer_id="t", block_ids=[3, 4])]))
        rec = pw.transfers.get("t")
        assert rec.stage is Stage.LENT and rec.blocks == [3, 4] and rec.learnt is not None
        pw._on_done_reading(_done("t", 0), None)
        assert rec.stage is Stage.LENT and rec.done_ranks == {0}
        pw._on_done_reading(_done("t", 1), None)
        assert rec.stage is Stage.READ and rec.ending is Ending.READ
        assert rec.blocks == [3, 4] and rec.done_ranks == set()  # a late confirmation still finds them
        assert pw.get_finished().finished_sending == ["t"]
        pw.start_load_kv(ConnectorMetadata(released=["t"]))
        assert pw.transfers.get("t") is rec and rec.stage is Stage.RELEASED and rec.blocks is None
        assert rec.why == "every consumer rank had finished reading"
        pw.start_load_kv(ConnectorMetadata(coming=["gone"]))
        pw.start_load_kv(ConnectorMetadata(dropped=["gone"]))
        assert pw.transfers.stage("gone") is Stage.DROPPED
    finally:
        pw.close()


def test_a_refusals_reason_is_the_enum_member_whatever_its_words_say():
    # the engine id holds a word the refusal sorter once looked for: the key must not follow the words
    _, pw, _ = producer_engine(free_port(), engine_id="released-P")
    try:
        pw._defer_s = 0.0
        acks = _confirm(pw, _done("never", 0, want_ack=True, num_blocks=1, blocks_digest=blocks_digest([1])))
        pw._expire_deferred()
        assert [a.valid for a in acks] == [False] and "was not issued by producer released-P" in acks[0].reason
        pw.start_load_kv(ConnectorMetadata(sends=[SendSpec(transfer_id="t", block_ids=[1, 2])]))
        bad = _confirm(pw, _done("t", 0, want_ack=True, num_blocks=1, blocks_digest=blocks_digest([9])))
        assert not bad[0].valid and "digest mismatch" in bad[0].reason
        assert pw._verdict_locked(_done("t", 0, num_blocks=1, blocks_digest=blocks_digest([9]))).refusal is Refusal.BLOCKS
        pw._on_release(Release(transfer_id="t", sender="proxy", reason="the client left"))
        msg = _done("t", 0, want_ack=True, num_blocks=2, blocks_digest=blocks_digest([1, 2]))
        verdict = pw._verdict_locked(msg)
        assert verdict.refusal is Refusal.RELEASED and not verdict.valid
        assert verdict.text == ("producer released transfer t before the read was confirmed "
                                "(released by proxy (the client left))")  # the words on the wire, as before
        assert _confirm(pw, msg)[0].reason == verdict.text
        assert pw._refusals.counts() == {"unissued": 1, "blocks": 1, "released": 1}
    finally:
        pw.close()


def test_a_blocks_query_refusal_is_logged_under_its_enum_member():
    _, pw, _ = producer_engine(free_port(), engine_id="P")
    try:
        answers = []
        pw.start_load_kv(ConnectorMetadata(coming=["t"]))
        pw.start_load_kv(ConnectorMetadata(dropped=["t"]))
        pw.rendezvous.on_query(BlocksQuery(transfer_id="t", engine_id="D", tp_rank=0, tp_size=1), answers.append)
        pw.rendezvous.on_query(BlocksQuery(transfer_id="never", engine_id="D", tp_rank=0, tp_size=1),
                               answers.append)
        assert [a.found for a in answers] == [False, False]
        assert "the prefill request ended without lending blocks" in answers[0].reason
        assert pw.rendezvous.queries._log.counts() == {QueryRefusal.RELEASED.value: 1,
                                                       QueryRefusal.UNISSUED.value: 1}
    finally:
        pw.close()


def test_forgetting_a_transfer_drops_its_one_record_and_answers_what_it_held():
    table = TransferTable(capacity=2)
    with table.lock:
        old = table.record("old")
        old.stage, old.blocks, old.learnt = Stage.LENT, [1], 0.0
        table.pin(old, Promise(until=1e18, consumer="D", held=Release(transfer_id="old", sender="proxy")))
        waiting = Deferred(_done("old", 0), lambda ack: None, 1e18)
        table.defer(old, waiting)
        assert not table.count_done(old, 0, 2)
        table.record("a")
        table.record("b")  # the third record: the oldest goes whole
        assert "old" not in table and table.get("old") is None and len(table) == 2
        assert [r.tid for r in table.pinned()] == [] and [r.tid for r in table.deferring()] == []
        table.expire_counts(older_than=1e18)  # no count of the forgotten record is left to expire
        assert [m.transfer_id for m in table.take_held()] == ["old"]  # its held release is taken
        assert table.take_dropped() == [waiting]  # its waiting confirmation is refused
        assert table.take_held() == [] and table.take_dropped() == []


def test_promises_and_waiting_confirmations_keep_their_own_bounds():
    table = TransferTable(capacity=8, max_parts=1)
    with table.lock:
        first, second = table.record("first"), table.record("second")
        table.pin(first, Promise(until=1e18, consumer="D", held=Release(transfer_id="first", sender="proxy")))
        table.pin(second, Promise(until=1e18, consumer="D"))
        assert first.pin is None and second.pin is not None and "first" in table
        assert [m.transfer_id for m in table.take_held()] == ["first"]
        d1, d2 = Deferred(_done("first", 0), lambda a: None, 0.0), Deferred(_done("second", 0), lambda a: None, 0.0)
        table.defer(first, d1)
        table.defer(second, d2)
        assert first.deferred == [] and second.deferred == [d2] and table.take_dropped() == [d1]
        table.end(second, Stage.RELEASED, Ending.RELEASED, "released by proxy")
        assert second.pin is None and second.blocks is None and second.deferred == [d2]
        assert [r.tid for r in table.pinned()] == []
