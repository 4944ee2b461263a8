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

Failures are :class:`UpstreamError` subclasses: :class:`UpstreamConnectTimeout`,
:class:`UpstreamTimeout` (a :class:`TimeoutError`),
:class:`UpstreamConnectionError` (a :class:`ConnectionError`: refused, reset,
closed before the answer ended, or not HTTP) and :class:`UpstreamTooLarge`
(an answer over the bounds above; the message names the proxy flag).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from typing import Protocol

import httptools

__all__ = [
    "UpstreamPool", "UpstreamResponse", "BodyConsumer", "UpstreamError", "UpstreamConnectTimeout",
    "UpstreamTimeout", "UpstreamConnectionError", "UpstreamTooLarge", "AnswerLimits",
]

logger = logging.getLogger(__name__)


class UpstreamError(Exception):
    """An upstream exchange failed (see the subclasses)."""


class UpstreamConnectTimeout(UpstreamError):
    """No connection within the connect timeout (pool slot and TCP connect)."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The peer was silent too long, or the whole exchange took too long."""


class UpstreamConnectionError(UpstreamError, ConnectionError):
    """Refused, reset or closed before the answer ended, or the answer was not HTTP."""


class UpstreamTooLarge(UpstreamError):
    """The answer's head or body is over the proxy's bounds (the message names the flag)."""


class AnswerLimits:
    """The bounds on one engine answer (see the module doc); the flags that set them name them in errors."""

    __slots__ = ("head", "body", "server_timing")

    def __init__(self, head: int = 64 * 1024, body: int = 64 * 1024 * 1024, server_timing: int = 4096) -> None:
        self.head = head
        self.body = body
        self.server_timing = server_timing


_SERVER_TIMING = "server-timing"
_HEAD_END = b"\r\n\r\n"


class BodyConsumer(Protocol):
    """Receives a streamed body from the connection's callbacks (see :meth:`UpstreamResponse.stream`)."""

    def body_received(self, data: bytes) -> None:
        """Everything one read brought (never empty)."""

    def body_complete(self) -> None:
        """The body ended cleanly (the connection is already back in the pool, or closed)."""

    def body_failed(self, exc: UpstreamError) -> None:
        """The exchange failed mid-body (the connection is closed)."""


def _host_header(host: str, port: int) -> bytes:
    shown = f"[{host}]" if ":" in host else host
    return f"{shown}:{port}".encode("idna" if not shown.isascii() else "ascii")


