"""The reference engine's KV events on vLLM's wire, read by real ZeroMQ SUB and DEALER sockets on
127.0.0.1 (OS-assigned ports): three frames and seq from 0, BlockStored / BlockRemoved with their
token ids, a gap answered by replay, a malformed replay request counted and survived, a restart
starting at seq 0 again, a full queue dropping and counting without waiting, and the config's
refusals."""

from __future__ import annotations

import queue

import msgspec
import pytest
import zmq

from atom_kv.config import ConfigError, KVTransferConfig
from atom_kv.discovery import build_registration_pinger
from atom_kv.reference.engine import EngineArgs, EngineCore
from atom_kv.reference.kv_events.config import check_kv_events_listeners, parse_kv_events_config
from atom_kv.reference.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored
from atom_kv.reference.kv_events.publisher import KVEventPublisher
from atom_kv.reference.request import Request
from atom_kv.testing.kv_event_reader import KVEventReader
from atom_kv.testing.polling import wait_until
from atom_kv.wire import RegisterPing, decode

BS = 4
_WAIT_MS = 5000


def _config(**extra) -> str:
    return msgspec.json.encode({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
                                "replay_endpoint": "tcp://127.0.0.1:0", **extra}).decode()


class _Collector:
    def __init__(self):
        self.q: "queue.Queue" = queue.Queue()

    def __call__(self, out):
        self.q.put(out)

    def run(self, engine, rid, prompt, max_tokens=3):
        engine.submit(Request(request_id=rid, prompt_ids=prompt, max_tokens=max_tokens))
        tokens = []
        while True:
            out = self.q.get(timeout=30)
            assert out.error is None
            tokens += out.new_token_ids
            if out.finished:
                return tokens


def _engine(collector, text, num_blocks=64):
    e = EngineCore(EngineArgs(num_layers=2, num_blocks=num_blocks, block_size=BS,
                              kv_events=parse_kv_events_config(text)), None, collector)
    e.start()
    return e


def _kind(cls):
    return lambda seen: any(isinstance(x, cls) for x in seen)


def test_block_stored_and_removed_carry_the_tokens_and_the_seq_counts_from_zero():
    c = _Collector()
    e = _engine(c, _config(), num_blocks=8)
    sub = KVEventReader(*e.kv_events_endpoints)
    try:
        a = [256] + list(range(40, 55))  # 16 tokens: 4 blocks
        c.run(e, "a", a, max_tokens=1)
        got = sub.next_batches()
        assert [s for s, _ in got] == [0, 1]  # seq 0 (missed, then replayed) says the cache is empty
        assert got[0][1].events == [AllBlocksCleared()] and got[0][1].data_parallel_rank == 0
        (stored,) = got[1][1].events
        assert stored.token_ids == a and stored.parent_block_hash is None and len(stored.block_hashes) == 4
        assert stored.block_size == BS
        # 8 blocks: a 20-token prompt (6 blocks with max_tokens) evicts 2 of "a"'s, its tail first
        b = [256] + list(range(60, 79))
        c.run(e, "b", b, max_tokens=4)
        events = sub.events_until(lambda seen: _kind(BlockRemoved)(seen) and _kind(BlockStored)(seen))
        removed = [h for x in events if isinstance(x, BlockRemoved) for h in x.block_hashes]
        assert removed == stored.block_hashes[:1:-1]
        assert [x.token_ids for x in events if isinstance(x, BlockStored)] == [b]
        assert sub.last == 2 and sub.restarts == 0
    finally:
        sub.close()
        e.close()


