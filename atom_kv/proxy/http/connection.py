"""One client connection of the proxy's HTTP/1.1 server (:class:`ServerConnection`, an
:class:`asyncio.Protocol` on httptools' C parser): keep-alive and pipelining, the limits on a
request's head and body, flow control both ways, and the timers that end a slow or stalled client.
:mod:`atom_kv.proxy.http.httpserver`'s docstring says what each limit does."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from typing import Any, Callable, Protocol, cast
from urllib.parse import unquote_to_bytes

import httptools

from atom_kv.openai_errors import error_bytes
from atom_kv.proxy.http.exchange import JSON, DateHeader, Exchange, Handler

__all__ = ["BODY_BUDGET", "MAX_HEADERS", "MAX_HEAD_BYTES", "MAX_PIPELINED", "Server", "ServerConnection"]

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
#: requests read ahead on one connection while another is answered (more: 429, and the connection ends)
MAX_PIPELINED = 32
#: header lines in one request head (more: 431)
MAX_HEADERS = 100
#: request bodies held at once across every connection (more: 503)
BODY_BUDGET = 1 << 30


class _HeadTooLarge(Exception):
    """Raised from a parser callback: the head is over a limit (the message says which)."""


class Server(Protocol):
    """What a connection uses of the server that accepted it (:class:`~atom_kv.proxy.http.httpserver.HTTPServer`)."""

    loop: asyncio.AbstractEventLoop
    routes: dict[str, Handler]
    fallback: Handler
    header_timeout: float
    body_timeout: float
    max_request_bytes: int
    max_head_bytes: int
    max_pipelined: int
    max_headers: int
    stall_timeout: float
    body_budget: int
    body_in_flight: int
    on_stall: Callable[[], None] | None
    connections: set[Any]
    all_closed: asyncio.Event
    shutting_down: bool
    date: DateHeader


class ServerConnection(asyncio.Protocol):
    """One client connection (see the module doc)."""

    def __init__(self, server: Server) -> None:
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
        # a stream connection's transport: asyncio types connection_made() for every kind of protocol
        self.transport = cast(asyncio.Transport, transport)
        self.server.connections.add(self)
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        self.peer = tuple(peer[:2]) if isinstance(peer, tuple) else None
        self.local = tuple(local[:2]) if isinstance(local, tuple) else None
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
        elif parsing.chunk_waiting:
            # after a chunk's size line and none of its data: the last chunk's trailers, which the
            # parser collects whole before on_header sees them, so they are bounded here as they come
            parsing.idle_chunk_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgraded()
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__cause__ or exc.__context__
            if not isinstance(cause, _HeadTooLarge):
                logger.exception("error in the HTTP parser callbacks")
                self.close(abort=True)
                return
            self._bad_request(str(cause), status=431)
        except httptools.HttpParserError as exc:
            self._bad_request(f"malformed HTTP request: {exc}")
        else:
            parsing = self.parsing
            if parsing is not None and not self.closed:
                if not parsing.head_done and self.head_bytes > self.server.max_head_bytes:
                    self._bad_request(f"request head exceeds {self.server.max_head_bytes} bytes", status=431)
                elif parsing.chunk_waiting and parsing.idle_chunk_bytes > self.server.max_head_bytes:
                    self._bad_request(f"request trailer exceeds {self.server.max_head_bytes} bytes", status=431)
                elif parsing.head_done and not parsing.complete and self.body_timer is None:
                    self.body_timer = self.loop.call_later(self.server.body_timeout, self._body_timed_out)
        if self.closed:
            return
        if self.active is None and self.queue and not self.writing_paused:
            self._dispatch()
        self._update_reading()

    def _upgraded(self) -> None:
        """The request just read asked for an upgrade (or was a CONNECT): it is served as plain
        HTTP/1.1 and its answer ends the connection; the requests read before it are answered first."""
        self.stop_reading = True
        last = self.queue[-1] if self.queue else self.active
        if last is not None:
            last.keep_alive = False

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
        if ex is None:
            return
        self._count_head(ex, len(name) + len(value) + 4)
        if ex.head_done:
            # a chunked body's trailer: counted against the head's limits, then dropped (never a
            # header of the request: not forwarded, not its Authorization nor its request id)
            ex.trailer_lines += 1
            if ex.trailer_lines > self.server.max_headers:
                raise _HeadTooLarge(f"request trailer has more than {self.server.max_headers} lines")
            return
        ex.headers.append((name.lower(), value))
        if len(ex.headers) > self.server.max_headers:
            raise _HeadTooLarge(f"request head has more than {self.server.max_headers} header lines")

    def on_chunk_header(self) -> None:
        ex = self.parsing
        if ex is not None:
            ex.chunk_waiting = True
            ex.idle_chunk_bytes = 0

    def on_chunk_complete(self) -> None:
        ex = self.parsing
        if ex is not None:
            ex.chunk_waiting = False

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
                if length > limit:  # (nothing is reserved for it: the budget follows what arrives)
                    self._refuse(ex, 413, f"request body exceeds {limit} bytes")
                    return
            elif key == b"expect" and value.lower() == b"100-continue":
                ex.expect_continue = True
        if ex.expect_continue and ex.http_version == "1.1" and self.idle and self.transport is not None:
            # (not while another answer is going out: the client sends its body after a while anyway)
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        ex = self.parsing
        if ex is None or ex.refusal is not None:
            return
        ex.chunk_waiting = False
        ex.body_size += len(body)
        if ex.body_size > self.server.max_request_bytes:
            self._refuse(ex, 413, f"request body exceeds {self.server.max_request_bytes} bytes")
            return
        if not self._reserve(ex, len(body)):
            return  # the budget grows with the bytes that arrived, whatever the head announced
        ex.add_body(body)

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
        """Unparseable input: the request it was part of is dropped, nothing more is read, and
        the requests read before it are answered in order before this refusal (which ends the
        connection)."""
        ex = self.parsing
        if ex is not None:
            ex.release_budget()
            ex.drop_body()
        self._cancel_head_timer()
        self._refuse(Exchange(self), status, message)

    def _dispatch(self) -> None:
        ex = self.queue.popleft()
        self.active = ex
        self._update_reading()
        if ex.refusal is not None and not ex.head_done:  # input no route could be told from: answered here
            status, message = ex.refusal
            ex.respond(status, [(b"content-type", JSON)], error_bytes(status, message), close=True)
            return
        handler = self.server.routes.get(ex.raw_path.decode("latin-1"), self.server.fallback)  # the raw path
        ex.task = task = self.loop.create_task(handler(ex))
        task.add_done_callback(lambda t: self._handler_done(ex, t))

    def _handler_done(self, ex: Exchange, task: asyncio.Task) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            logger.error("unhandled error answering %s %s", ex.method, ex.path, exc_info=exc)
        if ex.finished:
            return
        if not ex.started and not self.closed:
            ex.respond(500, [(b"content-type", JSON)], error_bytes(500, "internal proxy error"), close=True)
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
