"""One request and its answer on the proxy's HTTP/1.1 server (:class:`Exchange`), and what a
handler gets: the request's parts, and :meth:`Exchange.respond` or a streamed answer whose
back-pressure reaches its :class:`Producer`. The connection that reads requests and writes answers
is :mod:`atom_kv.proxy.http.connection`; this module knows it only as a :class:`Connection`."""

from __future__ import annotations

import asyncio
import http
import time
from typing import Any, Callable, Coroutine, Protocol

__all__ = ["Connection", "DateHeader", "Exchange", "Handler", "Producer", "REASONS", "JSON"]

REASONS = {s.value: s.phrase.encode("ascii") for s in http.HTTPStatus}
JSON = b"application/json"


class Producer(Protocol):
    """Whatever feeds a streamed answer; paused while the client's socket buffer is full."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class Connection(Protocol):
    """What an exchange uses of the connection it came on (:class:`~atom_kv.proxy.http.connection.ServerConnection`)."""

    server: Any  # the HTTPServer: its ``date``, ``shutting_down`` and ``body_in_flight``
    loop: asyncio.AbstractEventLoop
    peer: tuple[str, int] | None
    local: tuple[str, int] | None
    writing_paused: bool

    def write(self, data: bytes) -> None: ...

    def exchange_finished(self, ex: "Exchange") -> None: ...

    def close(self, abort: bool = False) -> None: ...


class DateHeader:
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
    ``raw_path``, ``query``, ``headers`` (lower-case names, bytes; the head's only: a
    chunked body's trailers are dropped), ``body``. When the server refused the request
    itself (a too big or too slow body) ``refusal`` is ``(status, message)`` and the
    handler only has to answer it. The answer goes out through :meth:`respond` or
    :meth:`start_stream`/:meth:`write`/:meth:`end`."""

    __slots__ = ("conn", "method", "raw_target", "path", "raw_path", "query", "headers", "http_version",
                 "keep_alive", "body_parts", "body_size", "refusal", "head_size", "complete", "head_done",
                 "expect_continue", "trailer_lines", "chunk_waiting", "idle_chunk_bytes",
                 "_pending_head", "_chunked", "_finished", "_started", "task", "_producer", "_head_only", "_done",
                 "stalled", "_buf", "budget_held")

    def __init__(self, conn: "Connection") -> None:
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
        self._buf: bytearray | None = None  # the body, once it came in more than one piece
        self.budget_held = 0  # bytes of the server's body budget this request holds
        self.body_size = 0
        self.head_size = 0  # the head's bytes, and its trailers' (see ServerConnection.on_header)
        self.trailer_lines = 0
        self.chunk_waiting = False  # a chunk's size line was read and none of its data yet (or: its trailers)
        self.idle_chunk_bytes = 0  # bytes read in that state since (see ServerConnection.data_received)
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

    def add_body(self, piece: bytes) -> None:
        """One more piece of the body as it arrived: the first is kept as it is, later ones are
        appended to one buffer that grows with them (never sized by what the head announced)."""
        buf = self._buf
        if buf is not None:
            buf += piece
        elif not self.body_parts:
            self.body_parts.append(piece)
        else:
            self._buf = bytearray(self.body_parts[0])
            self._buf += piece
            self.body_parts = []

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
        parts = [b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, b"Unknown"))]
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


Handler = Callable[[Exchange], Coroutine[Any, Any, None]]  # an async def: the loop runs it as a task