def test_the_wire_is_three_frames_and_a_map_batch_with_typed_map_events():
    c = _Collector()
    e = _engine(c, _config(topic="kv"))
    sub = KVEventReader(*e.kv_events_endpoints)
    try:
        for i in range(20):  # until the SUB has joined
            c.run(e, f"a{i}", [256] + [i + 1] * 7, max_tokens=1)
            frames = sub.raw(500)
            if frames is not None:
                break
        assert frames is not None and len(frames) == 3 and frames[0] == b"kv" and len(frames[1]) == 8
        raw = msgspec.msgpack.decode(frames[2])
        assert set(raw) == {"ts", "events", "data_parallel_rank"}
        (event,) = raw["events"]
        assert event["type"] == "BlockStored" and event["token_ids"] == [256] + [i + 1] * 7
        assert {"block_hashes", "parent_block_hash", "block_size", "lora_id", "medium", "lora_name",
                "group_idx", "kv_cache_spec_kind"} <= set(event)
        assert all(0 <= h < 2**64 for h in event["block_hashes"])
    finally:
        sub.close()
        e.close()


def test_a_gap_is_answered_by_replay_and_malformed_requests_are_counted_and_survived():
    c = _Collector()
    e = _engine(c, _config())
    sub = None
    try:
        for i in range(3):  # published before anyone subscribed
            c.run(e, f"early{i}", [256] + [30 + i] * 7, max_tokens=1)
        sub = KVEventReader(*e.kv_events_endpoints)
        bad = [sub.ctx.socket(zmq.DEALER) for _ in range(2)]
        for sock in bad:
            sock.connect(e.kv_events_endpoints[1])
        bad[0].send_multipart([b"", b"\x00\x01"])  # a seq of 2 bytes
        bad[0].send_multipart([(0).to_bytes(8, "big")])  # no empty delimiter (vLLM refuses it too)
        bad[1].send_multipart([b"x" * 200])  # past the frame bound: ZeroMQ drops the peer unread
        wait_until(lambda: e.event_stats()["bad_replay_requests"] == 2, 10, 0.05, what="the bad requests")
        for i in range(20):  # until the SUB has joined: its first seq is past 0, a gap
            c.run(e, f"late{i}", [256] + [90 + i] * 7, max_tokens=1)
            got = sub.batches(500)
            if got:
                break
        last = got[-1][0]
        assert sub.gaps == 1 and [s for s, _ in got] == list(range(last + 1)) and last >= 4
        assert [b.events[0].token_ids[1] for _, b in got[1:4]] == [30, 31, 32]
        assert sub.replay(2) == got[2:]
        assert e.event_stats()["bad_replay_requests"] == 2 and e.event_stats()["replay_requests"] == 2
    finally:
        if sub is not None:
            sub.close()
        e.close()


def test_a_restarted_engine_counts_from_zero_again_and_says_its_cache_is_empty():
    c = _Collector()
    e = _engine(c, _config())
    endpoint, replay = e.kv_events_endpoints
    sub = KVEventReader(endpoint, replay)
    e2 = None
    try:
        for i in range(5):
            c.run(e, f"r{i}", [256] + [40 + i] * 7, max_tokens=1)
        sub.events_until(lambda seen: len([x for x in seen if isinstance(x, BlockStored)]) == 5)
        assert sub.last == 5 and sub.restarts == 0
        e.close()
        text = _config(endpoint=endpoint, replay_endpoint=replay)  # the same ports
        e2 = _engine(c, text)
        for i in range(20):  # until the SUB has reconnected
            c.run(e2, f"again{i}", [256] + [70 + i] * 7, max_tokens=1)
            got = sub.batches(500)
            if got:
                break
        assert sub.restarts == 1  # a seq below the last one seen: the publisher restarted
        seq, batch = got[-1]
        assert seq < 5 and isinstance(batch.events[0], BlockStored)
        first_seq, first = sub.replay(0)[0]
        assert first_seq == 0 and first.events == [AllBlocksCleared()]
    finally:
        sub.close()
        e.close()
        if e2 is not None:
            e2.close()


