"""The proxy's HTTP/1.1 server on raw sockets: keep-alive, pipelining, bounded heads and bodies,
100-continue, HTTP/1.0, malformed input, back-pressure and graceful shutdown."""

from __future__ import annotations

import asyncio
import json
import socket

import msgspec

from atom_kv.proxy.http.httpserver import Exchange, HTTPServer
from atom_kv.proxy.server import listen_socket


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def read_response(reader: asyncio.StreamReader, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer: status, headers (lower-case names), body (content-length, chunked or to EOF)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), timeout)
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout)).strip(), 16)
            chunk = await asyncio.wait_for(reader.readexactly(size + 2), timeout)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = await asyncio.wait_for(reader.read(), timeout)
    return status, headers, body


def _post(path: str, body: dict, extra: str = "", version: str = "1.1") -> bytes:
    data = msgspec.json.encode(body)
    return (f"POST {path} HTTP/{version}\r\nHost: localhost\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


async def test_keep_alive_and_pipelined_requests_are_answered_in_order(pd_pair):
    proxy, p, d = await pd_pair()
    reader, writer = await _open(proxy.settings.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
                 + _post("/v1/completions", {"prompt": "a", "max_tokens": 2}, "X-Request-Id: one\r\n")
                 + _post("/v1/completions", {"prompt": "b", "max_tokens": 3, "stream": True}, "X-Request-Id: two\r\n")
                 + b"GET /nowhere HTTP/1.1\r\nHost: localhost\r\n\r\n")
    await writer.drain()
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, headers, body = await read_response(reader)
    assert status == 200 and headers["x-request-id"] == "one" and json.loads(body)["choices"][0]["text"] == " t0 t1"
    status, headers, body = await read_response(reader)
    assert status == 200 and headers["x-request-id"] == "two" and headers["transfer-encoding"] == "chunked"
    assert body.endswith(b"data: [DONE]\n\n") and body.count(b"\n\n") == 4
    status, _, body = await read_response(reader)
    assert status == 404 and json.loads(body)["error"]["code"] == 404
    # the same connection still serves
    writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert (await read_response(reader))[0] == 200
    writer.close()
    assert [x.request_id for x in p.received] == ["one", "two"]


async def test_idle_keep_alive_connection_is_closed_after_the_header_timeout(make_proxy):
    proxy = await make_proxy(header_timeout=0.5)
    reader, writer = await _open(proxy.settings.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert (await read_response(reader))[0] == 503
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await asyncio.wait_for(reader.read(), 5.0) == b""  # closed by the proxy
    assert 0.3 < loop.time() - t0 < 3.0
    writer.close()


async def test_oversized_head_is_431(make_proxy):
    proxy = await make_proxy()
    reader, writer = await _open(proxy.settings.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 100_000)  # no end of head in sight
    await writer.drain()
    status, headers, body = await read_response(reader)
    assert status == 431 and headers["connection"] == "close" and json.loads(body)["error"]["code"] == 431
    assert await asyncio.wait_for(reader.read(), 5.0) == b""
    writer.close()


async def test_content_length_over_the_limit_is_413_at_once_on_every_route(make_proxy):
    proxy = await make_proxy(max_request_bytes=1024)
    for path in ("/health", "/v1/completions", "/v1/chat/completions"):
        reader, writer = await _open(proxy.settings.port)
        writer.write(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nX-Request-Id: big\r\n"
                     "Content-Length: 1000000000\r\n\r\n".encode())  # the body never comes: answered anyway
        status, headers, body = await read_response(reader)
        assert status == 413 and headers["connection"] == "close", path
        assert json.loads(body)["error"]["code"] == 413 and b"1024 bytes" in body
        writer.close()
    assert proxy.count("atom_kv_proxy_requests_total", endpoint="/v1/completions", status="413") == 1


async def test_chunked_body_over_the_limit_is_413(make_proxy):
    proxy = await make_proxy(max_request_bytes=1024)
    reader, writer = await _open(proxy.settings.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
                 + b"400\r\n" + b"x" * 1024 + b"\r\n" + b"1\r\ny\r\n")
    status, _, body = await read_response(reader)
    assert status == 413 and json.loads(body)["error"]["code"] == 413
    writer.close()


async def test_expect_100_continue_is_answered_before_the_body(pd_pair):
    proxy, p, d = await pd_pair()
    reader, writer = await _open(proxy.settings.port)
    data = msgspec.json.encode({"prompt": "x", "max_tokens": 2})
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(data)
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["choices"][0]["text"] == " t0 t1"
    writer.close()


async def test_http_1_0_stream_ends_with_the_connection(pd_pair):
    proxy, p, d = await pd_pair()
    reader, writer = await _open(proxy.settings.port)
    writer.write(_post("/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True}, version="1.0"))
    status, headers, body = await read_response(reader)  # no length, not chunked: read to EOF
    assert status == 200 and "transfer-encoding" not in headers and headers["connection"] == "close"
    assert body.startswith(b"data: {") and body.endswith(b"data: [DONE]\n\n") and body.count(b"\n\n") == 4
    writer.close()


async def test_malformed_request_is_400_and_closed(make_proxy):
    proxy = await make_proxy()
    reader, writer = await _open(proxy.settings.port)
    writer.write(b"HELLO THERE\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert status == 400 and headers["connection"] == "close" and json.loads(body)["error"]["code"] == 400
    assert await asyncio.wait_for(reader.read(), 5.0) == b""
    writer.close()


async def test_graceful_shutdown_finishes_streams_in_flight_and_closes_idle_connections(make_proxy, make_engine):
    from tests.proxy.fake_engine import register

    proxy = await make_proxy(shutdown_timeout=5.0)
    p, d = await make_engine("P"), await make_engine("D", token_delay_s=0.05)
    await register(proxy, p, d)
    idle_reader, idle_writer = await _open(proxy.settings.port)
    reader, writer = await _open(proxy.settings.port)
    writer.write(_post("/v1/completions", {"prompt": "x", "max_tokens": 10, "stream": True}))
    await asyncio.wait_for(reader.readuntil(b"data: "), 5.0)  # streaming is under way
    stopping = asyncio.create_task(proxy.stop())
    assert await asyncio.wait_for(idle_reader.read(), 5.0) == b""  # the idle connection is closed at once
    rest = await asyncio.wait_for(reader.read(), 5.0)  # the stream runs to its end, then the connection closes
    assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    await asyncio.wait_for(stopping, 10.0)
    assert d.completed and d.cancelled == []
    for w in (writer, idle_writer):
        w.close()


async def test_shutdown_timeout_cuts_a_request_still_running(make_proxy, make_engine):
    from tests.proxy.fake_engine import register

    proxy = await make_proxy(shutdown_timeout=0.3)
    p, d = await make_engine("P"), await make_engine("D", token_delay_s=0.2)
    await register(proxy, p, d)
    reader, writer = await _open(proxy.settings.port)
    writer.write(_post("/v1/completions", {"prompt": "x", "max_tokens": 100, "stream": True}, "X-Request-Id: cut\r\n"))
    await asyncio.wait_for(reader.readuntil(b"data: "), 5.0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await asyncio.wait_for(proxy.stop(), 10.0)
    assert loop.time() - t0 < 3.0
    rest = await asyncio.wait_for(reader.read(), 5.0)
    assert b"[DONE]" not in rest  # dropped mid-stream
    assert await d.wait_until(lambda: d.cancelled == ["cut"], 3.0)  # and the decode engine saw it abandoned
    writer.close()


class _Producer:
    """Counts back-pressure calls (the producer side of a streamed answer)."""

    def __init__(self) -> None:
        self.paused = 0
        self.resumed = 0
        self.resumed_event = asyncio.Event()
        self.blocked = asyncio.Event()

    def pause_reading(self) -> None:
        self.paused += 1
        self.resumed_event.clear()

    def resume_reading(self) -> None:
        self.resumed += 1
        self.resumed_event.set()


async def test_a_client_that_does_not_read_pauses_the_producer():
    """A route that streams 64 MiB, waiting whenever the server pauses it, to a client that
    reads nothing at first: the route ends up waiting with most of it unwritten; once the
    client reads, the server resumes it and everything arrives."""
    producer = _Producer()
    piece = b"z" * (1 << 20)
    written = 0

    async def big(exchange: Exchange) -> None:
        nonlocal written
        exchange.start_stream(200, [(b"content-type", b"application/octet-stream")])
        exchange.set_producer(producer)
        for _ in range(64):
            exchange.write(piece)
            written += 1
            if producer.paused > producer.resumed:
                producer.blocked.set()
                await producer.resumed_event.wait()
        exchange.end()

    async def nothing(exchange: Exchange) -> None:
        exchange.respond(404, [], b"")

    server = HTTPServer({"/big": big}, nothing, header_timeout=5.0, body_timeout=5.0, max_request_bytes=1024)
    sock = listen_socket("127.0.0.1", 0, 16)
    await server.start(sock, 16)
    try:
        raw = socket.create_connection(sock.getsockname()[:2])
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        reader, writer = await asyncio.open_connection(sock=raw, limit=1 << 16)
        writer.write(b"GET /big HTTP/1.1\r\nHost: localhost\r\n\r\n")
        await writer.drain()
        await asyncio.wait_for(producer.blocked.wait(), 10.0)  # paused: the buffers are full
        assert producer.paused >= 1 and written < 64
        status, _, body = await read_response(reader, timeout=30.0)
        assert status == 200 and len(body) == 64 << 20 and written == 64
        assert producer.resumed >= 1
        writer.close()
    finally:
        await server.shutdown(1.0)
