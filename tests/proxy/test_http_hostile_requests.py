"""Hostile requests to the proxy's own HTTP server (issue 38, F5 to F8), from raw-socket clients:

* heads that announce a large ``Content-Length`` and send nothing take neither the body budget
  nor memory (a real proxy process, its RSS read from ``/proc``);
* a chunked body's trailers are dropped: neither engine sees a trailer's ``Authorization`` or
  ``X-Request-Id``, and the client never gets the trailer's request id back;
* the management routes match the raw path exactly: every other spelling of it is 404;
* requests read before a malformed one (or an upgrade) are answered, in order, before it.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from atom_kv.testing.polling import wait_until
from atom_kv.testing.procfs import rss_bytes
from atom_kv.testing.web import http_json as http
from tests.proxy.procs import FakeEngines, ProxyProcess
from tests.proxy.test_http_server import read_response

MiB = 1 << 20


def _completion(body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n%b"
            b"Content-Length: %d\r\n\r\n%b" % (extra, len(body), body))


# ------------------------------------------------------------------ F5
def _recv_until(sock: socket.socket, end: bytes) -> bytes:
    got = b""
    while end not in got:
        piece = sock.recv(4096)
        if not piece:
            raise ConnectionError(f"closed before {end!r}; got {got!r}")
        got += piece
    return got


def test_heads_that_announce_large_bodies_take_neither_the_budget_nor_memory():
    """Reproduction before the fix: 16 heads announcing 64 MiB each took the whole 1 GiB budget
    and grew the proxy by 1 GB; every other client got 503 until the body timeout."""
    heads, announced = 16, 16 * MiB
    engines = FakeEngines("--tokens", "2")
    proxy = ProxyProcess("--no-discovery", "--probe-interval", "0.2", "--prefill", engines.prefill[0],
                         "--decode", engines.decode[0], "--max-request-bytes", str(announced),
                         "--max-inflight-body-bytes", str(heads * announced), "--body-timeout", "60")
    held: list[socket.socket] = []
    try:
        wait_until(lambda: http("GET", proxy.url + "/health")[0] == 200, 15, interval=0.05, what="engines up")
        before = rss_bytes(proxy.proc.pid)
        for _ in range(heads):
            sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
            held.append(sock)
            # the head only; its 100 Continue says the proxy has taken it (and whatever it reserves for it)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % announced)
            assert _recv_until(sock, b"\r\n\r\n").startswith(b"HTTP/1.1 100 ")
        grown = rss_bytes(proxy.proc.pid) - before
        assert grown < 64 * MiB, f"the proxy grew by {grown / MiB:.0f} MiB for {heads} heads"
        status, answer = http("POST", proxy.url + "/v1/completions", {"prompt": "hello", "max_tokens": 2})
        assert status == 200, answer  # the budget is the bytes received, and none were
        for sock in held:  # and the heads still wait for their bodies (nothing refused them)
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)
    finally:
        for sock in held:
            sock.close()
        proxy.kill()
        engines.stop()


# ------------------------------------------------------------------ F6
async def test_trailers_never_become_headers(pd_pair):
    """Reproduction before the fix: a trailer's Authorization and X-Request-Id reached both engines
    as headers, and the client got the trailer's request id back."""
    proxy, p, d = await pd_pair()
    body = b'{"prompt": "hello", "max_tokens": 2}'
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.settings.port)
    try:
        for head_id in (b"", b"X-Request-Id: from-the-head\r\n"):
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n%b"
                         b"Transfer-Encoding: chunked\r\n\r\n" % head_id
                         + b"%x\r\n%b\r\n" % (10, body[:10]) + b"%x\r\n%b\r\n" % (len(body) - 10, body[10:])
                         + b"0\r\nAuthorization: Bearer from-the-trailer\r\nX-Request-Id: from-the-trailer\r\n\r\n")
            status, headers, answer = await read_response(reader)
            assert status == 200, answer
            assert headers["x-request-id"] != "from-the-trailer"
            if head_id:
                assert headers["x-request-id"] == "from-the-head"
        assert len(p.received) == 2 and len(d.received) == 2
        for seen in (*p.received, *d.received):
            assert seen.headers.getall("Authorization", []) == []
            assert "from-the-trailer" not in seen.headers.getall("X-Request-Id", [])
        assert [x.request_id for x in p.received][1] == "from-the-head"
    finally:
        writer.close()


