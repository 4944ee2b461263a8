"""The answer side of the proxy's upstream client (:mod:`atom_kv.proxy.http.upstream`): one
exchange's :class:`UpstreamResponse` (status, headers, then a body read whole or streamed to a
:class:`BodyConsumer`), the bounds on an engine's answer (:class:`AnswerLimits`) and the
:class:`UpstreamError` family every failure is.

Only a final answer (200..599) is ever an exchange's answer. Interim (1xx) answers before it are read
past and dropped, each fed to the parser on its own and bounded with the final head; a 101 (an
upgrade), an interim answer that announces a body, or a status outside 100..599 is an
:class:`UpstreamProtocolError`. Bytes after the end of the answer, and a trailer, are never read as
the next answer or as a header: a connection that carried either is closed, not pooled."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import httptools

__all__ = [
    "AnswerLimits", "BodyConsumer", "Carrier", "UpstreamConnectTimeout", "UpstreamConnectionError", "UpstreamError",
    "UpstreamProtocolError", "UpstreamResponse", "UpstreamTimeout", "UpstreamTooLarge",
]

class UpstreamError(Exception):
    """An upstream exchange failed (see the subclasses)."""


class UpstreamConnectTimeout(UpstreamError):
    """No connection within the connect timeout (pool slot and TCP connect)."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The peer was silent too long, or the whole exchange took too long."""


class UpstreamConnectionError(UpstreamError, ConnectionError):
    """Refused, reset or closed before the answer ended, or (an :class:`UpstreamProtocolError`) not HTTP."""


class UpstreamProtocolError(UpstreamConnectionError):
    """The answer broke HTTP/1.1 as the proxy speaks it: not HTTP, a 101 or other upgrade, an interim
    (1xx) answer with a body or past the bound, a status outside 100..599. Its connection is closed."""


class _StopParsing(Exception):
    """Raised in a parser callback to stop the parser at once (the reason is the response's ``_refused``)."""


class UpstreamTooLarge(UpstreamError):
    """The answer's head or body is over the proxy's bounds (the message names the flag)."""


class AnswerLimits:
    """The bounds on one engine answer (see the module doc); the flags that set them name them in errors.
    ``head`` bounds the answer's heads together, its interim (1xx) ones included; ``interim`` is the
    most interim answers taken before the final one."""

    __slots__ = ("head", "body", "server_timing", "interim")

    def __init__(self, head: int = 64 * 1024, body: int = 64 * 1024 * 1024, server_timing: int = 4096,
                 interim: int = 16) -> None:
        self.head = head
        self.body = body
        self.server_timing = server_timing
        self.interim = interim


_SERVER_TIMING = "server-timing"
_HEAD_END = b"\r\n\r\n"
_FINAL_FIRST_DIGITS = (b"2", b"3", b"4", b"5")


def _final_status_line(data: bytes | bytearray, pos: int) -> bool:
    """Whether the head at ``pos`` opens with a final status line (``HTTP/1.x 2..5xx``), which the parser
    may take in one feed with what follows it. Anything else is fed alone up to its head's end: the
    parser rejects any other spelling of a final status line, so this never takes an interim one."""
    return (data[pos + 9:pos + 10] in _FINAL_FIRST_DIGITS and data[pos + 8:pos + 9] == b" "
            and data.startswith(b"HTTP/1.", pos))


class BodyConsumer(Protocol):
    """Receives a streamed body from the connection's callbacks (see :meth:`UpstreamResponse.stream`)."""

    def body_received(self, data: bytes) -> None:
        """Everything one read brought (never empty)."""

    def body_complete(self) -> None:
        """The body ended cleanly (the connection is already back in the pool, or closed)."""

    def body_failed(self, exc: UpstreamError) -> None:
        """The exchange failed mid-body (the connection is closed)."""


