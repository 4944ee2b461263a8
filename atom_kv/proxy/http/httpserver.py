"""The proxy's HTTP/1.1 server: one :class:`asyncio.Protocol` per client on httptools' C parser.

Why not hypercorn (which served the proxy before): it parses HTTP with h11 in
pure Python and runs every request through ASGI message dicts and extra
tasks; with its h11 parsing that was over a third of the proxy's CPU per
request (``python -m atom_kv.bench proxy``, py-spy). This server hands each
request to a handler as an :class:`Exchange`: the two completion routes are
served natively (:mod:`atom_kv.proxy.relay.fastpath`), every other route goes to the
Quart app through a minimal ASGI bridge (:mod:`atom_kv.proxy.http.asgi_bridge`).

:class:`HTTPServer` owns the listening server and its connections;
:class:`_ServerConnection` owns one client's connection:

- keep-alive, and pipelined requests answered in order, one at a time (reading
  pauses while one waits); the next one is not answered, and nothing more is
  read, while the client's socket buffer is above its high-water mark (a client
  that pipelines and never reads costs one buffer, not a growing heap); at most
  ``max_pipelined`` wait per connection (429 and the connection ends past it);
- a client that reads nothing for ``stall_timeout`` while an answer waits in
  its socket buffer is dropped: its request's task is cancelled (the exchange
  says ``stalled``, so the handler can release what it holds) and ``on_stall``
  counts it;
- a request head must arrive within ``header_timeout`` (from the connection's
  start or the previous answer: also the idle keep-alive limit) and stay under
  ``max_head_bytes`` in all and ``max_headers`` header lines, however it is
  split across reads, else the connection is closed (431 when too big);
- requests are routed on the raw path (never percent-decoded); an encoded
  slash (``%2F``, ``%5C``) in it is refused (400);
- a body must arrive within ``body_timeout`` (else 408) and stay within
  ``max_request_bytes`` (else 413, at once when ``Content-Length`` says so);
  all bodies held at once (read or being read, until their answer ends) stay
  within ``body_budget`` bytes, else 503 (at once when ``Content-Length`` says
  so); a body whose length is announced is read into one buffer of that size
  (no second copy to join its pieces);
  ``Expect: 100-continue`` is answered;
- answers: fixed length (:meth:`Exchange.respond`), or streamed
  (:meth:`Exchange.start_stream` then :meth:`Exchange.write` per piece: one
  chunk, one write each; back-pressure reaches the piece's producer);
- a client that goes away cancels its request's task;
- graceful shutdown: stop accepting, close idle connections, give requests in
  flight ``timeout`` seconds, then drop what is left.
"""

from __future__ import annotations

import asyncio
import http
import logging
import socket
import time
from collections import deque
from typing import Awaitable, Callable, Protocol
from urllib.parse import unquote_to_bytes

import httptools

from atom_kv.openai_errors import error_bytes

__all__ = ["HTTPServer", "Exchange", "Handler", "Producer"]

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
#: requests read ahead on one connection while another is answered (more: 429, and the connection ends)
MAX_PIPELINED = 32
#: header lines in one request head (more: 431)
MAX_HEADERS = 100
#: bodies announced larger than this are read into one buffer of their size
_PREALLOCATE_FROM = 64 * 1024
#: request bodies held at once across every connection (more: 503)
BODY_BUDGET = 1 << 30


class _HeadTooLarge(Exception):
    """Raised from a parser callback: the head is over a limit (the message says which)."""

_REASONS = {s.value: s.phrase.encode("ascii") for s in http.HTTPStatus}
_JSON = b"application/json"


