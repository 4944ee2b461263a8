"""The hot path: ``POST /v1/completions`` and ``/v1/chat/completions`` as plain ASGI.

Installed as ASGI middleware in front of the Quart app (``app.asgi_app``); every
other route is Quart's. Serving the two relay routes without Quart's
per-request context machinery takes roughly half a millisecond off every
request (measured with ``python -m atom_kv.bench proxy``). This module owns
the client side of a request: reading the body (bounded in size and time),
the answer's framing (one write per SSE event), and the request's metrics
(:class:`~atom_kv.proxy.metrics.RequestRecord`, including client
disconnects). A client disconnect cancels the handler task, which cancels
whichever upstream leg is running (or closes the decode stream).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Awaitable, Callable

import msgspec

from atom_kv.proxy.errors import ProxyError, UpstreamResponseError
from atom_kv.proxy.metrics import ProxyMetrics, RequestRecord
from atom_kv.proxy.relay import Relay, RelayResult

logger = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
_json_decoder = msgspec.json.Decoder()

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[dict, Receive, Send], Awaitable[None]]


class _Exchange:
    """Per-request flags shared by the handler and the disconnect watcher."""

    __slots__ = ("response_complete", "client_gone")

    def __init__(self) -> None:
        self.response_complete = False
        self.client_gone = False


class _BodyTimeout(Exception):
    """The request body did not arrive within ``body_timeout``."""


def _uncancel(task: asyncio.Task) -> None:
    """Withdraw a cancellation this module requested itself (Python 3.11+ keeps a count)."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is not None:
        uncancel()


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


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; a 400 naming the problem otherwise (bad UTF-8 and
    absurd nesting included: they are the client's mistake, not a proxy failure)."""
    try:
        body: Any = _json_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise ProxyError(400, f"request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ProxyError(400, f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    except RecursionError:
        raise ProxyError(400, "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object")
    return body


class CompletionsASGI:
    """Serves the two completion routes through the :class:`Relay`; delegates the rest."""

    def __init__(self, inner: ASGIApp, relay: Relay, metrics: ProxyMetrics, max_request_bytes: int,
                 body_timeout: float) -> None:
        self.inner = inner
        self.relay = relay
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in ROUTES:
            await self.inner(scope, receive, send)
            return
        record = RequestRecord(self.metrics, scope["path"])
        request_id = valid_request_id(_header(scope, b"x-request-id"))
        if scope["method"] != "POST":
            await self._send_error(send, ProxyError(405, f"method {scope['method']} not allowed on {scope['path']}"),
                                   request_id, record)
            return
        me = asyncio.current_task()
        assert me is not None
        try:
            raw = await self._read_body_in_time(receive, me)
        except _BodyTimeout:
            await self._send_error(send, ProxyError(408, f"request body not received within {self.body_timeout:g}s"),
                                   request_id, record, close=True)
            return
        except ProxyError as err:
            await self._send_error(send, err, request_id, record, close=True)
            return
        if raw is None:  # the client left while sending
            record.client_gone()
            return
        # the request runs in this task; a watcher cancels it if the client goes away first
        exchange = _Exchange()
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(receive, exchange, me))
        try:
            await self._handle(scope, raw, send, request_id, record, exchange)
        except asyncio.CancelledError:
            if not exchange.client_gone:
                raise
            _uncancel(me)  # our own cancellation: the request is over, the server's task is not
        finally:
            watcher.cancel()

    async def _read_body_in_time(self, receive: Receive, me: asyncio.Task) -> bytes | None:
        """The body, or :class:`_BodyTimeout` after ``body_timeout`` (a timer, not a task per request)."""
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            me.cancel()

        timer = asyncio.get_running_loop().call_later(self.body_timeout, expire)
        try:
            return await self._read_body(receive)
        except asyncio.CancelledError:
            if not expired:
                raise
            _uncancel(me)
            raise _BodyTimeout() from None
        finally:
            timer.cancel()

    async def _read_body(self, receive: Receive) -> bytes | None:
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_request_bytes:
                raise ProxyError(413, f"request body exceeds {self.max_request_bytes} bytes")
            if not message.get("more_body", False):
                return bytes(body)

    @staticmethod
    async def _watch_disconnect(receive: Receive, exchange: _Exchange, request_task: asyncio.Task) -> None:
        """Cancels the request's task when the client goes away before the response is complete."""
        while (await receive())["type"] != "http.disconnect":
            pass
        if not exchange.response_complete:  # the server also reports a finished exchange as a disconnect
            exchange.client_gone = True
            request_task.cancel()

    @staticmethod
    async def _send_body(send: Send, status: int, content_type: str, body: bytes, request_id: str,
                         close: bool = False) -> None:
        headers = [
            (b"content-type", content_type.encode("latin-1")),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", request_id.encode("latin-1")),
        ]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _send_error(self, send: Send, err: ProxyError, request_id: str, record: RequestRecord,
                          close: bool = False) -> None:
        record.finish(err.status)
        logger.info("[%s] %s -> %d: %s", request_id, record.endpoint, err.status, err.message)
        await self._send_body(send, err.status, "application/json", err.body(), request_id, close)

    async def _handle(self, scope: dict, raw: bytes, send: Send, request_id: str, record: RequestRecord,
                      exchange: _Exchange) -> None:
        path = scope["path"]
        try:
            body = parse_body(raw)
            result = await self.relay.relay(path, body, request_id, _header(scope, b"authorization"))
        except ProxyError as err:
            exchange.response_complete = True
            await self._send_error(send, err, request_id, record)
            return
        except UpstreamResponseError as up:
            record.finish(up.status)
            logger.info("[%s] %s -> upstream %d passed through", request_id, path, up.status)
            exchange.response_complete = True
            await self._send_body(send, up.status, up.content_type, up.body, request_id)
            return
        except asyncio.CancelledError:
            record.client_gone()
            logger.info("[%s] client disconnected; upstream legs cancelled", request_id)
            raise
        except Exception as exc:
            logger.exception("[%s] internal error relaying %s", request_id, path)
            exchange.response_complete = True
            await self._send_error(send, ProxyError(500, f"internal proxy error: {type(exc).__name__}"),
                                   request_id, record)
            return
        if result.stream is None:
            record.finish(result.status)
            exchange.response_complete = True
            await self._send_body(send, result.status, result.content_type, result.body or b"", request_id)
            return
        await self._send_stream(send, result, request_id, record, exchange)

    async def _send_stream(self, send: Send, result: RelayResult, request_id: str, record: RequestRecord,
                           exchange: _Exchange) -> None:
        stream = result.stream
        assert stream is not None
        try:
            await send({"type": "http.response.start", "status": result.status, "headers": [
                (b"content-type", result.content_type.encode("latin-1")),
                (b"cache-control", b"no-cache"),
                (b"x-request-id", request_id.encode("latin-1")),
            ]})
            async for event in stream:  # as the events arrive (see DecodeStream): the client sees the engine's timing
                record.first_byte()
                ended = stream.complete  # the stream's end closes our response at once
                exchange.response_complete = ended
                await send({"type": "http.response.body", "body": event, "more_body": not ended})
                if ended:
                    record.finish(result.status)
            if not exchange.response_complete:
                exchange.response_complete = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            record.finish(result.status)
        except asyncio.CancelledError:
            record.client_gone()
            raise
        finally:
            await stream.aclose()  # no-op after a complete stream; aborts the decode leg otherwise
