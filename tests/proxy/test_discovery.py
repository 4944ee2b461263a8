"""Discovery over a real ZeroMQ ROUTER: both ping formats, expiry, signed pings, limits, floods, races."""

from __future__ import annotations

import asyncio
import logging
import threading

import aiohttp
import msgspec
import pytest

from atom_kv.auth import PURPOSE_REGISTER, sign_fields
from atom_kv.discovery import build_registration_pinger
from atom_kv.proxy.fleet.discovery import decode_discovery, to_registration
from atom_kv.testing.fake_engine import FakeEngine
from atom_kv.wire import HelloPing, RegisterPing, WireError, encode
from tests.connector.kvutil import config
from tests.proxy.fake_engine import get, post, register, send_pings


async def _sent(proxy, pings: list[bytes]) -> None:
    await asyncio.to_thread(send_pings, proxy.discovery_endpoint, pings)


async def _counted(proxy, name: str, n: float, timeout: float = 10.0, **labels) -> bool:
    """Wait until the counter reaches ``n`` (it only ever grows); False if it did not within ``timeout``, or
    went past ``n``. (The discovery socket queues only a couple of pings per connection: a burst's tail waits
    in TCP and may be handled after another connection's ping.)"""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while proxy.count(name, **labels) < n and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return proxy.count(name, **labels) == n


async def test_atom_ping_registers_after_a_probe_and_hello_is_ignored(make_proxy, make_engine):
    proxy = await make_proxy()
    p = await make_engine("P", tp_size=8, dp_size=2, handshake_port=6301)
    await _sent(proxy, [encode(HelloPing()), p.register_ping()])
    await register(proxy, p)
    (inst,) = proxy.registry.live("P")
    assert (inst.base_url, inst.host, inst.http_port) == (p.base_url, "127.0.0.1", p.port)
    assert (inst.tp_size, inst.dp_size, inst.handshake_port, inst.source) == (8, 2, 6301, "atom")
    assert inst.engine_id == p.engine_id and inst.max_model_len == 32768  # learnt from /v1/models
    assert p.health_checks >= 1  # probed before it got any traffic
    assert proxy.registry.live("D") == []
    assert proxy.count("atom_kv_proxy_bad_discovery_messages_total") == 0


async def test_registered_but_unreachable_engine_gets_no_traffic(make_proxy, make_engine):
    proxy = await make_proxy()
    d = await make_engine("D")
    p = await make_engine("P")
    dead = await make_engine("P")
    dead_ping = dead.register_ping()
    await dead.close()
    await _sent(proxy, [dead_ping])
    await register(proxy, p, d)
    assert await proxy.registry.wait_for(lambda r: r.known("P") and all(
        i.state == "pending" and "health probe" in i.down_reason for i in r.known("P") if i.base_url == dead.base_url),
        3.0)
    results = await asyncio.gather(*(post(proxy.url, {"prompt": "x"}) for _ in range(6)))
    assert [r[0] for r in results] == [200] * 6 and len(p.received) == 6 and dead.received == []


async def test_an_engine_that_registers_before_it_serves_is_starting_never_down(make_proxy, make_engine, caplog):
    """Engines may ping before their HTTP server listens: the proxy says "starting" once, no "down", no
    "up again", and routes to it once a probe reaches it."""
    caplog.set_level(logging.INFO, logger="atom_kv.proxy.fleet.registry")
    proxy = await make_proxy(probe_interval_s=0.1)
    d = await make_engine("D")
    early = await make_engine("P")
    port, ping = early.port, early.register_ping()
    await early.close()  # registered, not listening yet
    await _sent(proxy, [ping])
    await register(proxy, d)
    assert await proxy.registry.wait_for(lambda r: any(i.down_reason for i in r.known("P")), 3.0)
    await asyncio.sleep(0.3)  # several probes find nobody there
    late = await FakeEngine("P", engine_id=early.engine_id).start(port=port)
    try:
        assert await proxy.registry.wait_for(lambda r: len(r.live("P")) == 1, 3.0)
        assert (await post(proxy.url, {"prompt": "x"}))[0] == 200 and len(late.received) == 1
    finally:
        await late.close()
    lines = [r.getMessage() for r in caplog.records]
    assert sum(f"prefill instance http://127.0.0.1:{port} is starting" in m for m in lines) == 1, lines
    assert not any(" is down" in m or "up again" in m for m in lines), lines
    assert proxy.count("atom_kv_proxy_marked_down_total", role="prefill") == 0


