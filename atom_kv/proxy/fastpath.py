"""The hot path: ``POST /v1/completions`` and ``/v1/chat/completions`` as plain ASGI.

Installed as ASGI middleware in front of the Quart app (``app.asgi_app``); every
other route is Quart's. Serving the two relay routes without Quart's per-request
context machinery takes roughly half a millisecond off every request. A
client disconnect cancels the handler task, which cancels whichever upstream
leg is running (or closes the decode stream).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Awaitable, Callable

import msgspec

from atom_kv.proxy.errors import ProxyError, UpstreamResponseError
from atom_kv.proxy.metrics import ProxyMetrics
from atom_kv.proxy.relay import DecodeStream, Relay

logger = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
_json_decoder = msgspec.json.Decoder()

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class _Exchange:
    """Per-request flag shared by the handler and the disconnect watcher."""

    __slots__ = ("response_complete",)

    def __init__(self) -> None:
        self.response_complete = False


def valid_request_id(value: str | None) -> str:
    """The client's ``x-request-id`` if it is a sane token (echoed in headers and logs), else a uuid4 hex."""
    if value and len(value) <= 128 and value.isprintable() and value.isascii():
        return value
    return uuid.uuid4().hex


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class CompletionsASGI:
    """Serves the two completion routes through the :class:`Relay`; delegates the rest."""

    def __init__(self, inner: ASGIApp, relay: Relay, metrics: ProxyMetrics, max_request_bytes: int) -> None:
        self.inner = inner
        self.relay = relay
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http" or scope["path"] not in ROUTES:
            await self.inner(scope, receive, send)
            return
        t0 = time.perf_counter()
        request_id = valid_request_id(_header(scope, b"x-request-id"))
        path = scope["path"]
        if scope["method"] != "POST":
            await self._send_error(send, ProxyError(405, f"method {scope['method']} not allowed on {path}"),
                                   request_id, path, t0)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_request_bytes:
                await self._send_error(send, ProxyError(413, f"request body exceeds {self.max_request_bytes} bytes"),
                                       request_id, path, t0)
                return
            if not message.get("more_body", False):
                break
        exchange = _Exchange()
        handler = asyncio.ensure_future(self._handle(scope, bytes(body), send, request_id, t0, exchange))
        watcher = asyncio.ensure_future(self._wait_disconnect(receive, exchange))
        try:
            done, _ = await asyncio.wait((handler, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (handler, watcher):
                if not task.done():
                    task.cancel()
            await asyncio.gather(handler, watcher, return_exceptions=True)
        if handler in done and not handler.cancelled() and handler.exception() is not None:
            raise handler.exception()  # type: ignore[misc]

    @staticmethod
    async def _wait_disconnect(receive: Callable[[], Awaitable[dict]], exchange: "_Exchange") -> None:
        """Returns when the client goes away before the response is complete."""
        while (await receive())["type"] != "http.disconnect":
            pass
        if exchange.response_complete:
            # the server reports the finished exchange as a disconnect: not a client abort
            await asyncio.get_running_loop().create_future()

    def _count(self, path: str, status: int, t0: float) -> None:
        elapsed = time.perf_counter() - t0
        self.metrics.requests.labels(path, str(status)).inc()
        self.metrics.duration.labels(path).observe(elapsed)
        self.metrics.ttfb.labels(path).observe(elapsed)

    async def _send_body(self, send: Callable[[dict], Awaitable[None]], status: int, content_type: str,
                         body: bytes, request_id: str) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", content_type.encode("latin-1")),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", request_id.encode("latin-1")),
        ]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _send_error(self, send: Callable[[dict], Awaitable[None]], err: ProxyError, request_id: str,
                          path: str, t0: float) -> None:
        self._count(path, err.status, t0)
        logger.info("[%s] %s -> %d: %s", request_id, path, err.status, err.message)
        await self._send_body(send, err.status, "application/json", err.body(), request_id)

    async def _handle(self, scope: dict, raw: bytes, send: Callable[[dict], Awaitable[None]], request_id: str,
                      t0: float, exchange: "_Exchange") -> None:
        path = scope["path"]
        try:
            try:
                body: Any = _json_decoder.decode(raw)
            except msgspec.DecodeError as exc:
                raise ProxyError(400, f"request body is not valid JSON: {exc}") from None
            if not isinstance(body, dict):
                raise ProxyError(400, "request body must be a JSON object")
            result = await self.relay.relay(path, body, request_id, _header(scope, b"authorization"))
        except ProxyError as err:
            await self._send_error(send, err, request_id, path, t0)
            return
        except UpstreamResponseError as up:
            self._count(path, up.status, t0)
            logger.info("[%s] %s -> upstream %d passed through", request_id, path, up.status)
            await self._send_body(send, up.status, up.content_type, up.body, request_id)
            return
        except asyncio.CancelledError:
            self.metrics.client_disconnects.inc()
            self.metrics.requests.labels(path, "499").inc()
            logger.info("[%s] client disconnected; upstream legs cancelled", request_id)
            raise
        except Exception as exc:
            logger.exception("[%s] internal error relaying %s", request_id, path)
            await self._send_error(send, ProxyError(500, f"internal proxy error: {type(exc).__name__}"),
                                   request_id, path, t0)
            return
        if result.stream is None:
            self._count(path, result.status, t0)
            await self._send_body(send, result.status, result.content_type, result.body or b"", request_id)
            return
        stream = result.stream
        assert isinstance(stream, DecodeStream)
        try:
            await send({"type": "http.response.start", "status": result.status, "headers": [
                (b"content-type", result.content_type.encode("latin-1")),
                (b"cache-control", b"no-cache"),
                (b"x-request-id", request_id.encode("latin-1")),
            ]})
            first = True
            ended = False
            async for chunk in stream:
                if ended:
                    continue  # nothing follows [DONE]; just drain the upstream's end
                if first:
                    first = False
                    self.metrics.ttfb.labels(path).observe(time.perf_counter() - t0)
                # the SSE terminator closes our response at once (one send fewer per stream)
                ended = chunk.endswith(b"data: [DONE]\n\n")
                exchange.response_complete = ended
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            self.metrics.requests.labels(path, str(result.status)).inc()
            self.metrics.duration.labels(path).observe(time.perf_counter() - t0)
        except asyncio.CancelledError:
            self.metrics.requests.labels(path, "499").inc()
            raise
        finally:
            await stream.aclose()  # no-op after a complete stream; aborts the decode leg otherwise
