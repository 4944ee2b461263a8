"""The hot path: ``POST /v1/completions`` and ``/v1/chat/completions``, served natively.

The proxy's HTTP server (:mod:`atom_kv.proxy.http.httpserver`) calls
:class:`CompletionsHandler` for the two relay routes with a whole request
(its size and arrival time already bounded: a refused one only needs its
answer, and its ``Host`` already checked: :mod:`atom_kv.proxy.http.guard`); a
body not declared ``application/json`` is answered 415 before it is parsed;
every other route is Quart's. Serving the relay routes without
Quart's per-request context machinery and without ASGI message dicts is
measured with ``python -m atom_kv.bench proxy``. This module owns the client
side of a request: parsing the body, the answer (one write per SSE event,
see :class:`~atom_kv.proxy.relay.stream.DecodeStream`), and the request's metrics
(:class:`~atom_kv.proxy.observability.metrics.RequestRecord`, including client
disconnects). A client disconnect cancels the request's task, which cancels
whichever upstream leg is running (or closes the decode stream).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from typing import TYPE_CHECKING, Any

import msgspec

from atom_kv.logfmt import REQUEST_ID
from atom_kv.proxy.admission.buckets import ClientBuckets, client_key
from atom_kv.proxy.http.guard import json_body_problem
from atom_kv.proxy.http.httpserver import Exchange
from atom_kv.proxy.observability.metrics import CLIENT_CLOSED, ProxyMetrics, RequestRecord
from atom_kv.proxy.observability.spans import RequestSpans
from atom_kv.proxy.relay.errors import ProxyError, UpstreamResponseError
from atom_kv.proxy.relay.relay import Relay, RelayResult

if TYPE_CHECKING:
    from atom_kv.proxy.observability.otel import ProxyTracer

logger = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
_json_decoder = msgspec.json.Decoder()

def valid_request_id(value: str | None) -> str:
    """The client's ``x-request-id`` if it is a sane token (echoed in headers and logs), else 32 random hex digits."""
    if value and len(value) <= 128 and value.isprintable() and value.isascii():
        return value
    return os.urandom(16).hex()


def parse_body(raw: bytes | bytearray) -> dict[str, Any]:
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


class _RecordedSink:
    """The client's side of a streamed answer, counting its first byte and its end."""

    __slots__ = ("_exchange", "_record", "_status", "_first", "_spans")

    def __init__(self, exchange: Exchange, record: RequestRecord, status: int, spans: RequestSpans | None) -> None:
        self._exchange = exchange
        self._record = record
        self._status = status
        self._first = True
        self._spans = spans

    def write(self, data: bytes) -> None:
        self._exchange.write(data)
        if self._first:
            self._first = False
            self._record.first_byte()
            if self._spans is not None:
                self._spans.first_write()

    def end(self, data: bytes = b"") -> None:
        self._exchange.end(data)
        if self._first and self._spans is not None:
            self._first = False
            self._spans.first_write()
        self._record.finish(self._status)

    def flush_head(self) -> None:
        self._exchange.flush_head()

    def set_producer(self, producer: Any) -> None:
        self._exchange.set_producer(producer)