async def test_moriio_ping_registers(make_proxy, make_engine):
    proxy = await make_proxy()
    p = await make_engine("P", handshake_port=7001)
    d = await make_engine("D", handshake_port=7002, tp_size=2)
    assert msgspec.msgpack.decode(p.moriio_ping())["transfer_mode"] == "READ"  # vLLM's spelling
    await register(proxy, p, d, fmt="moriio")
    (pi,) = proxy.registry.live("P")
    (di,) = proxy.registry.live("D")
    assert pi.source == "moriio" and pi.handshake_port == 7001 and pi.notify_port == 41000
    assert di.base_url == d.base_url and di.tp_size == 2
    assert (await post(proxy.url, {"prompt": "x", "max_tokens": 2}))[0] == 200
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
    proxy = await make_proxy(heartbeat_timeout=1.0)
    d = await make_engine("D")
    await register(proxy, d)
    first = proxy.registry.live("D")[0].last_seen
    await _sent(proxy, [d.register_ping()])
    assert await proxy.registry.wait_for(lambda r: r.known("D")[0].last_seen > first, 3.0)
    live = proxy.registry.live("D")
    refreshed = live[0].last_seen
    # past the first ping's deadline, within the refreshed one: still live (explicit clock)
    assert len(proxy.registry.live("D", now=first + 1.0 + (refreshed - first) / 2)) == 1
    assert proxy.registry.live("D", now=refreshed + 1.1) == []
    assert await proxy.registry.wait_for(lambda r: not r.known("D"), 4.0)  # evicted by the health monitor
    assert proxy.count("atom_kv_proxy_evictions_total", role="decode") == 1
    status, body = await get(proxy.url, "/health")
    assert status == 503 and body == {"status": "unavailable", "prefill": 0, "decode": 0}


async def test_garbage_is_counted_and_survived(make_proxy, make_engine):
    proxy = await make_proxy()
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
        b"\x91" * 5000 + b"\x01",  # nested 5000 deep
        b"",
    ]
    await _sent(proxy, garbage)
    await register(proxy, d)  # discovery still alive afterwards
    assert await _counted(proxy, "atom_kv_proxy_bad_discovery_messages_total", len(garbage))
    assert [i.base_url for i in proxy.registry.live("D")] == [d.base_url]
    assert proxy.registry.known("P") == []


async def test_transfer_mode_mismatch_refused(make_proxy, make_engine):
    proxy = await make_proxy()
    p = await make_engine("P")
    d = await make_engine("D")
    await _sent(proxy, [p.register_ping(transfer_mode="write"), p.moriio_ping(transfer_mode="WRITE")])
    await register(proxy, d)
    assert await _counted(proxy, "atom_kv_proxy_rejected_registrations_total", 2, reason="transfer_mode")
    assert proxy.registry.known("P") == []


async def test_signed_pings_only_with_a_registration_token(make_proxy, make_engine):
    proxy = await make_proxy(registration_token="s3cret", registration_window_s=30.0)
    p = await make_engine("P")
    d = await make_engine("D")
    fields = p.register_fields()
    replayed = p.register_ping(token="s3cret")
    stale = msgspec.msgpack.encode(sign_fields("s3cret", PURPOSE_REGISTER, fields, now=1_000_000.0))
    tampered = msgspec.msgpack.decode(p.register_ping(token="s3cret"))
    tampered["request_address"] = "http://10.9.9.9:1/v1/completions"
    await _sent(proxy, [
        p.register_ping(),                      # unsigned
        p.register_ping(token="wrong"),        # signed with another token
        d.moriio_ping(),                       # MoRIIO pings cannot be signed
        msgspec.msgpack.encode(tampered),      # changed after signing
        stale,                                 # outside the window
        replayed, replayed,                    # the second copy is a replay
    ])
    await register(proxy, d, token="s3cret")   # signed: accepted (and proves the above were handled)
    assert proxy.count("atom_kv_proxy_rejected_registrations_total", reason="auth") == 4
    assert proxy.count("atom_kv_proxy_rejected_registrations_total", reason="stale") == 1
    assert proxy.count("atom_kv_proxy_rejected_registrations_total", reason="replay") == 1
    assert [i.base_url for i in proxy.registry.known("P")] == [p.base_url]  # the first copy of `replayed`
    for ping in (replayed, p.register_ping(token="s3cret")):
        assert b"s3cret" not in ping  # the token itself never travels