class Producer(Protocol):
    """Whatever feeds a streamed answer; paused while the client's socket buffer is full."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class _DateHeader:
    """``date: ...\\r\\n``, formatted at most once a second."""

    __slots__ = ("_second", "_line")

    def __init__(self) -> None:
        self._second = -1
        self._line = b""

    def line(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = b"date: " + time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now)).encode() + b"\r\n"
        return self._line


class Exchange:
    """One request and its answer. The request: ``method``, ``path`` (percent-decoded),
    ``raw_path``, ``query``, ``headers`` (lower-case names, bytes), ``body``. When the
    server refused the request itself (a too big or too slow body) ``refusal`` is
    ``(status, message)`` and the handler only has to answer it. The answer goes out
    through :meth:`respond` or :meth:`start_stream`/:meth:`write`/:meth:`end`."""

    __slots__ = ("conn", "method", "raw_target", "path", "raw_path", "query", "headers", "http_version",
                 "keep_alive", "body_parts", "body_size", "refusal", "head_size", "complete", "head_done",
                 "expect_continue",
                 "_pending_head", "_chunked", "_finished", "_started", "task", "_producer", "_head_only", "_done",
                 "stalled", "_buf", "budget_held")

    def __init__(self, conn: "_ServerConnection") -> None:
        self.conn = conn
        self.method = "GET"
        self.raw_target = b""
        self.path = ""
        self.raw_path = b""
        self.query = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.http_version = "1.1"
        self.keep_alive = True
        self.body_parts: list[bytes] = []
        self._buf: bytearray | None = None  # the body, when its length was announced
        self.budget_held = 0  # bytes of the server's body budget this request holds
        self.body_size = 0
        self.head_size = 0
        self.stalled = False  # dropped because the client read nothing for ``stall_timeout``
        self.refusal: tuple[int, str] | None = None
        self.complete = False  # the whole request (head and body) is in, or it was refused
        self.head_done = False
        self.expect_continue = False
        self._pending_head: bytes | None = None
        self._chunked = True
        self._started = False
        self._finished = False
        self._head_only = False
        self._producer: Producer | None = None
        self._done: asyncio.Future | None = None
        self.task: asyncio.Task | None = None

    # ------------------------------------------------------------------ request
    def body_view(self) -> bytes | bytearray:
        """The body without a copy (a parser reads it in place)."""
        if self._buf is not None:
            return self._buf
        return self.body

    def drop_body(self) -> None:
        """Forget the raw body (once parsed): its memory goes back before the answer ends."""
        self._buf = None
        self.body_parts = []

    @property
    def body(self) -> bytes:
        if self._buf is not None:
            return bytes(self._buf)
        parts = self.body_parts
        if len(parts) != 1:
            joined = b"".join(parts)
            self.body_parts = [joined]
            return joined
        return parts[0]

    def header(self, name: bytes) -> str | None:
        """A request header by lower-case name (the first one), or None."""
        for key, value in self.headers:
            if key == name:
                return value.decode("latin-1")
        return None

    @property
    def client(self) -> tuple[str, int] | None:
        return self.conn.peer

    @property
    def server(self) -> tuple[str, int] | None:
        return self.conn.local

    # ------------------------------------------------------------------ answer
    @property
    def started(self) -> bool:
        """Whether the answer has begun (its head is committed)."""
        return self._started

    @property
    def finished(self) -> bool:
        """Whether the answer is complete."""
        return self._finished

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], extra: bytes, close: bool) -> bytes:
        conn = self.conn
        keep = self.keep_alive and not close and not conn.server.shutting_down
        self.keep_alive = keep
        parts = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))]
        for name, value in headers:
            parts.append(name + b": " + value + b"\r\n")
        parts.append(extra)
        parts.append(conn.server.date.line())
        if not keep:
            parts.append(b"connection: close\r\n")
        elif self.http_version == "1.0":
            parts.append(b"connection: keep-alive\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, close: bool = False) -> None:
        """The whole answer at once (``content-length`` is added; no other length header may be given)."""
        if self._started:
            raise RuntimeError("the answer has already started")
        self._started = True
        head = self._head(status, headers, b"content-length: %d\r\n" % len(body), close)
        self.conn.write(head if self.method == "HEAD" else head + body)
        self._end()

    def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Begin a streamed answer. Its head goes out with the first piece, or at
        :meth:`flush_head`."""
        if self._started:
            raise RuntimeError("the answer has already started")
        self._started = True
        self._head_only = self.method == "HEAD"
        self._chunked = self.http_version != "1.0"
        if not self._chunked:
            self.keep_alive = False  # the end of the body is the end of the connection
        self._pending_head = self._head(status, headers, b"transfer-encoding: chunked\r\n" if self._chunked else b"",
                                        False)

    def flush_head(self) -> None:
        """Send a streamed answer's head now if no piece took it along."""
        head, self._pending_head = self._pending_head, None
        if head is not None and not self._finished:
            self.conn.write(head)

    def write(self, data: bytes) -> None:
        """One piece of a streamed answer: one chunk, one write (with the head, for the first)."""
        if self._finished or not data or self._head_only:
            return
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        head = self._pending_head
        if head is not None:
            self._pending_head = None
            data = head + data
        self.conn.write(data)

    def end(self, data: bytes = b"") -> None:
        """The streamed answer's last piece (if any) and its end."""
        if self._finished:
            return
        out = b""
        if data and not self._head_only:
            out = b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data
        if self._chunked and not self._head_only:
            out += b"0\r\n\r\n"
        head = self._pending_head
        if head is not None:
            self._pending_head = None
            out = head + out
        if out:
            self.conn.write(out)
        self._end()

    def set_producer(self, producer: Producer | None) -> None:
        """Who to pause while the client's socket buffer is full (paused at once if it is)."""
        self._producer = producer
        if producer is not None and self.conn.writing_paused:
            producer.pause_reading()

    async def wait_done(self) -> None:
        """Until the answer is complete or the client has gone."""
        if self._finished:
            return
        if self._done is None:
            self._done = self.conn.loop.create_future()
        await asyncio.shield(self._done)

    def _set_done(self) -> None:
        self._finished = True
        self._producer = None
        self.release_budget()
        done = self._done
        if done is not None and not done.done():
            done.set_result(None)

    def _end(self) -> None:
        self._set_done()
        self.conn.exchange_finished(self)

    def release_budget(self) -> None:
        """Give this request's share of the server's body budget back (idempotent)."""
        held, self.budget_held = self.budget_held, 0
        if held:
            self.conn.server.body_in_flight -= held

    def abort(self) -> None:
        """Give up on an answer that cannot be completed: the connection is dropped."""
        if not self._finished:
            self._set_done()
            self.keep_alive = False
            self.conn.close(abort=True)