class Carrier(Protocol):
    """What a response uses of the connection that carries it (the pool's own connection class)."""

    loop: asyncio.AbstractEventLoop
    pool: Any  # the UpstreamPool: its ``limits``

    def abort(self) -> None: ...

    def finished(self, reusable: bool) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class UpstreamResponse:
    """One exchange on one connection: the final answer's status (200..599) and headers, then its
    body (:meth:`read` it whole, or :meth:`stream` it to a consumer); interim (1xx) answers are
    read past (see the module doc). Owns the connection until the body ends or :meth:`close` is called."""

    __slots__ = ("status", "headers", "_conn", "_loop", "_parser", "_body", "_waiter", "_consumer",
                 "_headers_done", "_complete", "_failed", "_released", "_whole", "_timer", "_deadline",
                 "_read_timeout", "_last_read", "_length_known", "_keep_alive", "_got_bytes", "_paused",
                 "_limits", "_head_buf", "_held", "_too_large", "_heads_seen", "_interims", "_refused")

    def __init__(self, conn: "Carrier", whole: bool, read_timeout: float | None,
                 total_timeout: float | None) -> None:
        self._conn = conn
        self._loop = conn.loop
        self._parser = httptools.HttpResponseParser(self)
        self._limits: AnswerLimits = conn.pool.limits
        self._head_buf: bytearray | None = None  # a head split over reads, until its end arrives
        self._held = 0  # body bytes held in ``_body``
        self._too_large: str | None = None  # set by a parser callback, failed after the feed
        self._heads_seen = 0  # bytes of the interim heads fed so far (bounded with the final head)
        self._interims = 0  # interim (1xx) answers read past
        self._refused: str | None = None  # why a parser callback stopped the parser (a protocol error)
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
    def on_message_begin(self) -> None:
        if self._complete:  # more after the end of the answer: not an answer to anything we asked
            raise _StopParsing

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._headers_done:
            return  # a trailer (after a chunked body): never one of the answer's headers
        key = name.decode("latin-1").lower()
        if key in ("content-length", "transfer-encoding"):
            self._length_known = True
        if key == _SERVER_TIMING and len(value) > self._limits.server_timing:
            return  # dropped unread (--max-server-timing-bytes): the spans of this leg go without it
        self.headers[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            self._interim(status)
            return
        if status > 599:
            self._refuse(f"the engine answered status {status}, outside 100..599")
        self.status = status
        self._headers_done = True
        length = self.headers.get("content-length", "")
        if self._whole and length.isdigit() and int(length) > self._limits.body:
            self._too_large = self._body_error(f"announced {length} bytes")
            return
        if not self._whole:
            self._wake()

    def _interim(self, status: int) -> None:
        """An interim (1xx) head: checked and dropped (the final answer follows), or refused."""
        if status < 100:
            self._refuse(f"the engine answered status {status}, outside 100..599")
        if status == 101 or self._parser.should_upgrade():
            self._refuse(f"the engine answered {status} (Switching Protocols), an upgrade the proxy never asks for: "
                         "it speaks only HTTP/1.1 to engines (is an engine listening at that address?)")
        if "transfer-encoding" in self.headers or self.headers.get("content-length", "0").strip() != "0":
            self._refuse(f"the engine's interim answer {status} announces a body (an interim answer has none)")
        self._interims += 1
        if self._interims > self._limits.interim:
            self._refuse(f"the engine sent more than {self._limits.interim} interim (1xx) answers")
        self.headers = {}  # none of an interim answer's headers is the final answer's
        self._length_known = False

    def _refuse(self, why: str) -> None:
        self._refused = why
        raise _StopParsing

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

    def _through_heads(self, data: bytes | bytearray) -> bytes | bytearray | None:
        """Feed the answer's interim (1xx) heads, each alone; return the final head and what follows it
        once the final head's end is in, None while it is not (``data`` is kept). A head is given to the
        parser whole (see the module doc of :mod:`atom_kv.proxy.http.upstream`), an interim one alone so
        that the next head is bounded too. Raises :class:`UpstreamTooLarge` past the bound on the heads
        together, :class:`UpstreamProtocolError` for a refused interim answer."""
        buf = self._head_buf
        scan = 0
        if buf is not None:
            scan = max(len(buf) - 3, 0)
            buf += data
            data = buf
        pos = 0
        room = self._limits.head - self._heads_seen
        while True:
            end = data.find(_HEAD_END, scan)
            if (end if end >= 0 else len(data)) - pos > room:
                raise UpstreamTooLarge(
                    f"the engine's answer head is over --max-upstream-head-bytes ({self._limits.head})")
            if end < 0:
                self._head_buf = buf if buf is not None and pos == 0 else bytearray(data[pos:])
                return None
            if _final_status_line(data, pos):
                self._head_buf = None
                return data if pos == 0 else data[pos:]
            head_end = end + 4
            self._feed(data[pos:head_end])
            room -= head_end - pos
            self._heads_seen += head_end - pos
            pos = scan = head_end
            if self._headers_done or pos == len(data):  # a final head after all (an odd status line), or all fed
                self._head_buf = None
                return data[pos:] if self._headers_done else None

    def _feed(self, data: bytes | bytearray) -> None:
        """Give ``data`` to the parser; raises :class:`UpstreamProtocolError` for an answer it or a
        callback refused. Bytes after the end of the answer leave the answer whole, its connection
        not reused."""
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self._complete:
                self._keep_alive = False
                return
            raise UpstreamProtocolError(self._refused or f"invalid HTTP answer: {exc}") from None

    def on_message_complete(self) -> None:
        if not self._headers_done:
            return  # an interim answer ended: the final one follows
        if self._too_large is not None:
            return  # over the bound, whole in one read: failed after the feed, never complete
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()

    # ------------------------------------------------------------------ from the connection
    def _data(self, data: bytes) -> None:
        self._got_bytes = True
        self._last_read = self._loop.time()
        if self._complete:  # more after the end of the answer (read whole, not read yet): never reused
            self._keep_alive = False
            return
        try:
            chunk: bytes | bytearray = data
            if not self._headers_done:
                rest = self._through_heads(data)
                if rest is None:
                    return
                chunk = rest
            if chunk:
                self._feed(chunk)
        except UpstreamError as exc:
            self._fail(exc)
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