async def test_signed_ping_from_a_newer_sender_with_extra_keys_verifies(make_proxy, make_engine):
    proxy = await make_proxy(registration_token="tok")
    d = await make_engine("D")
    fields = dict(d.register_fields(), some_future_key={"nested": [1, 2]}, another=1.5)
    await _sent(proxy, [msgspec.msgpack.encode(sign_fields("tok", PURPOSE_REGISTER, fields))])
    assert await proxy.registry.wait_for(lambda r: len(r.live("D")) == 1, 3.0)


async def test_the_engines_pinger_signs_and_the_proxy_accepts(make_proxy, make_engine):
    proxy = await make_proxy(registration_token="shared")
    p = await make_engine("P")
    cfg = config("kv_producer", 6400, proxy_ip=proxy.discovery_endpoint, ping_interval_s=0.1, auth_token="shared")
    pinger = build_registration_pinger(cfg, role="P", index="0", http_host="127.0.0.1", http_port=p.port,
                                       tp_size=2, engine_id="P-signed")
    assert pinger.payload() != pinger.payload()  # a fresh nonce every time
    pinger.start()
    seen: set[float] = set()

    def refreshed_three_times(r) -> bool:
        seen.update(i.last_seen for i in r.live("P"))
        return len(seen) >= 3

    try:
        assert await proxy.registry.wait_for(refreshed_three_times, 5.0)  # three accepted pings
        assert proxy.registry.live("P")[0].engine_id == "P-signed"
        assert proxy.count("atom_kv_proxy_rejected_registrations_total", reason="replay") == 0
    finally:
        await asyncio.to_thread(pinger.close)


async def test_refused_pings_are_counted_every_time_but_logged_at_a_bounded_rate(make_proxy, make_engine, caplog):
    proxy = await make_proxy(registration_token="s3cret")
    p = await make_engine("P")
    d = await make_engine("D")
    caplog.set_level(logging.WARNING, logger="atom_kv.proxy.fleet.discovery")
    await _sent(proxy, [p.register_ping(token="wrong") for _ in range(500)])
    await register(proxy, d, token="s3cret")
    # the discovery socket queues only a couple of pings per connection: the rest wait in TCP, then arrive
    assert await _counted(proxy, "atom_kv_proxy_rejected_registrations_total", 500, reason="auth")
    refusals = [r for r in caplog.records if "refused registration" in r.getMessage()]
    assert 1 <= len(refusals) <= 2, [r.getMessage() for r in refusals]


async def test_ping_limits_are_refused_without_allocating(make_proxy, make_engine):
    proxy = await make_proxy(max_tp_size=64, max_dp_size=64)
    d = await make_engine("D")
    huge = dict(d.register_fields(), dp_size=50_000_000)
    wide = dict(d.register_fields(), tp_size=10_000)
    await _sent(proxy, [msgspec.msgpack.encode(huge), msgspec.msgpack.encode(wide)])
    await register(proxy, d)
    assert await _counted(proxy, "atom_kv_proxy_rejected_registrations_total", 2, reason="limits")
    assert proxy.registry.live("D")[0].dp_size == 1 and len(proxy.registry.live("D")[0].outstanding_tokens) == 1


async def test_a_ping_of_another_protocol_version_is_refused_naming_both(make_proxy, make_engine, caplog):
    proxy = await make_proxy()
    d = await make_engine("D")
    caplog.set_level(logging.WARNING, logger="atom_kv.proxy.fleet.discovery")
    await _sent(proxy, [msgspec.msgpack.encode(dict(d.register_fields(), v=999))])
    await register(proxy, d)  # the same engine at our version is accepted
    assert await _counted(proxy, "atom_kv_proxy_rejected_registrations_total", 1, reason="version")
    assert "version 999 (engine) is not version 1 (proxy)" in caplog.text