class UpstreamResponse:
    """One exchange on one connection: the answer's status and headers, then its body
    (:meth:`read` it whole, or :meth:`stream` it to a consumer). Owns the connection
    until the body ends or :meth:`close` is called."""

    __slots__ = ("status", "headers", "_conn", "_loop", "_parser", "_body", "_waiter", "_consumer",
                 "_headers_done", "_complete", "_failed", "_released", "_whole", "_timer", "_deadline",
                 "_read_timeout", "_last_read", "_length_known", "_keep_alive", "_got_bytes", "_paused",
                 "_limits", "_head_buf", "_held", "_too_large")

    def __init__(self, conn: "_Connection", whole: bool, read_timeout: float | None,
                 total_timeout: float | None) -> None:
        self._conn = conn
        self._loop = conn.loop
        self._parser = httptools.HttpResponseParser(self)
        self._limits: AnswerLimits = conn.pool.limits
        self._head_buf: bytearray | None = None  # a head split over reads, until its end arrives
        self._held = 0  # body bytes held in ``_body``
        self._too_large: str | None = None  # set by a parser callback, failed after the feed
        self.status = 0
        self.headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._waiter: asyncio.Future | None = None
        self._consumer: BodyConsumer | None = None
        self._headers_done = False
        self._complete = False
        self._failed: UpstreamError | None = None
        self._released = False
        self._whole = whole  # resolve the waiter only when the body is complete
        self._got_bytes = False
        self._paused = False  # our consumer asked to stop reading: the peer's silence is ours
        self._length_known = False
        self._keep_alive = False
        now = self._loop.time()
        self._last_read = now
        self._read_timeout = read_timeout
        self._deadline = now + total_timeout if total_timeout is not None else None
        self._timer: asyncio.TimerHandle | None = None
        self._arm(now)

    # ------------------------------------------------------------------ timeouts
    def _next_expiry(self) -> float | None:
        due = self._deadline
        if self._read_timeout is not None:
            idle_due = self._last_read + self._read_timeout
            due = idle_due if due is None or idle_due < due else due
        return due

    def _arm(self, now: float) -> None:
        due = self._next_expiry()
        if due is not None:
            self._timer = self._loop.call_at(max(due, now), self._expire)

    def _expire(self) -> None:
        """The timer fired: fail if the peer was silent (or the exchange is over time), else re-arm.
        Reads only move a timestamp; the timer catches up here (no re-arming per read)."""
        self._timer = None
        if self._complete or self._failed is not None:
            return
        now = self._loop.time()
        if self._paused:
            self._last_read = now
        due = self._next_expiry()
        if due is not None and now < due:
            self._timer = self._loop.call_at(due, self._expire)
            return
        whole = self._deadline is not None and now >= self._deadline
        self._fail(UpstreamTimeout("the whole exchange timed out" if whole else "no data within the read timeout"))

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ------------------------------------------------------------------ parser callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        if key in ("content-length", "transfer-encoding"):
            self._length_known = True
        if key == _SERVER_TIMING and len(value) > self._limits.server_timing:
            return  # dropped unread (--max-server-timing-bytes): the spans of this leg go without it
        self.headers[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._headers_done = True
        length = self.headers.get("content-length", "")
        if self._whole and length.isdigit() and int(length) > self._limits.body:
            self._too_large = self._body_error(f"announced {length} bytes")
            return
        if not self._whole:
            self._wake()

    def on_body(self, body: bytes) -> None:
        if self._too_large is not None:
            return
        self._held += len(body)
        if self._held > self._limits.body:
            self._too_large = self._body_error(f"sent more than {self._limits.body} bytes")
            return
        self._body.append(body)

    def _body_error(self, what: str) -> str:
        return f"the engine's answer {what}, over --max-upstream-body-bytes ({self._limits.body})"

    def _whole_head(self, data: bytes) -> bytes | None:
        """``data`` with the head before it once the head's end is in (what the parser gets next);
        None while it is not (``data`` is kept). Raises :class:`UpstreamTooLarge` past the bound."""
        buf = self._head_buf
        if buf is None:
            end = data.find(_HEAD_END)
            if 0 <= end <= self._limits.head:
                return data  # the usual case: the whole head in one read
            if end < 0 and len(data) <= self._limits.head:
                self._head_buf = bytearray(data)
                return None
        else:
            start = max(len(buf) - 3, 0)
            buf += data
            end = buf.find(_HEAD_END, start)
            if end < 0 and len(buf) <= self._limits.head:
                return None
            if 0 <= end <= self._limits.head:
                self._head_buf = None
                return bytes(buf)
        raise UpstreamTooLarge(f"the engine's answer head is over --max-upstream-head-bytes ({self._limits.head})")

    def on_message_complete(self) -> None:
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()

    # ------------------------------------------------------------------ from the connection
    def _data(self, data: bytes) -> None:
        self._got_bytes = True
        self._last_read = self._loop.time()
        if not self._headers_done:
            try:
                whole = self._whole_head(data)
            except UpstreamTooLarge as exc:
                self._fail(exc)
                return
            if whole is None:
                return
            data = whole
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamConnectionError(f"invalid HTTP answer: {exc}"))
            return
        if self._too_large is not None:
            self._fail(UpstreamTooLarge(self._too_large))
            return
        if self._complete:
            self._stop_timer()
        consumer = self._consumer
        if consumer is not None:
            body = self._body
            if body:
                chunk = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                self._held = 0
                consumer.body_received(chunk)
            if self._complete:
                self._release()
                if self._failed is None:
                    consumer.body_complete()
        elif self._complete or (self._headers_done and not self._whole):
            self._wake()

    def _connection_lost(self, exc: BaseException | None) -> None:
        if self._complete or self._failed is not None:
            return
        if self._headers_done and not self._length_known:  # a body that ends with the connection
            self._complete = True
            self._keep_alive = False
            self._stop_timer()
            consumer = self._consumer
            if consumer is not None:
                self._released = True
                consumer.body_complete()
            else:
                self._wake()
            return
        if exc is None:
            what = "closed the connection" + (" mid-answer" if self._got_bytes else " before answering")
        else:
            what = f"connection lost: {exc}"
        self._fail(UpstreamConnectionError(what), close=False)

    # ------------------------------------------------------------------ outcome
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if self._failed is not None:
                waiter.set_exception(self._failed)
            else:
                waiter.set_result(None)

    def _fail(self, exc: UpstreamError, close: bool = True) -> None:
        if self._failed is not None or self._complete:
            return
        self._failed = exc
        self._stop_timer()
        self._released = True
        if close:
            self._conn.abort()
        consumer = self._consumer
        if consumer is not None:
            consumer.body_failed(exc)
        else:
            self._wake()

    def _release(self) -> None:
        """Body complete: the connection goes back to the pool (or is closed)."""
        if not self._released:
            self._released = True
            self._stop_timer()
            self._conn.finished(self._keep_alive and self._complete)

    async def _wait(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._complete or (self._headers_done and not self._whole):
            return
        await self._next_event()

    async def _next_event(self) -> None:
        """Wait for the connection's next callback; a cancelled wait drops the connection."""
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        except asyncio.CancelledError:
            self.close()
            raise
        finally:
            self._waiter = None

    # ------------------------------------------------------------------ public
    def header(self, name: str, default: str = "") -> str:
        """A response header by lower-case name."""
        return self.headers.get(name, default)

    async def read(self) -> bytes:
        """The whole body; the connection then goes back to the pool."""
        while not self._complete:
            if self._failed is not None:
                raise self._failed
            await self._next_event()
        body = b"".join(self._body)
        self._body.clear()
        self._release()
        return body

    def stream(self, consumer: BodyConsumer) -> None:
        """Deliver the body to ``consumer`` from the connection's callbacks as it arrives
        (what has already arrived is delivered now)."""
        self._consumer = consumer
        if self._failed is not None:
            consumer.body_failed(self._failed)
            return
        if self._body:
            chunk = b"".join(self._body)
            self._body.clear()
            self._held = 0
            consumer.body_received(chunk)
        if self._complete and not self._released:
            self._release()
            consumer.body_complete()

    def pause_reading(self) -> None:
        """Back-pressure: stop reading from the peer (the consumer's client is behind)."""
        self._paused = True
        self._conn.pause_reading()

    def resume_reading(self) -> None:
        if self._paused:
            self._paused = False
            self._last_read = self._loop.time()
            self._conn.resume_reading()

    def close(self) -> None:
        """Done with the answer: an unfinished exchange drops the connection (the peer sees the
        request abandoned); a finished one returns it to the pool. Idempotent."""
        self._stop_timer()
        if self._released:
            return
        self._released = True
        if self._complete:
            self._conn.finished(self._keep_alive)
        else:
            self._failed = self._failed or UpstreamConnectionError("closed by the proxy")
            self._conn.abort()

    @property
    def complete(self) -> bool:
        return self._complete


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
        self.transport = transport  # type: ignore[assignment]
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
