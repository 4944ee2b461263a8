"""The proxy answers the pings that ask (registered, refused and why, stale), and only those; engine
addresses nobody can reach are refused; undecodable pings are counted as ``decode``. Real ZeroMQ sockets."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import zmq

from atom_kv.auth import PURPOSE_REGISTER, sign_fields
from atom_kv.discovery import build_registration_pinger
from atom_kv.wire import RegisterAnswer, decode
from tests.connector.kvutil import config


def _exchange(endpoint: str, pings: list[bytes], answers: int, timeout_s: float = 10.0) -> list[RegisterAnswer]:
    """Send ``pings`` in order from one DEALER and read ``answers`` answers (fewer: the test fails)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        for ping in pings:
            sock.send(ping)
        got = []
        while len(got) < answers:
            assert sock.poll(int(timeout_s * 1000)), f"only {len(got)} of {answers} answers arrived"
            got.append(decode(sock.recv(), RegisterAnswer))
        return got
    finally:
        sock.close(0)
        ctx.term()


def _asking(fields: dict, token: str | None = None, **changes) -> bytes:
    fields = dict(fields, answers=True, **changes)
    if token is not None:
        fields = sign_fields(token, PURPOSE_REGISTER, fields)
    return msgspec.msgpack.encode(fields)


async def _answers(proxy, pings: list[bytes], n: int) -> list[RegisterAnswer]:
    return await asyncio.to_thread(_exchange, proxy.discovery_endpoint, pings, n)


async def test_a_signed_ping_that_asks_is_told_registered_and_each_refusal_says_why(make_proxy, make_engine):
    proxy = await make_proxy(registration_token="s3cret", max_tp_size=8)
    d = await make_engine("D")
    fields = d.register_fields()
    stale = sign_fields("s3cret", PURPOSE_REGISTER, dict(fields, answers=True), now=time.time() - 3600)
    got = await _answers(proxy, [
        _asking(fields, "s3cret"),
        _asking(fields, "wrong"),
        _asking(fields),  # unsigned
        msgspec.msgpack.encode(stale),
        _asking(fields, "s3cret", tp_size=64),
        _asking(fields, "s3cret", request_address="http://0.0.0.0:8101/v1/completions"),
        _asking(fields, "s3cret", handshake_port="x"),
    ], 7)
    assert [(a.status, a.reason) for a in got] == [
        ("registered", ""), ("refused", "token"), ("refused", "token"), ("stale", "stale"), ("refused", "limits"),
        ("refused", "address"), ("refused", "format")]
    assert "--registration-token" in got[1].detail and "auth_token" in got[1].detail
    assert "clocks" in got[3].detail
    assert "--max-tp-size" in got[4].detail
    assert "0.0.0.0" in got[5].detail and "advertise" in got[5].detail
    assert [i.base_url for i in proxy.registry.known("D")] == [d.base_url]


async def test_pings_that_do_not_ask_get_no_answer(make_proxy, make_engine):
    """ATOM's and MoRIIO's engines never read their DEALER: nothing is sent to them. The first answer
    on the socket is the one to the only ping that asked."""
    proxy = await make_proxy()
    d = await make_engine("D")
    p = await make_engine("P")
    got = await _answers(proxy, [d.register_ping(), p.moriio_ping(), msgspec.msgpack.encode(
        dict(d.register_fields(), tp_size=10_000)), _asking(p.register_fields(), index="7")], 1)
    assert [(a.status, a.reason) for a in got] == [("registered", "")]
    assert await proxy.registry.wait_for(lambda r: len(r.known("P")) == 1 and len(r.known("D")) == 1, 5.0)


async def test_an_engine_url_on_an_unspecified_host_is_refused_and_the_log_says_why(make_proxy, make_engine,
                                                                                      caplog):
    caplog.set_level(logging.WARNING, logger="atom_kv.proxy.fleet.discovery")
    proxy = await make_proxy()
    d = await make_engine("D")
    moriio = msgspec.msgpack.encode({
        "type": "P", "http_address": "0.0.0.0:8100", "zmq_address": "host:0.0.0.0,handshake:6301,notify:6401",
        "transfer_mode": "READ"})
    got = await _answers(proxy, [
        moriio, _asking(d.register_fields(), request_address="http://[::]:8101/v1/completions")], 1)
    assert [(a.status, a.reason) for a in got] == [("refused", "address")]
    assert proxy.count("atom_kv_proxy_rejected_registrations_total", reason="address") == 2
    assert proxy.registry.known("P") == [] and proxy.registry.known("D") == []
    lines = [r.getMessage() for r in caplog.records if "refused registration" in r.getMessage()]
    assert lines and "0.0.0.0" in lines[0] and "nobody can connect" in lines[0]


