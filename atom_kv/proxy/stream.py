"""The decode leg's event stream, as the opaque async iterator the HTTP layer sends out."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, AsyncIterator, Protocol

import aiohttp

from atom_kv.openai_errors import sse_error_event
from atom_kv.proxy.health import UpstreamHealth, is_connection_failure
from atom_kv.proxy.sse import DONE_EVENT, EventFramer

if TYPE_CHECKING:
    from atom_kv.proxy.relay import Pick

logger = logging.getLogger(__name__)


class ResponseStream(Protocol):
    """What the HTTP layer needs from a streamed answer: whole events, whether the
    last one was the stream's end (``complete``), and ``aclose()`` to abandon it."""

    complete: bool

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def __anext__(self) -> bytes: ...

    async def aclose(self) -> None: ...


class DecodeStream:
    """Owns the decode leg's response until it ends: yields what to write to the client.

    Events are forwarded as they arrive, one write each. Only when more than
    ``split_max`` whole events arrive in one read (the proxy fell behind the
    engine, so writing them apart would only add system calls while the
    stream catches up) do they go out in one write.

    If the upstream fails mid-way (the decode engine died, a read timed out)
    it ends with a ``data: {"error": ...}`` event plus ``data: [DONE]`` and
    reports the failure to :class:`UpstreamHealth` (a dropped connection
    takes the engine out of routing at once). ``aclose()`` before the end
    (the client went away) drops the upstream connection so the decode
    engine aborts the request; it is idempotent and safe at any point.
    """

    def __init__(self, resp: aiohttp.ClientResponse, request_id: str, d: "Pick", health: UpstreamHealth,
                 framer: EventFramer, split_max: int = 4) -> None:
        self._resp = resp
        self._chunks = resp.content.iter_any()
        self._request_id = request_id
        self._d = d
        self._health = health
        self._framer = framer
        self._split_max = split_max
        self._ready: deque[tuple[bytes, bool]] = deque()  # (bytes to write, whether they end the stream)
        self._sent_any = False
        self._upstream_done = False
        self._finished = False
        self.complete = False  # the last event yielded ended the stream ([DONE] or our error tail)

    def __aiter__(self) -> "DecodeStream":
        return self

    async def __anext__(self) -> bytes:
        while not self._ready:
            if self.complete or self._upstream_done:
                await self._drain()
                raise StopAsyncIteration
            await self._read()
        data, ends = self._ready.popleft()
        self._sent_any = True
        if ends:
            self.complete = True
            self._ready.clear()  # nothing follows [DONE]
        return data

    async def _read(self) -> None:
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            self._upstream_done = True
            tail = self._framer.flush()
            if tail:
                self._ready.append((tail, tail == DONE_EVENT))
            elif not self._sent_any:
                self._health.failed(self._d.inst, "bad_response")
                self._fail(502, f"decode instance {self._d.inst.base_url} sent an empty stream", ok_close=True)
                return
            self._health.succeeded(self._d.inst)
            self._finish(ok=True)
            return
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            timeout = isinstance(exc, asyncio.TimeoutError) and not is_connection_failure(exc)
            self._health.failed(self._d.inst, "timeout" if timeout else "connection", exc)
            detail = "timed out" if timeout else f"unreachable: {exc or type(exc).__name__}"
            status = 504 if timeout else 502
            message = f"decode stream interrupted: decode instance {self._d.inst.base_url} {detail}"
            logger.warning("[%s] %s", self._request_id, message)
            self._fail(status, message, ok_close=False)
            return
        except BaseException:
            await self.aclose()
            raise
        self._ready.extend(self._framer.feed_writes(chunk, self._split_max))

    def _fail(self, status: int, message: str, ok_close: bool) -> None:
        self._ready.append((sse_error_event(status, message), True))
        self._upstream_done = True
        self._finish(ok=ok_close)

    async def _drain(self) -> None:
        """After [DONE]: read the upstream's end so its connection can be reused."""
        if self._finished:
            return
        try:
            async for _ in self._chunks:
                pass
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
            self._finish(ok=False)
            return
        self._health.succeeded(self._d.inst)
        self._finish(ok=True)

    def _finish(self, ok: bool) -> None:
        if self._finished:
            return
        self._finished = True
        if ok:
            self._resp.release()
        else:
            self._resp.close()
        self._d.credit()

    async def aclose(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._resp.close()
        self._d.credit()
        if not self.complete:
            logger.info("[%s] decode leg cancelled (the client went away mid-stream)", self._request_id)