class CompletionsHandler:
    """Serves the two completion routes through the :class:`Relay` (one call per exchange)."""

    def __init__(self, relay: Relay, metrics: ProxyMetrics, buckets: ClientBuckets | None = None) -> None:
        self.relay = relay
        self.metrics = metrics
        self.buckets = buckets  # --rate-limit: one token bucket per client (None: off)
        self.tracer: ProxyTracer | None = None  # set while the proxy exports traces (--otlp-traces-endpoint)

    def routes(self) -> dict[str, Any]:
        return {path: self for path in ROUTES}

    async def __call__(self, exchange: Exchange) -> None:
        path = exchange.path
        record = RequestRecord(self.metrics, path)
        request_id = valid_request_id(exchange.header(b"x-request-id"))
        REQUEST_ID.set(request_id)  # for the log lines of this exchange's task and its legs' (its own context)
        if exchange.refusal is not None:  # too big, or too slow to arrive: the server read no further
            self._send_error(exchange, ProxyError(*exchange.refusal), request_id, record, close=True)
            return
        if exchange.method != "POST":
            self._send_error(exchange, ProxyError(405, f"method {exchange.method} not allowed on {path}"),
                             request_id, record)
            return
        problem = json_body_problem(exchange)  # a cross-site page can POST text/plain, not application/json
        if problem is not None:
            self.metrics.refused_requests.labels("content_type").inc()
            self._send_error(exchange, ProxyError(415, problem), request_id, record)
            return
        if self.buckets is not None:
            client = exchange.client
            wait = self.buckets.take(client_key(exchange.header(b"authorization"), client[0] if client else None))
            if wait:
                self.metrics.admission_rejections.labels("rate_limited").inc()
                after = max(1, math.ceil(wait))
                self._send_error(exchange, ProxyError(
                    429, f"this client is over the proxy's rate limit of {self.buckets.rps:g} requests a second "
                         f"(burst {self.buckets.burst}); retry after {after}s", retry_after=after), request_id, record)
                return
        tracer = self.tracer  # None unless --otlp-traces-endpoint: then one trace per request
        trace = None if tracer is None else tracer.begin(path, request_id, record.t0, exchange.header(b"traceparent"),
                                                         exchange.header(b"tracestate"))
        try:
            try:
                body = parse_body(exchange.body_view())  # in place, then the raw bytes go
                exchange.drop_body()
                result = await self.relay.relay(path, body, request_id, exchange.header(b"authorization"),
                                                received=record.t0, trace=trace)
            except ProxyError as err:
                self._send_error(exchange, err, request_id, record)
                return
            except UpstreamResponseError as up:
                record.finish(up.status)
                logger.info("[%s] %s -> upstream %d passed through", request_id, path, up.status)
                exchange.respond(up.status, _headers(up.content_type, request_id), up.body)
                return
            except asyncio.CancelledError:
                record.client_gone()
                logger.info("[%s] client disconnected; upstream legs cancelled", request_id)
                raise
            except Exception as exc:
                logger.exception("[%s] internal error relaying %s", request_id, path)
                self._send_error(exchange, ProxyError(500, f"internal proxy error: {type(exc).__name__}"),
                                 request_id, record)
                return
            if result.stream is None:
                record.finish(result.status)
                exchange.respond(result.status, _headers(result.content_type, request_id), result.body or b"")
                if result.spans is not None:
                    result.spans.first_write()
                return
            await self._send_stream(exchange, result, request_id, record)
        finally:
            if trace is not None:
                trace.finish(record.status or CLIENT_CLOSED)  # no outcome yet: the task was cancelled

    @staticmethod
    def _send_error(exchange: Exchange, err: ProxyError, request_id: str, record: RequestRecord,
                    close: bool = False) -> None:
        record.finish(err.status)
        logger.info("[%s] %s -> %d: %s", request_id, record.endpoint, err.status, err.logged)
        headers = _headers("application/json", request_id)
        if err.retry_after is not None:
            headers.append((b"retry-after", str(err.retry_after).encode("ascii")))
        exchange.respond(err.status, headers, err.body(), close=close)

    @staticmethod
    async def _send_stream(exchange: Exchange, result: RelayResult, request_id: str, record: RequestRecord) -> None:
        stream = result.stream
        assert stream is not None
        exchange.start_stream(result.status, [
            (b"content-type", result.content_type.encode("latin-1")),
            (b"cache-control", b"no-cache"),
            (b"x-request-id", request_id.encode("latin-1")),
        ])
        try:
            # events go out as they arrive (see DecodeStream): the client sees the engine's timing
            await stream.pipe(_RecordedSink(exchange, record, result.status, result.spans))
        except asyncio.CancelledError:
            record.client_gone()
            raise
        finally:
            stream.aclose(release=exchange.stalled)  # no-op after a complete stream; aborts the decode leg otherwise


def _headers(content_type: str, request_id: str) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", content_type.encode("latin-1")), (b"x-request-id", request_id.encode("latin-1"))]