Handler = Callable[[Exchange], Awaitable[None]]


class _ServerConnection(asyncio.Protocol):
    """One client connection (see the module doc)."""

    def __init__(self, server: "HTTPServer") -> None:
        self.server = server
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.peer: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.parsing: Exchange | None = None  # the request being read
        self.queue: deque[Exchange] = deque()  # read, waiting for the one in progress
        self.active: Exchange | None = None  # being answered
        self.head_bytes = 0
        self.head_timer: asyncio.TimerHandle | None = None
        self.body_timer: asyncio.TimerHandle | None = None
        self.linger_timer: asyncio.TimerHandle | None = None
        self.stall_timer: asyncio.TimerHandle | None = None
        self.writing_paused = False
        self.reading_paused = False
        self.closed = False
        self.stop_reading = False  # a refused or upgraded request: no more requests on this connection

    # ------------------------------------------------------------------ transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        self.peer = tuple(peer[:2]) if isinstance(peer, tuple) else None  # type: ignore[assignment]
        self.local = tuple(local[:2]) if isinstance(local, tuple) else None  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.stop_reading or self.closed:
            return
        parsing = self.parsing
        if parsing is None or not parsing.head_done:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.stop_reading = True  # served as plain HTTP/1.1; the connection ends with this answer
            for exchange in (*self.queue, self.active):
                if exchange is not None:
                    exchange.keep_alive = False
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, _HeadTooLarge):
                self._bad_request(str(cause), status=431)
                return
            logger.exception("error in the HTTP parser callbacks")
            self.close(abort=True)
            return
        except httptools.HttpParserError as exc:
            self._bad_request(f"malformed HTTP request: {exc}")
            return
        if self.closed:
            return
        parsing = self.parsing
        if parsing is not None:
            if not parsing.head_done and self.head_bytes > self.server.max_head_bytes:
                self._bad_request(f"request head exceeds {self.server.max_head_bytes} bytes", status=431)
                return
            if parsing.head_done and not parsing.complete and self.body_timer is None:
                self.body_timer = self.loop.call_later(self.server.body_timeout, self._body_timed_out)
        if self.active is None and self.queue and not self.writing_paused:
            self._dispatch()
        self._update_reading()

    def eof_received(self) -> bool | None:
        return None  # the client closed its side: treated as gone (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self._cancel_timers()
        active = self.active
        if active is not None and not active.finished:
            active._set_done()
            if active.task is not None:
                active.task.cancel()  # the client went away: the handler unwinds (and cancels its upstream legs)
        for ex in (*self.queue, self.parsing):
            if ex is not None:
                ex.release_budget()
        self.queue.clear()
        self.parsing = None
        if not self.server.connections:
            self.server.all_closed.set()

    def pause_writing(self) -> None:
        self.writing_paused = True
        active = self.active
        if active is not None and active._producer is not None:
            active._producer.pause_reading()
        self._update_reading()  # nothing more is read (nor answered) until the client reads
        if self.stall_timer is None and not self.closed:
            self.stall_timer = self.loop.call_later(self.server.stall_timeout, self._stalled)

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.stall_timer is not None:
            self.stall_timer.cancel()
            self.stall_timer = None
        active = self.active
        if active is not None and active._producer is not None:
            active._producer.resume_reading()
        if self.active is None and self.queue and not self.closed:
            self._dispatch()
        self._update_reading()

    def _stalled(self) -> None:
        """The client read nothing for ``stall_timeout`` while an answer waited: drop it."""
        self.stall_timer = None
        if self.closed or not self.writing_paused:
            return
        if self.active is not None:
            self.active.stalled = True
        logger.info("client %s read nothing for %gs while its answer waited: connection dropped",
                    self.peer, self.server.stall_timeout)
        if self.server.on_stall is not None:
            self.server.on_stall()
        self.close(abort=True)

    def _update_reading(self) -> None:
        """Read while nothing waits for its turn and the client reads what we write."""
        transport = self.transport
        if transport is None or self.closed or self.linger_timer is not None:
            return
        pause = self.writing_paused or (bool(self.queue) and self.active is not None)
        if pause and not self.reading_paused:
            self.reading_paused = True
            transport.pause_reading()
        elif not pause and self.reading_paused:
            self.reading_paused = False
            if not self.stop_reading:
                transport.resume_reading()

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        self.parsing = None if self.stop_reading else Exchange(self)  # after a refusal: nothing more is taken

    def on_url(self, url: bytes) -> None:
        ex = self.parsing
        if ex is not None:
            ex.raw_target += url
            self._count_head(ex, len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        ex = self.parsing
        if ex is not None:
            ex.headers.append((name.lower(), value))
            self._count_head(ex, len(name) + len(value) + 4)
            if len(ex.headers) > self.server.max_headers:
                raise _HeadTooLarge(f"request head has more than {self.server.max_headers} header lines")

    def _count_head(self, ex: Exchange, size: int) -> None:
        """The whole head's size, however it arrived (one read or many)."""
        ex.head_size += size
        if ex.head_size > self.server.max_head_bytes:
            raise _HeadTooLarge(f"request head exceeds {self.server.max_head_bytes} bytes")

    def on_headers_complete(self) -> None:
        ex = self.parsing
        if ex is None:
            return
        self._cancel_head_timer()
        self.head_bytes = 0
        parser = self.parser
        ex.head_done = True
        ex.method = parser.get_method().decode("ascii", "replace")
        ex.http_version = parser.get_http_version()
        ex.keep_alive = parser.should_keep_alive()
        target = ex.raw_target
        raw_path, _, ex.query = target.partition(b"?")
        ex.raw_path = raw_path
        ex.path = (unquote_to_bytes(raw_path) if b"%" in raw_path else raw_path).decode("utf-8", "replace")
        if b"%" in raw_path and (b"%2f" in raw_path.lower() or b"%5c" in raw_path.lower()):
            self._refuse(ex, 400, "encoded slash in the request path")
            return
        limit = self.server.max_request_bytes
        for key, value in ex.headers:
            if key == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = 0  # the parser refuses a malformed length itself
                if length > limit:
                    self._refuse(ex, 413, f"request body exceeds {limit} bytes")
                    return
                if length > 0:
                    if not self._reserve(ex, length):
                        return
                    if length > _PREALLOCATE_FROM:
                        ex._buf = bytearray(length)
            elif key == b"expect" and value.lower() == b"100-continue":
                ex.expect_continue = True
        if ex.expect_continue and ex.http_version == "1.1" and self.idle and self.transport is not None:
            # (not while another answer is going out: the client sends its body after a while anyway)
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        ex = self.parsing
        if ex is None or ex.refusal is not None:
            return
        start = ex.body_size
        ex.body_size += len(body)
        if ex.body_size > self.server.max_request_bytes:
            self._refuse(ex, 413, f"request body exceeds {self.server.max_request_bytes} bytes")
            return
        if ex.body_size > ex.budget_held and not self._reserve(ex, ex.body_size - ex.budget_held):
            return  # a chunked body: its budget grows as it arrives
        if ex._buf is not None:
            ex._buf[start:ex.body_size] = body
        else:
            ex.body_parts.append(body)

    def _reserve(self, ex: Exchange, size: int) -> bool:
        """Take ``size`` more bytes of the server's body budget for ``ex``, or refuse it (503)."""
        server = self.server
        if server.body_in_flight + size > server.body_budget:
            ex.release_budget()
            self._refuse(ex, 503, f"the proxy holds {server.body_budget} bytes of request bodies already; "
                                  "retry later")
            return False
        server.body_in_flight += size
        ex.budget_held += size
        return True

    def on_message_complete(self) -> None:
        ex = self.parsing
        if ex is None:
            return
        self.parsing = None
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        if ex.refusal is None:
            if len(self.queue) >= self.server.max_pipelined:
                self._refuse(ex, 429, f"more than {self.server.max_pipelined} pipelined requests waiting")
                return
            ex.complete = True
            self.queue.append(ex)

    # ------------------------------------------------------------------ requests
    def _refuse(self, ex: Exchange, status: int, message: str) -> None:
        """The server answers this request itself (through its route, for the accounting);
        nothing more is read from this connection."""
        ex.refusal = (status, message)
        ex.complete = True
        ex.keep_alive = False
        ex.drop_body()
        self.stop_reading = True
        self.parsing = None
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        self.queue.append(ex)

    def _body_timed_out(self) -> None:
        self.body_timer = None
        ex = self.parsing
        if ex is None or ex.complete or self.closed:
            return
        self._refuse(ex, 408, f"request body not received within {self.server.body_timeout:g}s")
        if self.active is None:
            self._dispatch()

    def _bad_request(self, message: str, status: int = 400) -> None:
        """Unparseable input: answered (unless a request is being answered, which then
        ends the connection) and nothing more is read."""
        self.stop_reading = True
        for ex in (*self.queue, self.parsing):
            if ex is not None:
                ex.release_budget()
        self.parsing = None
        self.queue.clear()
        if self.active is not None:
            self.active.keep_alive = False
            return
        if self.transport is not None:
            body = error_bytes(status, message)
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                 b"connection: close\r\n\r\n%b" % (status, _REASONS[status], len(body), body))
        self._linger()

    def _dispatch(self) -> None:
        ex = self.queue.popleft()
        self.active = ex
        self._update_reading()
        handler = self.server.routes.get(ex.raw_path.decode("latin-1"), self.server.fallback)  # the raw path
        ex.task = task = self.loop.create_task(handler(ex))
        task.add_done_callback(lambda t, ex=ex: self._handler_done(ex, t))

    def _handler_done(self, ex: Exchange, task: asyncio.Task) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            logger.error("unhandled error answering %s %s", ex.method, ex.path, exc_info=exc)
        if ex.finished:
            return
        if not ex.started and not self.closed:
            ex.respond(500, [(b"content-type", _JSON)], error_bytes(500, "internal proxy error"), close=True)
        else:
            ex.abort()

    def exchange_finished(self, ex: Exchange) -> None:
        if ex is not self.active:
            return
        self.active = None
        if self.closed:
            return
        if not ex.keep_alive:
            if self.stop_reading:
                self._linger()
            else:
                self.close()
            return
        if self.queue:
            if not self.writing_paused:
                self._dispatch()  # else: once the client has read (resume_writing)
        elif self.parsing is None or not self.parsing.head_done:
            self._arm_head_timer()
        self._update_reading()

    # ------------------------------------------------------------------ plumbing
    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def close(self, abort: bool = False) -> None:
        if self.transport is not None and not self.transport.is_closing():
            if abort:
                self.transport.abort()
            else:
                self.transport.close()
        self._cancel_timers()

    def _linger(self) -> None:
        """After answering a request this connection refused, while the client may still be
        sending: close our side and discard what still arrives (for at most
        ``header_timeout``), so the client reads the answer instead of a reset."""
        transport = self.transport
        if transport is None or transport.is_closing() or self.linger_timer is not None:
            return
        self.stop_reading = True
        self._cancel_timers()
        if not transport.can_write_eof():
            self.close()
            return
        transport.write_eof()
        if self.reading_paused:
            self.reading_paused = False
            transport.resume_reading()
        self.linger_timer = self.loop.call_later(self.server.header_timeout, self.close, True)

    @property
    def idle(self) -> bool:
        return self.active is None and not self.queue

    def _arm_head_timer(self) -> None:
        if self.head_timer is None and not self.closed:
            self.head_timer = self.loop.call_later(self.server.header_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.active is None and not self.queue:
            self.close(abort=True)  # silent or too slow: the slot is freed

    def _cancel_timers(self) -> None:
        self._cancel_head_timer()
        if self.stall_timer is not None and self.closed:
            self.stall_timer.cancel()
            self.stall_timer = None
        if self.linger_timer is not None and self.closed:
            self.linger_timer.cancel()
            self.linger_timer = None
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None


class HTTPServer:
    """Owns the listening socket's server and every client connection (see the module doc)."""

    def __init__(self, routes: dict[str, Handler], fallback: Handler, *, header_timeout: float, body_timeout: float,
                 max_request_bytes: int, max_head_bytes: int = MAX_HEAD_BYTES,
                 max_pipelined: int = MAX_PIPELINED, max_headers: int = MAX_HEADERS, stall_timeout: float = 60.0,
                 on_stall: Callable[[], None] | None = None, body_budget: int = BODY_BUDGET) -> None:
        self.loop = asyncio.get_running_loop()
        self.routes = routes
        self.fallback = fallback
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_request_bytes = max_request_bytes
        self.max_head_bytes = max_head_bytes
        self.max_pipelined = max_pipelined
        self.max_headers = max_headers
        self.stall_timeout = stall_timeout
        self.body_budget = body_budget
        self.body_in_flight = 0  # bytes of request bodies held now (see Exchange.budget_held)
        self.on_stall = on_stall
        self.connections: set[_ServerConnection] = set()
        self.all_closed = asyncio.Event()
        self.shutting_down = False
        self.date = _DateHeader()
        self._server: asyncio.AbstractServer | None = None

    async def start(self, sock: socket.socket, backlog: int) -> None:
        """Serve ``sock`` (bound and listening; the server owns it from now on)."""
        self._server = await self.loop.create_server(lambda: _ServerConnection(self), sock=sock, backlog=backlog)

    async def shutdown(self, timeout: float) -> None:
        """Stop accepting, close idle connections, let requests in flight finish within
        ``timeout`` seconds, then drop whatever is left."""
        self.shutting_down = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.idle:
                conn.close()
            else:
                for ex in (conn.active, *conn.queue):
                    if ex is not None:
                        ex.keep_alive = False
        if self.connections:
            self.all_closed.clear()
            try:
                await asyncio.wait_for(self.all_closed.wait(), timeout)
            except asyncio.TimeoutError:
                logger.warning("shutdown: %d connection(s) still busy after %gs, dropping them",
                               len(self.connections), timeout)
        tasks = []
        for conn in list(self.connections):
            if conn.active is not None and conn.active.task is not None:
                tasks.append(conn.active.task)
            conn.close(abort=True)
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        if self._server is not None:
            self._server = None
