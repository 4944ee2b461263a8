"""Discovery over a real ZeroMQ ROUTER: both ping formats, expiry, refusals, garbage."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec
import pytest

from atom_kv.proxy.discovery import decode_discovery, to_registration
from atom_kv.wire import HelloPing, RegisterPing, WireError, encode
from tests.proxy.fake_engine import register, send_pings


def _count(proxy, name: str, **labels) -> float:
    value = proxy.metrics.registry.get_sample_value(name, labels or None)
    return value or 0.0


async def _wait(predicate, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def test_atom_ping_registers_and_hello_is_ignored(make_proxy, make_engine):
    proxy = make_proxy()
    p = await make_engine("P", tp_size=8, dp_size=2, handshake_port=6301)
    await asyncio.to_thread(send_pings, proxy.discovery_endpoint, [encode(HelloPing()), p.register_ping()])
    await register(proxy, p)
    (inst,) = proxy.registry.live("P")
    assert (inst.base_url, inst.host, inst.http_port) == (p.base_url, "127.0.0.1", p.port)
    assert (inst.tp_size, inst.dp_size, inst.handshake_port, inst.source) == (8, 2, 6301, "atom")
    assert inst.engine_id == p.engine_id
    assert proxy.registry.live("D") == []
    assert _count(proxy, "atom_kv_proxy_bad_discovery_messages_total") == 0


async def test_moriio_ping_registers(make_proxy, make_engine):
    proxy = make_proxy()
    p = await make_engine("P", handshake_port=7001)
    d = await make_engine("D", handshake_port=7002, tp_size=2)
    assert msgspec.msgpack.decode(p.moriio_ping())["transfer_mode"] == "READ"  # vLLM's spelling
    await register(proxy, p, d, fmt="moriio")
    (pi,) = proxy.registry.live("P")
    (di,) = proxy.registry.live("D")
    assert pi.source == "moriio" and pi.handshake_port == 7001 and pi.notify_port == 41000
    assert di.base_url == d.base_url and di.tp_size == 2
    # and the relay works against MoRIIO-registered instances
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200
    assert p.received[0].kv["remote_notify_port"] == 41000
    assert p.received[0].kv["remote_handshake_port"] == 7002


def test_moriio_bad_zmq_address_is_a_wire_error():
    raw = msgspec.msgpack.encode({"type": "D", "http_address": "1.2.3.4:80", "zmq_address": "nonsense"})
    with pytest.raises(WireError, match="zmq_address"):
        to_registration(decode_discovery(raw))
    raw = msgspec.msgpack.encode({"type": "D", "http_address": "1.2.3.4:x", "zmq_address": "handshake:1"})
    with pytest.raises(WireError, match="http_address"):
        to_registration(decode_discovery(raw))


async def test_reregistration_refreshes_and_silence_evicts(make_proxy, make_engine):
    proxy = make_proxy(heartbeat_timeout=1.0)
    d = await make_engine("D")
    await register(proxy, d)
    first = proxy.registry.live("D")[0].last_seen
    await asyncio.sleep(0.5)
    await register(proxy, d)
    live = proxy.registry.live("D")
    assert len(live) == 1 and live[0].last_seen > first
    # past the first ping's deadline, within the refreshed one: still live
    assert len(proxy.registry.live("D", now=first + 1.3)) == 1
    assert proxy.registry.live("D", now=live[0].last_seen + 1.1) == []
    assert await _wait(lambda: _count(proxy, "atom_kv_proxy_evictions_total", role="decode") == 1, 3.0)
    assert proxy.registry.live("D") == []
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/health") as r:
            assert r.status == 503
            assert await r.json() == {"status": "unavailable", "prefill": 0, "decode": 0}


async def test_garbage_is_counted_and_survived(make_proxy, make_engine):
    proxy = make_proxy()
    d = await make_engine("D")
    garbage = [
        b"\xff\x00not msgpack at all",
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"type": "register", "role": "P"}),  # missing fields
        msgspec.msgpack.encode({"type": "register", "role": "X", "index": "0", "request_address": "http://a:1",
                                "handshake_port": 1}),
        msgspec.msgpack.encode({"type": "register", "role": "D", "index": "0", "request_address": "http://a:1",
                                "handshake_port": "not-an-int"}),
        msgspec.msgpack.encode({"type": "register", "role": "D", "index": "0", "request_address": "ftp://a",
                                "handshake_port": 1}),
        msgspec.msgpack.encode({"type": "register", "role": "D", "index": "0", "request_address": "http://a:1",
                                "handshake_port": 70000}),
        msgspec.msgpack.encode({"type": "register", "role": "D", "index": "0", "request_address": "http://[::1/v1",
                                "handshake_port": 1}),
        msgspec.msgpack.encode({"type": "whatever"}),
        b"",
    ]
    await asyncio.to_thread(send_pings, proxy.discovery_endpoint, garbage)
    await register(proxy, d)  # discovery still alive afterwards
    assert await _wait(lambda: _count(proxy, "atom_kv_proxy_bad_discovery_messages_total") == len(garbage))
    assert [i.base_url for i in proxy.registry.live("D")] == [d.base_url]
    assert proxy.registry.live("P") == []


async def test_transfer_mode_mismatch_refused(make_proxy, make_engine):
    proxy = make_proxy()
    p = await make_engine("P")
    d = await make_engine("D")
    await asyncio.to_thread(send_pings, proxy.discovery_endpoint,
                            [p.register_ping(transfer_mode="write"), p.moriio_ping(transfer_mode="WRITE")])
    await register(proxy, d)
    assert await _wait(lambda: _count(proxy, "atom_kv_proxy_rejected_registrations_total",
                                      reason="transfer_mode") == 2)
    assert proxy.registry.live("P") == []


async def test_registration_token(make_proxy, make_engine):
    proxy = make_proxy(registration_token="s3cret")
    p = await make_engine("P")
    d = await make_engine("D")
    await asyncio.to_thread(send_pings, proxy.discovery_endpoint, [
        p.register_ping(),                      # no token
        p.register_ping(token="wrong"),        # wrong token
        d.moriio_ping(),                       # MoRIIO ping carries no token
    ])
    assert await _wait(lambda: _count(proxy, "atom_kv_proxy_rejected_registrations_total", reason="auth") == 3)
    assert proxy.registry.live("P") == [] and proxy.registry.live("D") == []
    await asyncio.to_thread(send_pings, proxy.discovery_endpoint, [p.register_ping(token="s3cret")])
    assert await asyncio.to_thread(proxy.registry.wait_for, lambda r: len(r.live("P")) == 1, 3.0)


def test_register_ping_roundtrip_keeps_atom_layout():
    ping = RegisterPing(role="D", index="3", request_address="http://10.0.0.1:8000/v1/completions",
                        handshake_port=6000, dp_size=2, tp_size=4)
    raw = msgspec.msgpack.decode(encode(ping))
    assert raw["type"] == "register" and raw["role"] == "D" and raw["request_address"].endswith("/v1/completions")
    reg = to_registration(decode_discovery(encode(ping)))
    assert (reg.base_url, reg.http_port, reg.dp_size, reg.tp_size) == ("http://10.0.0.1:8000", 8000, 2, 4)
