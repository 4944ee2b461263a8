"""The KV event subscriber against a real publisher on 127.0.0.1 that follows vLLM's protocol
(atom_kv.testing.kv_events): sequence numbers, gaps answered by replay, restarts, replays that fall short or
time out, ATOM's framing without seq, bad and oversize messages counted and survived, DP ranks."""

from __future__ import annotations

import time
from typing import Callable, Iterator

import msgspec
import pytest

from atom_kv.proxy.kv_events import KvEvents, KvEventsConfig
from atom_kv.proxy.kv_events.index import KvIndex
from atom_kv.proxy.kv_events.stats import LAG_BUCKETS_S
from atom_kv.proxy.kv_events.subscriber import FeedSpec, KvEventSubscriber, SubscriberLimits
from atom_kv.proxy.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, encode_seq
from atom_kv.testing.kv_events import KvEventsTestPublisher
from atom_kv.testing.ports import free_port, free_port_range

BS = 16
INST = ("D", "http://engine-1")
TOKENS = [(i * 53 + 7) % 30000 for i in range(16 * BS)]
WAIT = 10.0


def run(first: int, count: int, parent: int | None = None, base: int = 1000) -> BlockStored:
    """Blocks ``first .. first+count-1`` of TOKENS, engine hashes base + block number."""
    return BlockStored(block_hashes=[base + b for b in range(first, first + count)],
                       parent_block_hash=parent, token_ids=TOKENS[first * BS:(first + count) * BS], block_size=BS)


class Rig:
    """A subscriber on its own index, and waits on its progress."""

    def __init__(self, limits: SubscriberLimits) -> None:
        self.index = KvIndex(max_blocks=100_000, max_blocks_per_worker=100_000)
        self.stats = self.index.stats
        self.sub = KvEventSubscriber(self.index, limits, log_interval_s=1.0)

    def follow(self, pub: KvEventsTestPublisher, *, dp_size: int = 1, replay: bool = True) -> None:
        self.sub.follow(FeedSpec(INST, pub.endpoint, pub.replay_endpoint if replay else None, dp_size))
        assert pub.wait_subscribed(dp_size if dp_size == 1 else 1, WAIT)

    def until(self, predicate: Callable[[], bool], what: str) -> None:
        assert self.sub.wait_for(predicate, WAIT), f"timed out waiting for {what}: {self.snapshot()}"

    def held(self, rank: int = 0) -> int:
        return self.index.longest_prefix(TOKENS).get((INST, rank), 0) // BS

    def snapshot(self) -> dict:
        s = self.stats
        return {"batches": s.batches, "gaps": s.gaps, "replays": s.replays, "resets": s.resets,
                "decode_failures": s.decode_failures, "held": self.held()}


@pytest.fixture
def rig() -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(**limits) -> Rig:
        r = Rig(SubscriberLimits(**{"replay_timeout_s": 1.0, "close_timeout_s": 5.0, **limits}))
        made.append(r)
        return r

    yield make
    for r in made:
        r.sub.close()
        assert not r.sub._thread.is_alive()


