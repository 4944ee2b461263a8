"""A lean pooled HTTP/1.1 client for the relay's two legs (prefill and decode).

Why not aiohttp here: its per-request machinery (request and response
objects, timeout contexts, payload wrappers, a stream reader woken once per
chunk) was a third of the proxy's CPU per request (``python -m atom_kv.bench
proxy``, py-spy). The two legs need little: POST a JSON body, then either read
a whole answer (prefill) or pass a body through as it arrives (decode). This
client does exactly that on an :class:`asyncio.Protocol` with httptools' C
parser, and delivers a streamed body to a consumer from the protocol's own
callbacks, with no task wake-up per chunk. It is the proxy's one upstream
client: health probes, ``/v1/models`` and ``/tokenize`` go through it too
(:meth:`UpstreamPool.fetch`), at half aiohttp's CPU per exchange as well.

:class:`UpstreamPool` owns the connections: per ``(host, port)`` idle stacks
(most recently used first, idle ones closed after ``keepalive_s``), at most
``limit`` open connections (0: no limit; a request waits for a slot, within
its connect timeout). Every wait is bounded: ``connect_timeout`` covers
getting a connection (slot and TCP connect), ``read_timeout`` the longest
silence from the peer (before its headers or between two pieces of body),
``total_timeout`` the whole exchange.

Engine answers are bounded like client requests: a head (status line and
headers) over ``max_head_bytes`` fails before any of it is parsed. A head
split over several reads is collected in a bytearray and given to the parser
whole, once its end arrived: httptools joins the pieces of a header value
that come in separate feeds with ``bytes +=`` (quadratic in the value's size),
so it never sees one in pieces. A ``Server-Timing`` value over
``max_server_timing_bytes`` is dropped unread, and more than ``max_body_bytes`` of body held at once (an
answer read whole; a streamed one is handed on as it arrives) fails the
exchange, at once when its ``Content-Length`` says so.

An exchange's answer is always a final one (200..599): interim answers (1xx:
``100 Continue``, ``103 Early Hints``, ...) are read past and dropped, never
returned (a caller that took one for the answer would leave the real answer
unread on a pooled connection, for the next request to read as its own). A
101, or any upgrade, fails the exchange at once and closes its connection,
as does an interim answer that announces a body or comes past
``AnswerLimits.interim`` (16). The heads of one answer, interim ones
included, share ``max_head_bytes``. Trailers are dropped, and bytes after the
end of an answer close its connection rather than wait in the pool for the
next request.

Failures are :class:`UpstreamError` subclasses: :class:`UpstreamConnectTimeout`,
:class:`UpstreamTimeout` (a :class:`TimeoutError`),
:class:`UpstreamConnectionError` (a :class:`ConnectionError`: refused, reset,
closed before the answer ended), :class:`UpstreamProtocolError` (an
:class:`UpstreamConnectionError` too: not HTTP, an upgrade, or a refused
interim answer, as above) and :class:`UpstreamTooLarge` (an answer over the
bounds above; the message names the proxy flag).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from typing import cast

from atom_kv.proxy.http.upstream_answer import (
    AnswerLimits, BodyConsumer, UpstreamConnectionError, UpstreamConnectTimeout, UpstreamError, UpstreamProtocolError,
    UpstreamResponse, UpstreamTimeout, UpstreamTooLarge,
)

__all__ = [
    "UpstreamPool", "UpstreamResponse", "BodyConsumer", "UpstreamError", "UpstreamConnectTimeout",
    "UpstreamTimeout", "UpstreamConnectionError", "UpstreamProtocolError", "UpstreamTooLarge", "AnswerLimits",
]

logger = logging.getLogger(__name__)


def _host_header(host: str, port: int) -> bytes:
    shown = f"[{host}]" if ":" in host else host
    return f"{shown}:{port}".encode("idna" if not shown.isascii() else "ascii")


class _Connection(asyncio.Protocol):
    """One TCP connection to one engine; carries one exchange at a time."""

    def __init__(self, pool: "UpstreamPool", key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.idle_since = 0.0
        self.closed = False
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream connection's transport: asyncio types connection_made() for every kind of protocol
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # nothing was asked: a peer talking out of turn is not reused
            self.abort()
            return
        response._data(data)

    def eof_received(self) -> bool | None:
        return None  # close; connection_lost tells the exchange

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        response, self.response = self.response, None
        if response is not None:
            response._connection_lost(exc)

    def start(self, request: bytes, body: bytes, whole: bool, read_timeout: float | None,
              total_timeout: float | None) -> UpstreamResponse:
        response = self.response = UpstreamResponse(self, whole, read_timeout, total_timeout)
        assert self.transport is not None
        try:
            if len(body) < 65536:
                self.transport.write(request + body)
            else:
                self.transport.writelines((request, body))
        except (RuntimeError, OSError) as exc:  # closed under us (the peer closed an idle connection)
            response._fail(UpstreamConnectionError(f"connection closed before the request was sent: {exc}"))
        return response

    def finished(self, reusable: bool) -> None:
        self.response = None
        if self._paused:
            self.resume_reading()
        if reusable and not self.closed and not self.pool.closed:
            self.pool._put_idle(self)
        else:
            self.abort()

    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        self.response = None
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.abort()


class UpstreamPool:
    """Owns pooled keep-alive connections to the engines (see the module doc)."""

    def __init__(self, *, connect_timeout: float, keepalive_s: float = 4.0, limit: int = 0,
                 limits: AnswerLimits | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.limits = limits or AnswerLimits()
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s
        self.limit = limit
        self.closed = False
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._connecting = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._sweeper: asyncio.TimerHandle | None = None
        self._host_headers: dict[tuple[str, int], bytes] = {}

    # ------------------------------------------------------------------ requests
    def host_header(self, host: str, port: int) -> bytes:
        key = (host, port)
        value = self._host_headers.get(key)
        if value is None:
            if len(self._host_headers) > 4096:
                self._host_headers.clear()
            value = self._host_headers[key] = _host_header(host, port)
        return value

    async def request(self, host: str, port: int, head: bytes, body: bytes = b"", *, whole: bool = False,
                      read_timeout: float | None = None, total_timeout: float | None = None) -> UpstreamResponse:
        """Send ``head`` (a complete request head, blank line included) and ``body``; return
        once the answer's headers are in (``whole``: once its body is complete too)."""
        conn = self._take_idle((host, port))
        if conn is None:
            conn = await self._connect(host, port)
        response = conn.start(head, body, whole, read_timeout, total_timeout)
        await response._wait()
        return response

    async def fetch(self, host: str, port: int, method: bytes, path: bytes, *, body: bytes = b"",
                    headers: dict[str, str] | None = None,
                    total_timeout: float) -> tuple[int, dict[str, str], bytes]:
        """One small exchange read whole: ``(status, headers, body)`` (health probes, ``/v1/models``,
        ``/tokenize``). ``headers`` values come from parsed requests or our own ids (no line breaks)."""
        head = b"%b %b HTTP/1.1\r\nhost: %b\r\n" % (method, path, self.host_header(host, port))
        given = {name.lower(): value for name, value in (headers or {}).items()}
        if body or method != b"GET":
            given.setdefault("content-type", "application/json")
            given["content-length"] = str(len(body))
        for name, value in given.items():
            head += f"{name}: {value}\r\n".encode("latin-1")
        response = await self.request(host, port, head + b"\r\n", body, whole=True, total_timeout=total_timeout)
        data = await response.read()
        return response.status, response.headers, data

    # ------------------------------------------------------------------ pool
    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        stack = self._idle.get(key)
        if not stack:
            return None
        oldest_ok = self.loop.time() - self.keepalive_s
        while stack:
            conn = stack.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            if conn.idle_since < oldest_ok:  # this one and every one below it are too old
                conn.abort()
                for older in stack[:]:
                    older.abort()
                stack.clear()
                break
            return conn
        return None

    def _put_idle(self, conn: _Connection) -> None:
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self.keepalive_s, self._sweep)
        if self._waiters:
            self._wake_waiter()

    def _sweep(self) -> None:
        """Close connections idle for longer than ``keepalive_s``."""
        self._sweeper = None
        oldest_ok = self.loop.time() - self.keepalive_s
        left = False
        for key, stack in list(self._idle.items()):
            keep = [c for c in stack if not c.closed and c.idle_since >= oldest_ok]
            for conn in stack:
                if not conn.closed and conn.idle_since < oldest_ok:
                    conn.abort()
            if keep:
                self._idle[key] = keep
                left = True
            else:
                del self._idle[key]
        if left and not self.closed:
            self._sweeper = self.loop.call_later(self.keepalive_s, self._sweep)

    def _forget(self, conn: _Connection) -> None:
        if conn in self._open:
            self._open.discard(conn)
            if self._waiters:
                self._wake_waiter()

    def _wake_waiter(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _full(self) -> bool:
        return self.limit > 0 and len(self._open) + self._connecting >= self.limit

    def _drop_one_idle(self) -> bool:
        """At the limit: close the longest-idle connection (any host) to make room."""
        oldest: _Connection | None = None
        for stack in self._idle.values():
            for conn in stack:
                if not conn.closed and (oldest is None or conn.idle_since < oldest.idle_since):
                    oldest = conn
        if oldest is None:
            return False
        self._idle[oldest.key].remove(oldest)
        oldest.abort()
        return True

    async def _connect(self, host: str, port: int) -> _Connection:
        if self.closed:
            raise UpstreamConnectionError("the proxy is shutting down")
        deadline = self.loop.time() + self.connect_timeout
        while self._full():
            if self._drop_one_idle():
                continue
            idle = self._take_idle((host, port))
            if idle is not None:
                return idle
            waiter = self.loop.create_future()
            self._waiters.append(waiter)
            remaining = deadline - self.loop.time()
            try:
                await asyncio.wait_for(waiter, max(remaining, 0.0))
            except asyncio.TimeoutError:
                raise UpstreamConnectTimeout(
                    f"no free upstream connection within {self.connect_timeout:g}s ({self.limit} open)") from None
            finally:
                if not waiter.done():
                    waiter.cancel()
            idle = self._take_idle((host, port))
            if idle is not None:
                return idle
        self._connecting += 1
        try:
            remaining = max(deadline - self.loop.time(), 0.0)
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Connection(self, (host, port)), host, port), remaining)
        except asyncio.TimeoutError:
            raise UpstreamConnectTimeout(f"connect to {host}:{port} timed out") from None
        except OSError as exc:
            raise UpstreamConnectionError(
                f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
        finally:
            self._connecting -= 1
            if self._waiters and not self._full():
                self._wake_waiter()
        if self.closed:
            conn.abort()
            raise UpstreamConnectionError("the proxy is shutting down")
        self._open.add(conn)
        return conn

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def idle_connections(self, host: str, port: int) -> int:
        return sum(1 for c in self._idle.get((host, port), ()) if not c.closed)

    async def close(self) -> None:
        """Close every connection (an exchange still running fails at once)."""
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._open):
            conn.abort()
        self._idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.cancel()
        self._waiters.clear()
        await asyncio.sleep(0)  # let the transports' connection_lost run