def test_a_full_queue_drops_and_counts_without_waiting_and_leaves_a_gap():
    cfg = parse_kv_events_config(_config(max_queue_size=2))
    pub = KVEventPublisher(cfg)  # not started: nothing drains the queue
    sub = KVEventReader(pub.endpoint, pub.replay_endpoint)
    try:
        stored = [BlockStored(block_hashes=[i], parent_block_hash=None, token_ids=[i] * BS, block_size=BS,
                              lora_id=None, medium="GPU", lora_name=None) for i in range(5)]
        seqs = [pub.publish([ev]) for ev in stored]  # returns at once, full or not
        assert seqs == [0, 1, None, None, None]
        assert pub.stats.batches_dropped == 3 and pub.stats.events_dropped == 3
        pub.start()  # its AllBlocksCleared (seq 5) finds the queue full too
        assert pub.stats.batches_dropped == 4
        wait_until(lambda: pub.stats.batches_published == 2, 10, 0.05, what="the queued batches to go out")
        assert pub.publish(stored[:1]) == 6
        wait_until(lambda: pub.stats.batches_published == 3, 10, 0.05, what="the last batch to go out")
        assert [s for s, _ in sub.replay(0)] == [0, 1, 6]  # the dropped batches' seqs are a gap
    finally:
        sub.close()
        pub.close()


def test_the_config_takes_vllms_keys_and_defaults_and_names_a_bad_one():
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert (cfg.publisher, cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.topic) == (
        "zmq", "tcp://*:5557", None, 10_000, 100_000, "")
    assert not parse_kv_events_config('{"publisher": "zmq"}').publishing
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').publishing
    for text, key in [('{"enable_kv_cache_event": true}', "`enable_kv_cache_event`"),
                      ('{"enable_kv_cache_events": 1}', "`enable_kv_cache_events`"),
                      ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "`buffer_steps`"),
                      ('{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/x"}', "`endpoint`"),
                      ('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:70000"}', "`endpoint`"),
                      ('[1]', "JSON object")]:
        with pytest.raises(ConfigError, match=key):
            parse_kv_events_config(text)


def test_an_endpoint_beyond_loopback_needs_the_token_or_the_operators_flag():
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}')
    producer = dict(kv_role="kv_producer")
    for kv_config in (None, KVTransferConfig(**producer)):
        with pytest.raises(ConfigError, match="beyond loopback"):
            check_kv_events_listeners(cfg, kv_config, dp_size=1, http_port=8000)
    for allowed in (dict(auth_token="t" * 32), dict(allow_open_listeners=True)):
        check_kv_events_listeners(cfg, KVTransferConfig(**producer, **allowed), dp_size=1, http_port=8000)
    loopback = parse_kv_events_config(_config(endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5560"))
    check_kv_events_listeners(loopback, None, dp_size=3, http_port=8000)
    with pytest.raises(ConfigError, match="overlap"):
        check_kv_events_listeners(loopback, None, dp_size=4, http_port=8000)
    with pytest.raises(ConfigError, match="HTTP"):
        check_kv_events_listeners(loopback, None, dp_size=1, http_port=5557)


def test_dp_rank_n_publishes_on_port_plus_n():
    from atom_kv.testing.ports import free_port

    base = free_port()
    cfg = parse_kv_events_config(_config(endpoint=f"tcp://127.0.0.1:{base}", replay_endpoint=None))
    pubs = []
    try:
        try:
            pubs = [KVEventPublisher(cfg, dp_rank=r) for r in range(2)]
        except ConfigError:
            pytest.skip(f"port {base + 1} is taken")
        assert [p.endpoint for p in pubs] == [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"]
        assert [p.replay_endpoint for p in pubs] == [None, None]
    finally:
        for p in pubs:
            p.close()


def test_the_registration_ping_announces_the_endpoints():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    cfg = KVTransferConfig(kv_role="kv_consumer", proxy_ip=f"127.0.0.1:{port}", ping_interval_s=0.2)
    pinger = build_registration_pinger(cfg, role="D", index="0", http_host="127.0.0.1", http_port=8000, tp_size=1,
                                       engine_id="e", kv_events_endpoint="tcp://127.0.0.1:5557",
                                       kv_events_replay_endpoint="tcp://127.0.0.1:5558").start()
    try:
        assert router.poll(_WAIT_MS)
        ping = decode(router.recv_multipart()[-1], RegisterPing)
        assert (ping.kv_events, ping.kv_events_replay) == ("tcp://127.0.0.1:5557",
                                                                             "tcp://127.0.0.1:5558")
    finally:
        pinger.close()
        ctx.destroy(linger=0)