@pytest.fixture
def publisher() -> Iterator[Callable[..., KvEventsTestPublisher]]:
    made: list[KvEventsTestPublisher] = []

    def make(**kw) -> KvEventsTestPublisher:
        made.append(KvEventsTestPublisher(**kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_batches_in_sequence_build_the_index(rig, publisher):
    pub, r = publisher(), rig()
    r.follow(pub)
    pub.publish([run(0, 2)])
    pub.publish([run(2, 2, parent=1001)], shape="array")
    r.until(lambda: r.held() == 4, "4 blocks")
    pub.publish([BlockRemoved(block_hashes=[1003])])
    r.until(lambda: r.held() == 3, "a removal")
    assert r.stats.gaps == 0 and r.stats.replays["complete"] == 0 and pub.replay_requests == []


def test_a_gap_is_answered_by_replay(rig, publisher):
    pub, r = publisher(), rig()
    r.follow(pub)
    pub.publish([run(0, 2)])
    pub.publish([run(2, 2, parent=1001)], live=False)  # buffered, never sent live: the subscriber misses it
    pub.publish([run(4, 2, parent=1003)])
    r.until(lambda: r.held() == 6 and r.stats.replays["complete"] == 1, "the missed batch, replayed")
    assert pub.replay_requests == [1] and r.stats.gaps == 1
    assert sum(r.stats.resets.values()) == 0


def test_a_live_batch_s_lag_is_measured_from_its_stamp_and_a_replayed_one_s_is_not(rig, publisher):
    pub, r = publisher(), rig()
    r.follow(pub)
    now = time.time()
    pub.publish([run(0, 2)], ts=now - 0.2)  # stamped 200 ms ago: lands in the 0.25 s bucket
    pub.publish([run(2, 2, parent=1001)], live=False, ts=now - 3.0)  # missed, then replayed: old by design
    pub.publish([run(4, 2, parent=1003)], ts=time.time())  # may come back in the replay first (then not counted)
    r.until(lambda: r.held() == 6 and r.stats.replays["complete"] == 1, "the missed batch, replayed")
    pub.publish([run(6, 2, parent=1005)], ts=time.time())
    r.until(lambda: r.held() == 8, "the batch after the replay")
    counts = r.stats.lag_counts
    assert 2 <= sum(counts) <= 3, counts  # the live batches only
    assert counts[LAG_BUCKETS_S.index(0.25)] == 1, counts
    assert sum(counts[LAG_BUCKETS_S.index(0.25) + 1:]) == 0, counts  # the 3 s old replayed batch: not counted
    assert r.stats.lag_quantile(1.0) == 0.25 and r.stats.lag_quantile(0.01) <= 0.1


def test_the_first_seq_after_connect_can_already_be_a_gap(rig, publisher):
    pub, r = publisher(), rig()
    pub.publish([run(0, 2)])  # seq 0: nobody listens yet, as vLLM's first batch often goes out
    r.follow(pub)
    pub.publish([run(2, 2, parent=1001)])
    r.until(lambda: r.held() == 4 and r.stats.replays["complete"] == 1, "seq 0 replayed")
    assert pub.replay_requests == [0]


def test_a_seq_below_the_last_means_a_restart(rig, publisher):
    pub, r = publisher(), rig()
    r.follow(pub)
    for i in range(3):
        pub.publish([run(2 * i, 2, parent=None if i == 0 else 1000 + 2 * i - 1)])
    r.until(lambda: r.held() == 6, "6 blocks")
    pub.restart()
    pub.publish([run(0, 1, base=5000)])  # seq 0 of the new process
    r.until(lambda: r.stats.resets["restart"] == 1 and r.held() == 1, "the restart")
    assert r.index.entries == 1 and pub.replay_requests == []


def test_a_replay_that_does_not_reach_back_clears_the_worker(rig, publisher):
    pub, r = publisher(buffer_steps=2), rig()
    r.follow(pub)
    pub.publish([run(0, 2)])
    r.until(lambda: r.held() == 2, "2 blocks")
    for i in range(1, 4):  # seq 1..3 missed; the buffer keeps only 2 and 3
        pub.publish([run(2 * i, 2, parent=1000 + 2 * i - 1)], live=False)
    pub.publish([run(8, 2, parent=1007)])  # seq 4
    r.until(lambda: r.stats.replays["short"] == 1, "a short replay")
    assert r.stats.resets["replay_short"] == 1 and pub.replay_requests == [1]
    assert r.held() == 0  # cleared: seq 2.. continue a chain whose start was dropped with the rest
    assert r.stats.skipped_runs["unknown_parent"] >= 1


def test_a_replay_that_times_out_clears_the_worker_and_goes_on(rig, publisher):
    pub, r = publisher(replay=False), rig(replay_timeout_s=0.3)
    # a replay endpoint where nothing answers
    r.sub.follow(FeedSpec(INST, pub.endpoint, f"tcp://127.0.0.1:{free_port()}", 1))
    assert pub.wait_subscribed(1, WAIT)
    pub.publish([run(0, 2)])
    r.until(lambda: r.held() == 2, "2 blocks")
    pub.publish([run(2, 2, parent=1001)], live=False)  # seq 1: missed
    pub.publish([run(0, 1, base=7000)])  # seq 2: a gap, and nobody to replay it
    r.until(lambda: r.stats.replays["timeout"] == 1, "the replay's timeout")
    assert r.stats.resets["replay_timeout"] == 1
    r.until(lambda: r.held() == 1, "seq 2 applied once the replay gave up")
    pub.publish([run(1, 1, parent=7000, base=7000)])  # seq 3, in sequence again
    r.until(lambda: r.held() == 2, "in sequence after the timeout")


def test_without_a_replay_endpoint_a_gap_clears_the_worker(rig, publisher):
    pub, r = publisher(), rig()
    r.follow(pub, replay=False)
    pub.publish([run(0, 2)])
    r.until(lambda: r.held() == 2, "2 blocks")
    pub.publish([run(2, 2, parent=1001)], live=False)
    pub.publish([run(0, 1, base=9000)])
    r.until(lambda: r.stats.resets["no_replay"] == 1 and r.held() == 1, "the clear")
    assert r.stats.replays["unavailable"] == 1 and r.stats.gaps == 1


def test_atom_framing_without_seq_and_a_reset_by_health(rig, publisher):
    pub, r = publisher(seq=False, topic=b"kv"), rig()
    r.follow(pub)
    payload = msgspec.msgpack.encode([0.0, [["BlockStored", [1, 2], None, TOKENS[:2 * BS], BS]]])  # trailing
    pub.publish_payload(payload)  # defaults omitted, as ATOM sends them
    r.until(lambda: r.held() == 2, "ATOM's batch")
    r.sub.reset(INST)  # the engine id changed: a restart no seq could show
    r.until(lambda: r.held() == 0, "the reset")
    assert r.stats.resets["health"] == 1
    pub.publish([run(0, 1)])
    pub.publish([AllBlocksCleared(medium="GPU")])
    r.until(lambda: r.stats.events["AllBlocksCleared"] == 1, "the clear")
    assert r.held() == 0 and r.stats.gaps == 0


def test_a_malformed_batch_is_counted_and_survived(rig, publisher):
    pub, r = publisher(), rig()
    r.follow(pub)
    pub.publish_payload(b"\xc1 not msgpack")  # seq 0
    pub.send_frames([b"", b"\x00\x01", b"x"])  # a seq frame of 2 bytes
    pub.send_frames([b"a", b"b", b"c", b"d"])
    pub.publish([run(0, 2)])  # seq 1: in sequence (the bad seq 0 is skipped, not replayed)
    r.until(lambda: r.held() == 2, "the next good batch")
    assert r.stats.decode_failures["msgpack"] == 1 and r.stats.decode_failures["seq"] == 1
    assert r.stats.decode_failures["frames"] == 1 and r.stats.gaps == 0


def test_an_oversize_message_is_refused_by_the_socket(rig, publisher):
    pub, r = publisher(replay=False), rig(max_message_bytes=4096)
    r.follow(pub, replay=False)
    pub.publish([run(0, 1)])
    r.until(lambda: r.held() == 1, "1 block")
    big = BlockStored(block_hashes=list(range(2000, 2600)), parent_block_hash=1000,
                      token_ids=[1] * (600 * BS), block_size=BS)
    pub.publish([big])  # over ZMQ_MAXMSGSIZE: the connection is dropped, the message never delivered
    assert pub.wait_subscribed(2, WAIT)  # the subscriber reconnected
    pub.publish([run(1, 1, parent=1000)])
    r.until(lambda: r.stats.batches >= 2, "the next batch after the reconnect")
    assert r.stats.gaps == 1  # the big one never arrived: its seq is the gap
    assert r.stats.decode_failures["oversize"] == 0  # never reached the decoder



def test_each_dp_rank_publishes_on_port_plus_rank(rig):
    base = free_port_range(2)
    with KvEventsTestPublisher(port=base, replay=False) as rank0, \
            KvEventsTestPublisher(port=base + 1, replay=False) as rank1:
        r = rig()
        r.sub.follow(FeedSpec(INST, f"tcp://127.0.0.1:{base}", None, 2))
        assert rank0.wait_subscribed(1, WAIT) and rank1.wait_subscribed(1, WAIT)
        rank0.publish([run(0, 1)], dp_rank=0)
        rank1.publish([run(0, 3)], dp_rank=1)
        r.until(lambda: r.held(0) == 1 and r.held(1) == 3, "both ranks")
        r.sub.forget(INST)
        r.until(lambda: r.index.entries == 0, "the instance gone")
        assert r.stats.resets["left"] == 2


def test_a_publisher_that_is_not_there_is_reported(rig):
    r = rig()
    r.sub.follow(FeedSpec(INST, f"tcp://127.0.0.1:{free_port()}", None, 1))
    r.until(lambda: r.stats.connect_failures >= 1, "a refused connect")


def test_kv_events_watch_is_idempotent_and_resets_on_a_new_engine_id(publisher):
    pub = publisher()
    kv = KvEvents(KvEventsConfig(replay_timeout_s=1.0))
    try:
        assert kv.subscriber is None  # no thread before an engine has events
        kv.watch(INST, pub.endpoint, pub.replay_endpoint, engine_id="e1")
        assert pub.wait_subscribed(1, WAIT)
        pub.publish([run(0, 2)])
        assert kv.subscriber.wait_for(lambda: kv.index.entries == 2, WAIT)
        kv.watch(INST, pub.endpoint, pub.replay_endpoint, engine_id="e1")  # the next ping: nothing changes
        kv.subscriber.sync()
        assert kv.index.entries == 2 and pub.subscriptions == 1
        kv.watch(INST, pub.endpoint, pub.replay_endpoint, engine_id="e2")  # restarted
        assert kv.subscriber.wait_for(lambda: kv.index.entries == 0, WAIT)
        assert kv.stats.resets["health"] == 1
        kv.forget(INST)
        kv.subscriber.sync()
        assert kv.stats.resets["left"] == 1
    finally:
        kv.close()
    assert kv.subscriber is None


def test_live_batches_that_pile_up_during_a_replay_are_bounded(rig, publisher):
    # the replay request waits for a peer that never comes (and the timeout is far): live batches pile up
    pub, r = publisher(replay=False), rig(replay_timeout_s=60.0, max_pending=3)
    r.sub.follow(FeedSpec(INST, pub.endpoint, f"tcp://127.0.0.1:{free_port()}", 1))
    assert pub.wait_subscribed(1, WAIT)
    pub.publish([run(0, 1)])
    r.until(lambda: r.held() == 1, "1 block")
    pub.publish([run(1, 1, parent=1000)], live=False)  # seq 1 missed: seq 2 starts a replay
    for i in range(2, 7):  # seq 2, 3, 4 wait; seq 5 is one too many
        pub.publish([run(i, 1, parent=1000 + i - 1)])
    r.until(lambda: r.stats.replays["overflow"] == 1 and r.stats.batches >= 6, "the overflow")
    assert r.stats.resets["replay_overflow"] == 1 and r.stats.replays["timeout"] == 0
    assert r.held() == 0  # what waited followed on cold: its parents were cleared with the rest


def test_frames_of_the_test_publisher_are_vllms():
    with KvEventsTestPublisher() as pub:
        import zmq
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        try:
            assert pub.wait_subscribed(1, WAIT)
            pub.publish([run(0, 1)])
            assert sub.poll(int(WAIT * 1000))
            topic, seq, payload = sub.recv_multipart()
            assert (topic, seq) == (b"", encode_seq(0)) and msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"
        finally:
            sub.close(0)
            ctx.term()


def test_a_fleet_of_400_publishers_is_followed_past_zeromqs_default_socket_cap(rig, publisher):
    """Each feed holds three sockets (SUB, its monitor, the replay DEALER): 400 engines are 1,200, past
    libzmq's default of 1,023 sockets per context. The last engine followed must still be."""
    pub, r = publisher(), rig()
    port = free_port()  # nothing listens there: the feeds keep retrying, their sockets stay open
    for k in range(400):
        r.sub.follow(FeedSpec(("P", f"http://engine-{k}"), f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}", 1))
    r.follow(pub)
    pub.publish([run(0, 2)])
    r.until(lambda: r.held() == 2, "the 401st engine's blocks")
