"""The HTTP server under attack: pipelining without reading, head and header-count limits,
encoded slashes, and the in-flight body budget."""

from __future__ import annotations

import asyncio
import socket

import msgspec

from atom_kv.proxy.http.httpserver import Exchange, HTTPServer
from atom_kv.proxy.server import listen_socket
from tests.proxy.test_http_server import read_response

ANSWER = b"m" * 4096


async def _metrics(exchange: Exchange) -> None:
    if exchange.refusal is not None:
        await _nothing(exchange)
        return
    exchange.respond(200, [(b"content-type", b"text/plain")], ANSWER)


async def _nothing(exchange: Exchange) -> None:
    if exchange.refusal is not None:
        exchange.respond(exchange.refusal[0], [], exchange.refusal[1].encode(), close=True)
        return
    exchange.respond(404, [], b"")


async def _serve(**kw) -> tuple[HTTPServer, int]:
    server = HTTPServer({"/metrics": _metrics}, _nothing, header_timeout=5.0, body_timeout=5.0,
                        max_request_bytes=1 << 20, **kw)
    sock = listen_socket("127.0.0.1", 0, 16)
    await server.start(sock, 16)
    return server, sock.getsockname()[1]


def _small_client(port: int) -> socket.socket:
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect(("127.0.0.1", port))
    raw.setblocking(False)
    return raw


async def test_a_pipelining_client_that_never_reads_costs_one_buffer_not_a_growing_heap():
    """Today's reproduction: pipelined ``GET /metrics`` without reading grew the proxy ~8 MB/s."""
    server, port = await _serve(max_pipelined=1 << 20)  # only back-pressure bounds it here
    loop = asyncio.get_running_loop()
    raw = _small_client(port)
    try:
        batch = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 16
        deadline = loop.time() + 1.0
        sent = 0
        while loop.time() < deadline:
            try:
                sent += raw.send(batch)  # the server stops reading: our own send buffer fills up
            except BlockingIOError:
                await asyncio.sleep(0.02)
            else:
                await asyncio.sleep(0)
        (conn,) = server.connections
        buffered = conn.transport.get_write_buffer_size()
        queued = len(conn.queue)
        assert buffered < 256 * 1024, buffered  # the high-water mark (64 KiB) plus one answer, not megabytes
        assert queued <= 2 * 65536 // len(batch) * 16, queued  # at most about one read's worth waits
        assert conn.reading_paused and conn.writing_paused
        # once the client reads, every request read so far is answered in order
        raw.setblocking(True)
        raw.settimeout(5.0)
        reader, writer = await asyncio.open_connection(sock=raw)
        for _ in range(40):
            status, _, body = await read_response(reader)
            assert status == 200 and body == ANSWER
        writer.close()
    finally:
        await server.shutdown(1.0)


async def test_too_many_pipelined_requests_in_one_read_are_429_and_the_connection_ends():
    server, port = await _serve(max_pipelined=4)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 50)
        statuses = []
        while True:
            try:
                statuses.append((await read_response(reader))[0])
            except (asyncio.IncompleteReadError, ConnectionError):
                break
        # the one in progress is dispatched at once; 4 wait; the next is refused; nothing more is taken
        assert statuses[-1] == 429 and set(statuses[:-1]) == {200} and len(statuses) <= 6, statuses
        writer.close()
    finally:
        await server.shutdown(1.0)


