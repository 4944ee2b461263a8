"""KV events in the proxy: announced in a registration ping (``kv_events``) or a static spec (``events=``),
followed by a real proxy, counted on /metrics, and dropped when the engine leaves or restarts."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import msgspec
import pytest

from atom_kv.proxy.__main__ import build_parser, settings_from_args
from atom_kv.proxy.fleet.pings import decode_discovery, to_registration
from atom_kv.proxy.fleet.static import parse_engine_spec
from atom_kv.proxy.observability.metrics import ProxyMetrics
from atom_kv.proxy.kv_events import KvEvents
from atom_kv.proxy.kv_events.wire import BlockStored
from atom_kv.proxy.settings import ProxySettings
from atom_kv.testing.kv_events import KvEventsTestPublisher
from atom_kv.wire import RegisterPing, WireError
from tests.proxy.fake_engine import send_pings

BS = 16
TOKENS = list(range(500, 500 + 4 * BS))
WAIT = 10.0


def _ping(**kw) -> bytes:
    fields = dict(role="D", index="0", request_address="http://10.1.2.3:8000", handshake_port=6301, **kw)
    return msgspec.msgpack.encode(RegisterPing(**fields))


def test_a_ping_announces_its_publisher_and_a_bind_address_means_its_host():
    reg = to_registration(decode_discovery(_ping(kv_events="tcp://*:5557", kv_events_replay="tcp://0.0.0.0:5558")))
    assert (reg.kv_events, reg.kv_events_replay) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558")
    reg = to_registration(decode_discovery(_ping(kv_events="tcp://10.9.9.9:5557")))
    assert (reg.kv_events, reg.kv_events_replay) == ("tcp://10.9.9.9:5557", None)
    assert to_registration(decode_discovery(_ping())).kv_events is None  # ATOM's own pings say nothing
    moriio = msgspec.msgpack.encode({"type": "D", "http_address": "10.1.2.3:8000",
                                     "zmq_address": "host:10.1.2.3,handshake:6301,notify:41000"})
    assert to_registration(decode_discovery(moriio)).kv_events is None
    for bad in ("ipc:///tmp/kv", "tcp://h", "tcp://h:70000"):
        with pytest.raises(WireError, match="kv_events"):
            to_registration(decode_discovery(_ping(kv_events=bad)))


def test_a_static_spec_names_its_publisher():
    engine = parse_engine_spec("P", "http://h:8000,6301,dp=2,events=tcp://h:5557,events_replay=tcp://h:5558")
    assert (engine.events, engine.events_replay, engine.dp_size) == ("tcp://h:5557", "tcp://h:5558", 2)
    assert parse_engine_spec("D", "http://h:8000").events is None
    with pytest.raises(ValueError, match="events: 'tcp://\\*:5557' is a bind address"):
        parse_engine_spec("D", "http://h:8000,events=tcp://*:5557")
    with pytest.raises(ValueError, match="events_replay needs events"):
        parse_engine_spec("D", "http://h:8000,events_replay=tcp://h:5558")
    with pytest.raises(ValueError, match="unknown key 'event'.*events, events_replay"):
        parse_engine_spec("D", "http://h:8000,event=tcp://h:1")


def test_the_knobs_are_flags_and_are_checked():
    s = settings_from_args(build_parser().parse_args([
        "--kv-events-hwm", "50", "--kv-events-max-message-bytes", "65536", "--kv-events-replay-timeout", "0.5",
        "--kv-index-max-blocks", "1000", "--kv-index-max-blocks-per-worker", "100", "--kv-predict-ttl", "2",
        "--kv-predict-max-blocks", "10"]))
    assert (s.kv_events_hwm, s.kv_events_max_message_bytes, s.kv_events_replay_timeout_s, s.kv_index_max_blocks,
            s.kv_index_max_blocks_per_worker, s.kv_predict_ttl_s, s.kv_predict_max_blocks) == (
        50, 65536, 0.5, 1000, 100, 2.0, 10)
    for field, value in (("kv_events_hwm", 0), ("kv_index_max_blocks", 0), ("kv_predict_ttl_s", 0.0),
                         ("kv_events_replay_timeout_s", -1.0)):
        with pytest.raises(ValueError, match=field):
            ProxySettings(**{field: value})


def test_metrics_families_are_on_the_proxys_registry():
    metrics, kv = ProxyMetrics(), KvEvents()
    metrics.registry.register(kv.collector())
    kv.index.apply(("D", "http://e"), 1, [BlockStored(block_hashes=[1, 2], parent_block_hash=None,
                                                      token_ids=TOKENS[:2 * BS], block_size=BS)])
    kv.index.apply(("D", "http://e"), 1, [BlockStored(block_hashes=[3], parent_block_hash=99,
                                                      token_ids=TOKENS[:BS], block_size=BS)])
    get = metrics.registry.get_sample_value
    assert get("atom_kv_proxy_kv_indexed_blocks", {"role": "decode", "instance": "http://e", "dp_rank": "1"}) == 2
    assert get("atom_kv_proxy_kv_events_total", {"kind": "BlockStored"}) == 2
    assert get("atom_kv_proxy_kv_skipped_runs_total", {"reason": "unknown_parent"}) == 1
    assert get("atom_kv_proxy_kv_skipped_runs_total", {"reason": "block_size"}) == 0
    assert get("atom_kv_proxy_kv_event_gaps_total") == 0
    assert get("atom_kv_proxy_kv_event_replays_total", {"outcome": "complete"}) == 0
    assert get("atom_kv_proxy_kv_index_resets_total", {"reason": "restart"}) == 0
    assert get("atom_kv_proxy_kv_event_decode_failures_total", {"reason": "msgpack"}) == 0
    assert get("atom_kv_proxy_kv_index_entries") == 2
    kv.close()


async def _until(kv: KvEvents, predicate, what: str) -> None:
    assert kv.subscriber is not None, "no subscriber started"
    ok = await asyncio.to_thread(kv.subscriber.wait_for, predicate, WAIT)
    assert ok, f"timed out waiting for {what}: {kv.index.block_counts()}"


async def test_a_static_engine_with_events_is_followed(make_proxy):
    with KvEventsTestPublisher() as pub:
        spec = parse_engine_spec("D", f"http://127.0.0.1:9,events={pub.endpoint},events_replay={pub.replay_endpoint}")
        proxy = await make_proxy(static_decode=(spec,), static_prefill=(parse_engine_spec("P", "http://127.0.0.1:8"),))
        kv = proxy.state.kv_events
        assert await asyncio.to_thread(pub.wait_subscribed, 1, WAIT)
        pub.publish([BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=TOKENS[:3 * BS],
                                 block_size=BS)])
        await _until(kv, lambda: kv.index.entries == 3, "3 blocks")
        assert kv.longest_prefix(TOKENS) == {(("D", "http://127.0.0.1:9"), 0): 3 * BS}
        assert proxy.count("atom_kv_proxy_kv_indexed_blocks", role="decode", instance="http://127.0.0.1:9",
                           dp_rank="0") == 3
    await proxy.stop()
    assert kv.subscriber is None  # closed with the proxy


async def test_a_discovered_engine_is_followed_reset_on_a_new_engine_id_and_dropped_when_it_leaves(make_proxy):
    with KvEventsTestPublisher() as pub:
        proxy = await make_proxy(heartbeat_timeout=3.0, probe_interval_s=0.2)
        kv = proxy.state.kv_events

        def ping(engine_id: str) -> bytes:
            return msgspec.msgpack.encode(RegisterPing(
                role="D", index="0", request_address="http://127.0.0.1:9", handshake_port=6301, engine_id=engine_id,
                kv_events=pub.endpoint.replace("127.0.0.1", "*"), kv_events_replay=pub.replay_endpoint))

        await asyncio.to_thread(send_pings, proxy.discovery_endpoint, [ping("e1")])
        assert await asyncio.to_thread(pub.wait_subscribed, 1, WAIT)
        pub.publish([BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=TOKENS[:2 * BS],
                                 block_size=BS)])
        await _until(kv, lambda: kv.index.entries == 2, "2 blocks")
        await asyncio.to_thread(send_pings, proxy.discovery_endpoint, [ping("e1")])  # a heartbeat: no change
        pub.restart()  # the engine restarted: its seq counts from 0 again, and its id is new
        await asyncio.to_thread(send_pings, proxy.discovery_endpoint, [ping("e2")])
        await _until(kv, lambda: kv.index.entries == 0, "the reset")
        assert kv.stats.resets["health"] == 1
        pub.publish([BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=TOKENS[:BS], block_size=BS)])
        await _until(kv, lambda: kv.index.entries == 1, "1 block")
        # no more pings: evicted after the heartbeat timeout, and its entries go
        await _until(kv, lambda: kv.index.entries == 0 and kv.stats.resets["left"] == 1, "the eviction")


def test_settings_defaults_are_valid():
    assert replace(ProxySettings(), kv_index_max_blocks=5).kv_index_max_blocks == 5