async def test_trailers_count_against_the_head_limits(make_proxy):
    proxy = await make_proxy()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.settings.port)
    try:
        trailers = b"".join(b"X-T%d: y\r\n" % i for i in range(500))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"2\r\n{}\r\n0\r\n" + trailers + b"\r\n")
        status, headers, _ = await read_response(reader)
        assert status == 431 and headers["connection"] == "close"
    finally:
        writer.close()


async def test_a_trailer_that_never_ends_is_cut_at_the_head_limit(make_proxy):
    """A trailer line streamed without end: the parser would collect it whole (a copy per read)
    until the body timeout; it is cut off once it passes the head's size limit."""
    proxy = await make_proxy()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.settings.port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"2\r\n{}\r\n0\r\nX-Trailer: ")
        piece = b"a" * (64 << 10)
        try:
            for _ in range(64):
                writer.write(piece)
                await asyncio.wait_for(writer.drain(), 5.0)
        except ConnectionError:
            pass  # the proxy stopped listening once it answered
        status, headers, _ = await read_response(reader)
        assert status == 431 and headers["connection"] == "close"
    finally:
        writer.close()


# ------------------------------------------------------------------ F7
_SPELLINGS = [b"/%69nstances", b"/instance%73", b"//instances", b"/instances/", b"/./instances",
              b"/x/../instances", b"http://x/instances", b"http://x//instances", b"//metrics", b"/%6detrics",
              b"///health", b"/health/."]


async def _status(port: int, request: bytes) -> int:
    """The status of the answer to ``request`` (its head only: a HEAD's answer has no body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        return int(head.split(b" ", 2)[1])
    finally:
        writer.close()


@pytest.mark.parametrize("token", [None, "admin-9f3b"])
async def test_management_routes_match_the_raw_path_exactly(pd_pair, token):
    """Reproduction before the fix: with no admin token ``/%69nstances``, ``//instances`` and
    ``GET http://x/instances`` answered the instance list (200)."""
    proxy, _, _ = await pd_pair(proxy=dict(admin_token=token))
    port = proxy.settings.port
    auth = b"Authorization: Bearer %b\r\n" % token.encode() if token else b""
    for path in (b"/instances", b"/metrics", b"/health"):
        assert await _status(port, b"GET %b HTTP/1.1\r\nHost: localhost\r\n%b\r\n" % (path, auth)) == 200, path
    for path in _SPELLINGS:
        for method in (b"GET", b"HEAD"):
            request = b"%b %b HTTP/1.1\r\nHost: localhost\r\n%b\r\n" % (method, path, auth)
            assert await _status(port, request) == 404, request


# ------------------------------------------------------------------ F8
async def _answers(port: int, data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Every answer to ``data`` (one write), up to the connection's end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answers = []
    try:
        writer.write(data)
        while True:
            try:
                answers.append(await read_response(reader))
            except (asyncio.IncompleteReadError, ConnectionError):
                return answers
    finally:
        writer.close()


async def test_requests_read_before_a_malformed_one_are_answered_first(pd_pair):
    """Reproduction before the fix: one 400 came back and the client took it as the answer to its
    good request."""
    proxy, p, _ = await pd_pair()
    port = proxy.settings.port
    good = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
    answers = await _answers(port, good + b"HELLO THERE\r\n\r\n")
    assert [a[0] for a in answers] == [200, 400]
    assert json.loads(answers[0][2])["status"] == "ok" and answers[0][1].get("connection") != "close"
    assert answers[1][1]["connection"] == "close" and json.loads(answers[1][2])["error"]["code"] == 400

    body = b'{"prompt": "a", "max_tokens": 2}'
    answers = await _answers(port, _completion(body, b"X-Request-Id: one\r\n") + good
                             + _completion(body, b"X-Request-Id: two\r\n")
                             + b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
    assert [a[0] for a in answers] == [200, 200, 200, 400]
    assert [answers[0][1]["x-request-id"], answers[2][1]["x-request-id"]] == ["one", "two"]
    assert [x.request_id for x in p.received] == ["one", "two"]

    many = b"".join(b"X-%d: y\r\n" % i for i in range(500))  # a head over the header-line limit: 431
    answers = await _answers(port, good + good + b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + many + b"\r\n")
    assert [a[0] for a in answers] == [200, 200, 431]


async def test_requests_read_before_an_upgrade_are_answered_and_it_ends_the_connection(pd_pair):
    proxy, _, _ = await pd_pair()
    good = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
    upgrade = b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n"
    answers = await _answers(proxy.settings.port, good + good + upgrade + good)
    assert [a[0] for a in answers] == [200, 200, 200]  # the one after the upgrade is never read
    assert [a[1].get("connection") for a in answers] == [None, None, "close"]
