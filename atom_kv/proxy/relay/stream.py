"""The decode leg's event stream, as the opaque object the HTTP layer pipes to its client."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Protocol

from atom_kv.openai_errors import sse_error_event
from atom_kv.proxy.fleet.health import UpstreamHealth
from atom_kv.proxy.http.sse import DONE_EVENT, EventFramer, EventTooLarge
from atom_kv.proxy.http.upstream import UpstreamError, UpstreamResponse, UpstreamTimeout
from atom_kv.proxy.relay.errors import EngineFailures
from atom_kv.proxy.routing.pick import Charge

logger = logging.getLogger(__name__)


class StreamSink(Protocol):
    """Where a streamed answer goes (the client's side of the exchange)."""

    def write(self, data: bytes) -> None:
        """One write to the client."""

    def end(self, data: bytes = b"") -> None:
        """The last write (if any) and the end of the answer."""

    def flush_head(self) -> None:
        """Send the answer's head now if no write took it along."""

    def set_producer(self, producer: object) -> None:
        """Who to pause (``pause_reading``/``resume_reading``) while the client is behind."""


class ResponseStream(Protocol):
    """What the HTTP layer needs from a streamed answer: ``pipe`` it to the client
    (returns once the client's answer is complete), and ``aclose()`` to abandon it
    (``release``: also release the prefill's KV, e.g. the client stalled)."""

    async def pipe(self, sink: StreamSink) -> None: ...

    def aclose(self, release: bool = False) -> None: ...


class DecodeStream:
    """Owns the decode leg's answer until it ends, and the leg's charge: writes its events to the client,
    and gives the charge back once, when the upstream answer is over (read to its end, failed, or
    dropped by :meth:`aclose`).

    The upstream connection delivers each read from its own callbacks
    (:meth:`body_received`), and the events in it are written at once, one
    write each. Only when more than ``split_max`` whole events arrive in one
    read (the proxy fell behind the engine, so writing them apart would only
    add system calls while the stream catches up) do they go out in one write.
    While the client's socket buffer is full, reading from the engine pauses.

    The client's answer ends with the ``[DONE]`` event; the rest of the
    upstream answer is read (the connection is then reused). If the upstream
    fails mid-way (the decode engine died, a read timed out) the answer ends
    with a ``data: {"error": ...}`` event plus ``data: [DONE]`` and the failure
    is reported to :class:`UpstreamHealth` (a dropped connection takes the
    engine out of routing at once); the event's message is ``failures``' (the engine's address only
    with ``--expose-upstream-errors``). ``aclose()`` before the end (the client
    went away) drops the upstream connection so the decode engine aborts the
    request; it is idempotent and safe at any point.
    """

    def __init__(self, resp: UpstreamResponse, request_id: str, d: Charge, health: UpstreamHealth,
                 framer: EventFramer, split_max: int = 4, on_release: Callable[[], None] | None = None, *,
                 failures: EngineFailures | None = None) -> None:
        self._resp = resp
        self._failures = failures if failures is not None else EngineFailures()
        self._on_release = on_release
        self._request_id = request_id
        self._d = d
        self._health = health
        self._framer = framer
        self._split_max = split_max
        self._sink: StreamSink | None = None
        self._done: asyncio.Future | None = None
        self._sent_any = False
        self._upstream_over = False
        self.complete = False  # the client's answer is complete ([DONE], the upstream's end, or our error tail)

    # ------------------------------------------------------------------ to the HTTP layer
    async def pipe(self, sink: StreamSink) -> None:
        self._sink = sink
        self._done = asyncio.get_running_loop().create_future()
        sink.set_producer(self)
        self._resp.stream(self)  # what already arrived is written now
        if not self.complete:
            sink.flush_head()
            await self._done

    def aclose(self, release: bool = False) -> None:
        if self.complete:
            return  # only the upstream's tail is still being read; it ends by itself (or times out)
        if not self._leg_over():
            return
        self._resp.close()
        if release and self._on_release is not None:
            self._on_release()
        logger.info("[%s] decode leg cancelled (the client went away mid-stream)", self._request_id)

    def _leg_over(self) -> bool:
        """The upstream answer is over (read to its end, failed, or dropped by us): True the one time
        that happens, which is when the leg's charge goes back."""
        if self._upstream_over:
            return False
        self._upstream_over = True
        self._d.release()
        return True

    # ------------------------------------------------------------------ back-pressure
    def pause_reading(self) -> None:
        self._resp.pause_reading()

    def resume_reading(self) -> None:
        self._resp.resume_reading()

    # ------------------------------------------------------------------ from the upstream connection
    def body_received(self, data: bytes) -> None:
        if self.complete:
            return  # after [DONE]: the upstream's tail is drained
        sink = self._sink
        assert sink is not None
        try:
            writes = self._framer.feed_writes(data, self._split_max)
        except EventTooLarge as exc:
            self._event_too_large(exc)
            return
        for piece, ends in writes:
            self._sent_any = True
            if ends:
                self._end_client(piece)
                return
            sink.write(piece)

    def body_complete(self) -> None:
        if not self._leg_over():
            return
        if not self.complete:
            tail = self._framer.flush()
            if tail:
                self._sent_any = True
                self._end_client(tail)
            elif not self._sent_any:
                self._health.failed(self._d.inst, "bad_response")
                err = self._failures.error(502, self._d.inst, "sent an empty stream",
                                           f"decode instance {self._d.inst.base_url} sent an empty stream",
                                           self._request_id)
                logger.warning("[%s] %s", self._request_id, err.logged)
                self._end_client(sse_error_event(err.status, err.message))
                return
            else:
                self._end_client(b"")
        self._health.succeeded(self._d.inst)

    def body_failed(self, exc: UpstreamError) -> None:
        if not self._leg_over():
            return
        if self.complete:
            return  # the client has its whole answer; only the tail's read failed
        timeout = isinstance(exc, UpstreamTimeout)
        self._health.failed(self._d.inst, "timeout" if timeout else "connection", exc)
        detail = "timed out" if timeout else f"unreachable: {exc}"
        err = self._failures.error(
            504 if timeout else 502, self._d.inst, "timed out" if timeout else "dropped the connection",
            f"decode stream interrupted: decode instance {self._d.inst.base_url} {detail}", self._request_id,
            prefix="decode stream interrupted: ")
        logger.warning("[%s] %s", self._request_id, err.logged)
        self._end_client(sse_error_event(err.status, err.message))

    def _event_too_large(self, exc: EventTooLarge) -> None:
        """The engine sent an event over the bound: the stream ends here with an error event (a
        request can ask for huge events, e.g. prompt logprobs: judged like a 500, not a dead engine)."""
        if not self._leg_over():
            return
        self._resp.close()
        self._health.failed(self._d.inst, "too_large", suspect=True)
        over = f"sent {exc}, over --max-upstream-body-bytes"  # the proxy's words: the client may read them
        err = self._failures.error(
            502, self._d.inst, over, f"decode stream interrupted: decode instance {self._d.inst.base_url} {over}",
            self._request_id, prefix="decode stream interrupted: ")
        logger.warning("[%s] %s", self._request_id, err.logged)
        self._end_client(sse_error_event(err.status, err.message))

    def _end_client(self, data: bytes) -> None:
        self.complete = True
        assert self._sink is not None
        self._sink.end(data)
        done = self._done
        if done is not None and not done.done():
            done.set_result(None)


__all__ = ["DecodeStream", "ResponseStream", "StreamSink", "DONE_EVENT"]
