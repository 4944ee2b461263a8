"""Interim (1xx) and upgrade answers from an engine (issue 38, F3 and F4): the upstream client against raw TCP
peers. Only a final answer is ever an exchange's answer, the next request on the pool gets its own answer,
and a 101 (or any upgrade) fails the exchange at once and closes its connection, with nothing left for
the event loop to report."""

from __future__ import annotations

import asyncio

import pytest

from atom_kv.proxy.http.upstream import AnswerLimits, UpstreamProtocolError, UpstreamTooLarge
from tests.proxy.test_upstream import RawPeer, _head, pool  # noqa: F401 - pool is a fixture

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\nx-interim: yes\r\n\r\n"
PROCESSING = b"HTTP/1.1 102 Processing\r\n\r\n"
INTERIMS = {
    "100": [CONTINUE],
    "103": [EARLY_HINTS],
    "100-then-103": [CONTINUE, EARLY_HINTS],
    "102-then-199": [PROCESSING, b"HTTP/1.1 199 Whatever\r\ncontent-length: 0\r\n\r\n"],
}
UPGRADES = {
    "101": b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
    "upgrade": b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
               b"sec-websocket-accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n\x81\x05hello",
    "100-then-upgrade": CONTINUE + b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: Upgrade\r\n\r\n",
}


def _final(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b\r\n%b"
            % (len(body), extra, body))


@pytest.fixture
async def loop_errors():
    """What the event loop would report (a transport's fatal error: the traceback in the proxy's log)."""
    loop = asyncio.get_running_loop()
    seen: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    yield seen
    loop.set_exception_handler(previous)


async def _answer(up, port: int, mode: str) -> tuple[int, dict[str, str], bytes]:
    if mode == "fetch":  # what health probes, /v1/models and /tokenize use
        return await up.fetch("127.0.0.1", port, b"POST", b"/tokenize", body=b"{}", total_timeout=2.0)
    resp = await up.request("127.0.0.1", port, _head("/", b"h", 0), whole=mode == "whole", read_timeout=2.0,
                            total_timeout=2.0)
    return resp.status, resp.headers, await resp.read()


@pytest.mark.parametrize("mode", ["whole", "stream", "fetch"])
@pytest.mark.parametrize("name", list(INTERIMS))
async def test_interim_answers_are_read_past_and_the_next_request_gets_its_own_answer(pool, loop_errors, name,
                                                                                       mode):
    """The engine sends its interim answers, then works a while, then answers: each request gets its own
    final answer, and the pooled connection serves the next one. Before: the 1xx was the answer, and the
    next request on the pool read the previous one's 200."""
    answers = iter([b'{"for": "first"}', b'{"for": "second"}'])

    async def respond(reader, writer) -> bool:
        writer.write(b"".join(INTERIMS[name]))
        await writer.drain()
        await asyncio.sleep(0.1)  # the final answer comes in a later read
        writer.write(_final(next(answers)))
        await writer.drain()
        return True

    peer = await RawPeer(respond).start()
    up = pool()
    for want in (b'{"for": "first"}', b'{"for": "second"}'):
        status, headers, body = await asyncio.wait_for(_answer(up, peer.port, mode), 5)
        assert (status, body) == (200, want)
        assert "x-interim" not in headers and "link" not in headers  # nothing of an interim answer
    assert peer.connections == 1  # a clean exchange leaves its connection in the pool
    assert loop_errors == []
    await peer.close()


@pytest.mark.parametrize("name", list(INTERIMS))
async def test_interim_answers_in_the_same_read_as_the_final_one(pool, name):
    """The interim heads and the final answer in one read: the final answer, none of the interim headers."""
    peer = await RawPeer(_respond_with(b"".join(INTERIMS[name]) + _final(b"{}", b"x-final: 1\r\n"))).start()
    resp = await pool().request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True, total_timeout=2.0)
    assert resp.status == 200 and await resp.read() == b"{}"
    assert resp.header("x-final") == "1" and "x-interim" not in resp.headers
    await peer.close()


def _respond_with(data: bytes, hold: bool = False):
    async def respond(reader, writer) -> bool:
        writer.write(data)
        await writer.drain()
        if hold:  # as an upgraded server would: keep the connection until the client closes it
            await reader.read()
            return False
        return True
    return respond