async def test_ten_thousand_fake_decode_pings_do_not_break_real_requests(make_proxy, make_engine):
    proxy = await make_proxy(max_instances=64)
    p = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, p, d)
    fakes = [msgspec.msgpack.encode(dict(d.register_fields(), request_address=f"http://127.0.0.2:{20000 + i}/v1"))
             for i in range(10_000)]
    sender = asyncio.create_task(_sent(proxy, fakes))
    statuses = [s for s, _, _ in await asyncio.gather(*(post(proxy.url, {"prompt": "x"}) for _ in range(30)))]
    await sender
    statuses += [s for s, _, _ in await asyncio.gather(*(post(proxy.url, {"prompt": "x"}) for _ in range(30)))]
    assert statuses == [200] * 60
    assert len(d.received) == 60  # no request ever went to a fake
    assert len(proxy.registry) <= 64 + 1  # bounded: pending fakes displace each other, never a live engine
    assert proxy.count("atom_kv_proxy_evictions_total", role="decode") > 1000
    status, body = await get(proxy.url, "/health")
    assert status == 200 and body["decode"] == 1  # the truth: one usable decode engine


async def test_discovery_binds_the_http_host_unless_told_otherwise(make_proxy):
    proxy = await make_proxy(host="127.0.0.1")
    assert proxy.state.discovery.host == "127.0.0.1"
    other = await make_proxy(host="127.0.0.1", discovery_host="127.0.0.2")
    assert other.state.discovery.host == "127.0.0.2"


async def test_dp_size_changing_under_load_never_gives_a_500(make_proxy, make_engine):
    """Pings that resize DP ranks arrive while requests are being routed (least_loaded
    indexes per-rank counters; round robin cycles ranks): every request succeeds."""
    proxy = await make_proxy(prefill_policy="least_loaded", decode_policy="round_robin")
    p = await make_engine("P", dp_size=4)
    d = await make_engine("D", dp_size=4)
    await register(proxy, p, d)
    stop = threading.Event()
    endpoint = proxy.discovery_endpoint

    def churn() -> None:
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        n = 0
        while not stop.is_set():
            for engine in (p, d):
                size = 1 + n % 8
                sock.send(msgspec.msgpack.encode(dict(engine.register_fields(), dp_size=size)))
            n += 1
            stop.wait(0.001)
        sock.close(0)
        ctx.term()

    thread = threading.Thread(target=churn, name="test-dp-churn")
    thread.start()
    try:
        results = []
        for _ in range(4):
            results += await asyncio.gather(*(post(proxy.url, {"prompt": "y" * 40, "max_tokens": 2,
                                                               "stream": i % 2 == 0}) for i in range(50)))
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 5)
    assert [s for s, _, _ in results] == [200] * 200
    assert proxy.count("atom_kv_proxy_requests_total", endpoint="/v1/completions", status="500") == 0
    assert len(d.received) == 200


def test_register_ping_roundtrip_keeps_atom_layout():
    ping = RegisterPing(role="D", index="3", request_address="http://10.0.0.1:8000/v1/completions",
                        handshake_port=6000, dp_size=2, tp_size=4)
    raw = msgspec.msgpack.decode(encode(ping))
    assert raw["type"] == "register" and raw["role"] == "D" and raw["request_address"].endswith("/v1/completions")
    assert "auth_token" not in raw
    reg = to_registration(decode_discovery(encode(ping)))
    assert (reg.base_url, reg.http_port, reg.dp_size, reg.tp_size) == ("http://10.0.0.1:8000", 8000, 2, 4)


async def test_instances_listing_shows_state(make_proxy, make_engine):
    proxy = await make_proxy()
    d = await make_engine("D")
    await register(proxy, d)
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/instances") as r:
            (entry,) = await r.json()
    assert entry["state"] == "up" and entry["down_reason"] is None and entry["max_model_len"] == 32768