async def test_invalid_utf8_in_a_ping_is_counted_as_decode_not_internal(make_proxy, make_engine):
    proxy = await make_proxy()
    d = await make_engine("D")
    good = d.register_ping()
    bad = [good.replace(b"127.0.0.1", b"127.0.\xff.1"), good.replace(b"register", b"regi\xfeter"),
           good.replace(b"index", b"ind\xc3x")]
    assert all(b != good for b in bad)
    ctx_pings = bad + [_asking(d.register_fields())]
    got = await _answers(proxy, ctx_pings, 1)
    assert got[0].status == "registered"
    assert proxy.count("atom_kv_proxy_rejected_registrations_total", reason="decode") == 3
    assert proxy.count("atom_kv_proxy_rejected_registrations_total", reason="internal") == 0


async def test_an_engine_the_proxy_cannot_reach_is_told_so_in_its_answer(make_proxy, make_engine):
    """Registered, but its URL does not answer the proxy's probes: the next answer says so, with the reason."""
    proxy = await make_proxy(probe_interval_s=0.1)
    gone = await make_engine("D")
    fields = gone.register_fields()
    await gone.close()  # nothing listens at its URL any more
    (first,) = await _answers(proxy, [_asking(fields)], 1)
    assert (first.status, first.reason) == ("registered", "")
    assert await proxy.registry.wait_for(lambda r: any(i.down_reason for i in r.known("D")), 5.0)
    (later,) = await _answers(proxy, [_asking(fields)], 1)
    assert (later.status, later.reason) == ("registered", "unreachable")
    assert gone.base_url in later.detail and "cannot reach" in later.detail and "advertise" in later.detail


async def test_an_unsigned_ping_to_a_proxy_with_a_token_is_told_the_engine_has_no_auth_token(make_proxy, make_engine):
    """Unsigned (``mac`` null, as an engine without ``auth_token`` sends it, or absent): the answer says the
    engine has no token and what to set, not that its MAC is wrong; a wrong MAC still says so."""
    proxy = await make_proxy(registration_token="s3cret")
    d = await make_engine("D")
    fields = d.register_fields()
    assert fields["mac"] is None  # the pinger's unsigned ping carries the null
    bare = {k: v for k, v in fields.items() if k not in ("ts", "nonce", "mac")}
    got = await _answers(proxy, [_asking(fields), _asking(bare), _asking(fields, "wrong")], 3)
    assert [(a.status, a.reason) for a in got] == [("refused", "token")] * 3
    for answer in got[:2]:
        assert "no auth_token" in answer.detail and "--registration-token" in answer.detail, answer.detail
        assert "wrong mac" not in answer.detail, answer.detail
    assert "no auth_token" not in got[2].detail and "wrong mac" in got[2].detail
    assert proxy.count("atom_kv_proxy_rejected_registrations_total", reason="auth") == 3
    assert proxy.registry.known("D") == []


async def test_an_engine_without_auth_token_logs_that_it_has_none(make_proxy, caplog):
    """The engine's own pinger, unsigned, against a proxy with a token: its warning names the missing token."""
    caplog.set_level(logging.WARNING, logger="atom_kv.discovery")
    proxy = await make_proxy(registration_token="s3cret")
    cfg = config("kv_consumer", 6400, proxy_ip=proxy.discovery_endpoint[len("tcp://"):], ping_interval_s=0.1)
    pinger = build_registration_pinger(cfg, role="D", index="0", http_host="127.0.0.1", http_port=8200,
                                       tp_size=1, engine_id="D-1").start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10.0
        while pinger.answers == 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
    finally:
        await asyncio.to_thread(pinger.close)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "atom_kv.discovery"]
    assert "(token)" in line and "no auth_token" in line and "set the engine's auth_token" in line, line