@pytest.mark.parametrize("mode", ["whole", "stream", "fetch"])
@pytest.mark.parametrize("name", list(UPGRADES))
async def test_an_upgrade_fails_at_once_and_closes_its_connection(pool, loop_errors, name, mode):
    """Before: the exchange hung past its total timeout (the 101 counted as a complete answer, so the
    timer and the connection's end had nothing to fail), and the upgrade one logged a traceback."""
    peer = await RawPeer(_respond_with(UPGRADES[name], hold=True)).start()
    up = pool()
    with pytest.raises(UpstreamProtocolError, match=r"answered 101 \(Switching Protocols\), an upgrade"):
        await asyncio.wait_for(_answer(up, peer.port, mode), 5)
    await asyncio.wait_for(peer.closed.wait(), 5)  # the proxy closed it: never pooled
    assert up.open_connections == 0 and up.idle_connections("127.0.0.1", peer.port) == 0
    assert loop_errors == []
    await peer.close()


@pytest.mark.parametrize("interim", [
    b"HTTP/1.1 150 Odd\r\ncontent-length: 3\r\n\r\nabc",
    b"HTTP/1.1 100 Continue\r\ntransfer-encoding: chunked\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\ncontent-length: 12\r\n\r\n",
])
async def test_an_interim_answer_that_announces_a_body_is_refused(pool, interim):
    peer = await RawPeer(_respond_with(interim + _final(b"{}"))).start()
    up = pool()
    with pytest.raises(UpstreamProtocolError, match="interim answer 1.. announces a body"):
        await up.request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True, total_timeout=2.0)
    assert up.open_connections == 0
    await peer.close()


async def test_interim_answers_are_bounded_in_count_and_share_the_head_bound(pool):
    peer = await RawPeer(_respond_with(CONTINUE * 5 + _final(b"{}"))).start()
    up = pool(limits=AnswerLimits(interim=4))
    with pytest.raises(UpstreamProtocolError, match="more than 4 interim"):
        await up.request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True, total_timeout=2.0)
    await peer.close()
    hint = b"HTTP/1.1 103 Early Hints\r\nlink: " + b"l" * 20_000 + b"\r\n\r\n"
    peer = await RawPeer(_respond_with(hint * 2 + _final(b"{}", b"x-big: " + b"b" * 20_000 + b"\r\n"))).start()
    with pytest.raises(UpstreamTooLarge, match=r"--max-upstream-head-bytes \(49152\)"):
        await pool(limits=AnswerLimits(head=48 * 1024)).request("127.0.0.1", peer.port, _head("/", b"h", 0),
                                                                whole=True, total_timeout=2.0)
    await peer.close()


@pytest.mark.parametrize("line", [b"HTTP/1.1 099 Low", b"HTTP/1.1 600 High", b"HTTP/1.1 999 Higher"])
async def test_a_status_outside_100_599_is_refused(pool, line):
    peer = await RawPeer(_respond_with(line + b"\r\ncontent-length: 2\r\n\r\n{}")).start()
    with pytest.raises(UpstreamProtocolError, match="outside 100..599"):
        await pool().request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True, total_timeout=2.0)
    await peer.close()


async def test_trailers_are_never_answer_headers(pool):
    chunked = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
               b"2\r\n{}\r\n0\r\ncontent-type: text/evil\r\nx-trailer: 1\r\n\r\n")
    peer = await RawPeer(_respond_with(chunked)).start()
    resp = await pool().request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True, total_timeout=2.0)
    assert await resp.read() == b"{}"
    assert resp.header("content-type") == "application/json" and "x-trailer" not in resp.headers
    await peer.close()


async def test_bytes_after_the_answer_are_no_answer_and_close_the_connection(pool):
    """An engine that sends a second answer after the first (to whatever comes next on the connection):
    the first stands, the second is nobody's, and the next request goes out on a new connection."""
    stale = _final(b'{"for": "nobody"}')
    answers = iter([_final(b'{"for": "first"}') + stale, _final(b'{"for": "second"}')])

    async def respond(reader, writer) -> bool:
        writer.write(next(answers))
        await writer.drain()
        return True

    peer = await RawPeer(respond).start()
    up = pool()
    for want in (b'{"for": "first"}', b'{"for": "second"}'):
        resp = await up.request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True, total_timeout=2.0)
        assert (resp.status, await resp.read()) == (200, want)
    assert peer.connections == 2
    await peer.close()