async def test_a_non_ascii_mac_is_a_counted_refusal_not_a_traceback(make_proxy, make_engine, caplog):
    """Today's reproduction: a non-ASCII MAC made hmac.compare_digest raise TypeError; 2,000
    pings gave 2,000 tracebacks, uncounted."""
    proxy = await make_proxy(registration_token="s3cret")
    p = await make_engine("P")
    d = await make_engine("D")
    bad = []
    for _ in range(200):
        ping = msgspec.msgpack.decode(p.register_ping(token="s3cret"))
        ping["mac"] = "\u00e9" * 64
        bad.append(msgspec.msgpack.encode(ping))
    await _sent(proxy, bad)
    await register(proxy, d, token="s3cret")
    assert await _counted(proxy, "atom_kv_proxy_rejected_registrations_total", 200, reason="auth")
    assert not any(r.exc_info for r in caplog.records)
    assert len([r for r in caplog.records if "refused registration" in r.getMessage()]) <= 2


async def test_kv_features_in_a_ping_are_the_instances_until_a_ping_says_otherwise(make_proxy, make_engine):
    """Engines whose /health has no body (vLLM's) announce what their connector takes part in by ping."""
    proxy = await make_proxy()
    d = await make_engine("D")

    def ping(features) -> bytes:
        return msgspec.msgpack.encode(dict(d.register_fields(), kv_features=features))

    await _sent(proxy, [ping(["rendezvous"])])
    await register(proxy, d)
    (inst,) = proxy.registry.live("D")
    assert inst.features == frozenset({"rendezvous"})
    await _sent(proxy, [d.register_ping()])  # says nothing: the instance keeps what it announced
    await _sent(proxy, [ping(["rendezvous", "first_token"])])
    assert await proxy.registry.wait_for(lambda r: inst.features == {"rendezvous", "first_token"}, 3.0)
    await _sent(proxy, [ping([])])
    assert await proxy.registry.wait_for(lambda r: inst.features == frozenset(), 3.0)


async def test_a_ping_with_too_many_empty_or_long_kv_features_is_refused_and_counted(make_proxy, make_engine):
    proxy = await make_proxy()
    d = await make_engine("D")
    for features in ([f"f{i}" for i in range(33)], [""], ["x" * 65]):
        with pytest.raises(WireError):
            decode_discovery(msgspec.msgpack.encode(dict(d.register_fields(), kv_features=features)))
    await _sent(proxy, [msgspec.msgpack.encode(dict(d.register_fields(), kv_features=["x" * 65]))])
    await register(proxy, d)
    assert await _counted(proxy, "atom_kv_proxy_bad_discovery_messages_total", 1)
    (inst,) = proxy.registry.live("D")
    assert inst.features == frozenset()


async def test_pings_are_read_and_answered_without_a_zmq_asyncio_call_each(make_proxy, make_engine, monkeypatch):
    """Each awaited ``zmq.asyncio`` receive, poll or send costs a future and a loop round trip: at 1,000
    engines that was most of discovery's CPU (``bench fleet``). The listener reads and answers on a plain
    view of its socket, woken by the loop's reader on its descriptor."""
    import zmq
    import zmq.asyncio

    calls: list[str] = []
    for name in ("poll", "recv_multipart", "send_multipart", "recv", "send"):
        original = getattr(zmq.asyncio.Socket, name)

        def counting(self, *args, __name=name, __original=original, **kwargs):  # type: ignore[no-untyped-def]
            if self.socket_type == zmq.ROUTER:
                calls.append(__name)
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(zmq.asyncio.Socket, name, counting)
    proxy = await make_proxy(registration_token="tok")
    d = await make_engine("D")

    def ping_and_read(n: int) -> list[bytes]:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(proxy.discovery_endpoint)
        answers = []
        try:
            for _ in range(n):
                sock.send(msgspec.msgpack.encode(sign_fields("tok", PURPOSE_REGISTER,
                                                             dict(d.register_fields(), answers=True))))
                if sock.poll(5000):
                    answers.append(sock.recv())
        finally:
            sock.close(0)
            ctx.term()
        return answers

    answers = await asyncio.to_thread(ping_and_read, 30)
    assert len(answers) == 30  # every ping answered ...
    assert calls == []  # ... with no zmq.asyncio call on the ROUTER for any of them
    assert [i.base_url for i in proxy.registry.known("D")] == [d.base_url]