async def _one_answer(port: int, request: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return (await read_response(reader))[0]
    finally:
        writer.close()


async def test_one_limit_for_the_whole_head_and_one_for_the_header_count(pd_pair):
    """Today's reproduction: an 89 KB head of 9,000 headers in one read got 200."""
    proxy, _, _ = await pd_pair()
    port = proxy.settings.port
    many = b"".join(b"X-%d: y\r\n" % i for i in range(9000))
    assert await _one_answer(port, b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + many + b"\r\n") == 431
    big = b"".join(b"X-%d: %b\r\n" % (i, b"v" * 7000) for i in range(10))  # 70 KB, few lines
    assert await _one_answer(port, b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + big + b"\r\n") == 431
    fine = b"".join(b"X-%d: y\r\n" % i for i in range(50))
    assert await _one_answer(port, b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + fine + b"\r\n") == 200


async def test_encoded_slashes_never_reach_a_route(pd_pair):
    """Today's reproduction: ``/v1%2Fcompletions`` reached the completions handler."""
    proxy, p, _ = await pd_pair()
    port = proxy.settings.port
    body = b'{"prompt": "a", "max_tokens": 1}'
    for path in (b"/v1%2Fcompletions", b"/v1%2fcompletions", b"/v1%5Ccompletions"):
        request = (b"POST %b HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                   % (path, len(body), body))
        assert await _one_answer(port, request) == 400
    request = (b"POST /v1/%%63ompletions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    assert await _one_answer(port, request) in (404, 405)  # routed on the raw path: not the completions route
    assert p.received == []


async def _budget_reaches(server: HTTPServer, held: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 4
    while server.body_in_flight != held and loop.time() < deadline:
        await asyncio.sleep(0.01)
    assert server.body_in_flight == held


async def test_bodies_in_flight_share_one_budget_past_which_the_answer_is_503():
    """The budget counts the bytes that arrived: a head that announces a body reserves nothing
    (before: it reserved its ``Content-Length`` and a zeroed buffer of that size at once)."""
    async def echo(exchange: Exchange) -> None:
        if exchange.refusal is not None:
            await _nothing(exchange)
            return
        exchange.respond(200, [], b"%d" % len(exchange.body_view()))

    server = HTTPServer({"/echo": echo}, _nothing, header_timeout=5.0, body_timeout=5.0, max_request_bytes=1 << 20,
                        body_budget=100_000)
    sock = listen_socket("127.0.0.1", 0, 16)
    await server.start(sock, 16)
    port = sock.getsockname()[1]
    heads = []
    try:
        for _ in range(3):  # heads alone, each announcing more than half the budget
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 60000\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            assert head.startswith(b"HTTP/1.1 100 ")  # the head was taken
            heads.append(writer)
        assert server.body_in_flight == 0
        slow_r, slow_w = await asyncio.open_connection("127.0.0.1", port)
        slow_w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 90000\r\n\r\n" + b"a" * 80_000)
        await slow_w.drain()
        await _budget_reaches(server, 80_000)  # what arrived, not what was announced
        big = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 40000\r\n\r\n" + b"b" * 40_000
        assert await _one_answer(port, big) == 503  # once its bytes pass the budget
        chunked = (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                   + b"%x\r\n%b\r\n" % (30_000, b"c" * 30_000) + b"0\r\n\r\n")
        assert await _one_answer(port, chunked) == 503
        await _budget_reaches(server, 80_000)  # the refused ones gave back what they had taken
        slow_w.write(b"a" * 10_000)
        status, _, body = await read_response(slow_r)
        assert status == 200 and body == b"90000"
        assert await _one_answer(port, big) == 200  # the first body's answer gave its share back
        assert server.body_in_flight == 0
        slow_w.close()
    finally:
        for writer in heads:
            writer.close()
        await server.shutdown(1.0)


async def test_a_large_body_is_held_once_not_three_times():
    """Today's reproduction: a 60 MB body took 180 MB of proxy memory (its pieces, their join, the parse)."""
    import tracemalloc

    from atom_kv.proxy.relay.fastpath import parse_body

    size = 16 << 20
    parsed = {}

    async def parse(exchange: Exchange) -> None:  # what the completions route does before its first leg
        request = parse_body(exchange.body_view())
        exchange.drop_body()
        leg = msgspec.json.encode(request)
        parsed["prompt"] = len(request["prompt"])
        del request
        await asyncio.sleep(0)
        exchange.respond(200, [], b"%d" % len(leg))

    server = HTTPServer({"/parse": parse}, _nothing, header_timeout=5.0, body_timeout=30.0,
                        max_request_bytes=64 << 20)
    sock = listen_socket("127.0.0.1", 0, 16)
    await server.start(sock, 16)
    port = sock.getsockname()[1]
    body = b'{"prompt": "' + b"p" * (size - 14) + b'"}'
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /parse HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 1 << 20):
            writer.write(body[i:i + (1 << 20)])
            await writer.drain()
        assert (await read_response(reader, timeout=30.0))[0] == 200
        peak = tracemalloc.get_traced_memory()[1] - base
        writer.close()
    finally:
        tracemalloc.stop()
        await server.shutdown(1.0)
    assert parsed["prompt"] == size - 14
    # the parsed body and its leg (the encoder over-allocates by half); never raw + parsed + leg
    assert peak < 3 * size, peak / size
