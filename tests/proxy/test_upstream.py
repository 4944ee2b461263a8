"""The relay's pooled HTTP/1.1 client against real servers: a fake engine, and raw TCP
peers that misbehave on purpose (not HTTP, silent, closing mid-answer, EOF-delimited bodies)."""

from __future__ import annotations

import asyncio
import json

import pytest

from atom_kv.proxy.http.upstream import (
    UpstreamConnectionError, UpstreamConnectTimeout, UpstreamPool, UpstreamTimeout,
)
from atom_kv.testing.ports import free_port


def _head(path: str, host: bytes, length: int) -> bytes:
    return (b"POST %b HTTP/1.1\r\nhost: %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % (path.encode(), host, length))


class RawPeer:
    """A TCP server whose answer to each request is ``respond(reader, writer)``; counts connections."""

    def __init__(self, respond) -> None:
        self.respond = respond
        self.connections = 0
        self.open = 0
        self.max_open = 0
        self.closed = asyncio.Event()
        self.accepted = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> "RawPeer":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        self.accepted.set()
        self.open += 1
        self.max_open = max(self.max_open, self.open)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await reader.readexactly(length)
                if not await self.respond(reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.open -= 1
            writer.close()
            self.closed.set()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _ok(body: bytes = b'{"ok": true}', delay: float = 0.0):
    async def respond(reader, writer) -> bool:
        if delay:
            await asyncio.sleep(delay)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                     % (len(body), body))
        await writer.drain()
        return True
    return respond


@pytest.fixture
async def pool():
    pools = []

    def make(**kw) -> UpstreamPool:
        p = UpstreamPool(connect_timeout=kw.pop("connect_timeout", 2.0), **kw)
        pools.append(p)
        return p

    yield make
    for p in pools:
        await p.close()


async def test_keep_alive_reuses_one_connection_per_host(pool, make_engine):
    engine = await make_engine("P")
    up = pool()
    for _ in range(3):
        payload = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
        resp = await up.request("127.0.0.1", engine.port, _head("/v1/completions", b"h", len(payload)), payload,
                                whole=True, total_timeout=5.0)
        assert resp.status == 200 and json.loads(await resp.read())["choices"]
    assert len({r.peer for r in engine.received}) == 1
    assert up.open_connections == 1 and up.idle_connections("127.0.0.1", engine.port) == 1


async def test_idle_connections_close_after_keepalive(pool):
    peer = await RawPeer(_ok()).start()
    up = pool(keepalive_s=0.2)
    resp = await up.request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True)
    assert await resp.read() == b'{"ok": true}'
    await asyncio.wait_for(peer.closed.wait(), 5.0)  # the pool closed it once idle for keepalive_s
    assert up.open_connections == 0
    resp = await up.request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True)
    assert await resp.read() == b'{"ok": true}' and peer.connections == 2
    await peer.close()


async def test_the_connection_limit_queues_requests_within_the_connect_timeout(pool):
    peer = await RawPeer(_ok(delay=0.2)).start()
    up = pool(limit=1, connect_timeout=5.0)

    async def one() -> bytes:
        resp = await up.request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True)
        return await resp.read()

    assert await asyncio.gather(*(one() for _ in range(4))) == [b'{"ok": true}'] * 4
    assert peer.max_open == 1 and peer.connections == 1
    tight = pool(limit=1, connect_timeout=0.1)
    first = asyncio.create_task(tight.request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True))
    await asyncio.sleep(0)  # the first request holds the only connection...
    with pytest.raises(UpstreamConnectTimeout):  # ...so the second cannot get one in time
        await tight.request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True)
    assert await (await first).read() == b'{"ok": true}'
    await peer.close()


async def test_refused_connect_is_a_connection_error(pool):
    up = pool()
    with pytest.raises(UpstreamConnectionError, match="cannot connect"):
        await up.request("127.0.0.1", free_port(), _head("/", b"h", 0))


async def test_an_answer_that_is_not_http_is_a_connection_error(pool):
    async def garbage(reader, writer) -> bool:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        return True

    peer = await RawPeer(garbage).start()
    with pytest.raises(UpstreamConnectionError, match="invalid HTTP"):
        await pool().request("127.0.0.1", peer.port, _head("/", b"h", 0))
    await peer.close()


async def test_a_body_delimited_by_the_connection_end_is_read_whole(pool):
    async def eof_body(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it")
        return False  # and close

    peer = await RawPeer(eof_body).start()
    up = pool()
    resp = await up.request("127.0.0.1", peer.port, _head("/", b"h", 0))
    assert resp.status == 200 and await resp.read() == b"all of it"
    assert up.open_connections == 0  # not reusable
    await peer.close()


async def test_a_peer_closing_mid_body_fails_the_read_and_the_stream(pool):
    async def cut(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()
        return False

    peer = await RawPeer(cut).start()
    up = pool()
    resp = await up.request("127.0.0.1", peer.port, _head("/", b"h", 0))
    with pytest.raises(UpstreamConnectionError, match="mid-answer"):
        await resp.read()

    class Consumer:
        def __init__(self) -> None:
            self.data = b""
            self.failed = asyncio.Event()
            self.error = None

        def body_received(self, data: bytes) -> None:
            self.data += data

        def body_complete(self) -> None:
            raise AssertionError("the body was cut short")

        def body_failed(self, exc) -> None:
            self.error = exc
            self.failed.set()

    resp = await up.request("127.0.0.1", peer.port, _head("/", b"h", 0))
    consumer = Consumer()
    resp.stream(consumer)
    await asyncio.wait_for(consumer.failed.wait(), 5.0)
    assert consumer.data == b"only part" and isinstance(consumer.error, UpstreamConnectionError)
    await peer.close()


async def test_read_and_total_timeouts(pool):
    async def silent_after_head(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345")
        await writer.drain()
        await asyncio.sleep(30)
        return False

    async def trickle(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n")
        for _ in range(50):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.05)
        return True

    loop = asyncio.get_running_loop()
    peer = await RawPeer(silent_after_head).start()
    up = pool()
    resp = await up.request("127.0.0.1", peer.port, _head("/", b"h", 0), read_timeout=0.3)
    t0 = loop.time()
    with pytest.raises(UpstreamTimeout):
        await resp.read()
    assert 0.1 < loop.time() - t0 < 2.0
    await peer.close()
    # a peer that keeps sending never trips the read timeout, but the total one still ends the exchange
    peer = await RawPeer(trickle).start()
    t0 = loop.time()
    with pytest.raises(UpstreamTimeout, match="whole exchange"):
        await up.request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True, read_timeout=0.3,
                         total_timeout=0.8)
    assert 0.6 < loop.time() - t0 < 2.0
    await peer.close()


async def test_cancelling_a_request_drops_its_connection(pool):
    async def until_the_client_leaves(reader, writer) -> bool:
        return await reader.read() != b""

    peer = await RawPeer(until_the_client_leaves).start()
    up = pool()
    task = asyncio.create_task(up.request("127.0.0.1", peer.port, _head("/", b"h", 0), whole=True))
    await asyncio.wait_for(peer.accepted.wait(), 5.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(peer.closed.wait(), 5.0)  # the peer sees the request abandoned
    assert up.open_connections == 0
    await peer.close()
