"""The proxy's per-request spans exported to OpenTelemetry (``--otlp-traces-endpoint``).

Off by default: without the flag this module is never imported and a request
pays one ``None`` check per mark. With it, each relayed request becomes one
trace, exported over OTLP/HTTP (protobuf) by the SDK's batch span processor on
its own thread (the event loop only appends finished spans to its queue):

- a root span ``POST /v1/completions`` (kind SERVER) from the request's arrival
  to its last byte, with the request id, the path, the status, the prefill and
  decode instances with their DP ranks, and whether the first token came from
  the prefill and whether the legs went out together;
- one child per breakdown span of :mod:`atom_kv.proxy.observability.spans`
  (``proxy_admission``, ``prefill_queue``, ``prefill_compute``, ...), with
  real start and end times: the proxy's ``perf_counter`` marks turned into
  epoch nanoseconds with one offset per request. An engine reports durations
  only (``Server-Timing``), so its spans are laid out in order from the moment
  its leg was sent, and the leg's ``*_response`` span holds the rest of the
  leg (both HTTP trips and the JSON).

An incoming W3C ``traceparent`` (and ``tracestate``) makes the root its
child; both legs carry the root's ``traceparent`` to the engines, so an
engine that traces (vLLM with its own ``--otlp-traces-endpoint``) hangs its
spans under the proxy's. Sampling follows the SDK (``OTEL_TRACES_SAMPLER``,
parent-based by default); the exporter's standard ``OTEL_EXPORTER_OTLP_*``
variables (headers, certificates, compression) apply, but, as with vLLM, only
the flag turns tracing on and names the endpoint.

Export never raises into a request: failures and dropped spans are logged
through :class:`~atom_kv._ratelimit.RateLimitedLog` (the first at once, then a
summary per ``log_summary_interval_s``). :meth:`ProxyTracer.aclose` flushes and
stops the export thread within a bound.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from typing import TYPE_CHECKING, Sequence, cast

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from atom_kv._ratelimit import RateLimitedLog

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import Span as SdkSpan

__all__ = ["INSTALL", "ProxyTracer", "RequestTrace"]

logger = logging.getLogger(__name__)

INSTALL = "pip install 'atom-kv[otel]'"
SERVICE_NAME = "atom-kv-proxy"
# the SDK's loggers whose warnings (failed exports, retries, a full queue) go through our rate limit
_SDK_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.exporter.otlp.common.http",
                "opentelemetry.sdk._shared_internal", "opentelemetry.sdk.trace.export")


class _RateLimitedRecords(logging.Filter):
    """Diverts the SDK's export warnings into one :class:`RateLimitedLog` (the record itself is dropped)."""

    def __init__(self, limited: RateLimitedLog) -> None:
        super().__init__()
        self._limited = limited

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: say so rather than lose it
            message = str(record.msg)
        self._limited.event("sdk", message)
        return False


class _GuardedExporter(SpanExporter):
    """Wraps the OTLP exporter: a failed or raising export is counted and logged (rate-limited), never raised."""

    def __init__(self, inner: SpanExporter, endpoint: str, limited: RateLimitedLog) -> None:
        self.inner = inner
        self._endpoint = endpoint
        self._limited = limited
        self.failures = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        reason = ""
        try:
            result = self.inner.export(spans)
        except Exception as exc:
            result = SpanExportResult.FAILURE
            reason = f": {type(exc).__name__}: {exc}"
        if result is not SpanExportResult.SUCCESS:
            self.failures += 1
            self._limited.event("export", f"OTLP export of {len(spans)} span(s) to {self._endpoint} failed{reason}")
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class ProxyTracer:
    """Owns the proxy's tracer provider: the batch span processor (its export thread) and the
    exporter, and the diversion of the SDK's export warnings into one rate-limited log.
    :meth:`begin` opens one request's :class:`RequestTrace`; :meth:`aclose` flushes and stops."""

    def __init__(self, endpoint: str, *, timeout_s: float = 10.0, log_interval_s: float = 10.0,
                 exporter: SpanExporter | None = None) -> None:
        self.endpoint = endpoint
        self._limited = RateLimitedLog(logger, "OpenTelemetry export problems", interval_s=log_interval_s)
        self._filter = _RateLimitedRecords(self._limited)
        for name in _SDK_LOGGERS:
            logging.getLogger(name).addFilter(self._filter)
        if exporter is None:
            exporter = OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s)
        self.exporter = _GuardedExporter(exporter, endpoint, self._limited)
        service = os.environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME
        self._provider = TracerProvider(resource=Resource.create({"service.name": service}), shutdown_on_exit=False)
        self._processor = BatchSpanProcessor(self.exporter)
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer("atom_kv.proxy")
        self._propagator = TraceContextTextMapPropagator()
        self._closed = False
        logger.info("OpenTelemetry: one trace per request, exported to %s (OTLP/HTTP)", endpoint)

    def begin(self, path: str, request_id: str, received: float, traceparent: str | None = None,
              tracestate: str | None = None) -> "RequestTrace":
        """Open the trace of a request that arrived at ``received`` (``time.perf_counter()``), a child of
        the caller's ``traceparent`` when it sent a valid one."""
        offset_ns = time.time_ns() - time.perf_counter_ns()
        parent = None
        if traceparent:
            carrier = {"traceparent": traceparent}
            if tracestate:
                carrier["tracestate"] = tracestate
            parent = self._propagator.extract(carrier)
        # the SDK's tracer (our provider's) starts the SDK's spans, which carry their scope and resource
        root = cast("SdkSpan", self._tracer.start_span(
            f"POST {path}", context=parent, kind=SpanKind.SERVER, start_time=int(received * 1e9) + offset_ns,
            attributes={"http.request.method": "POST", "url.path": path, "gen_ai.request.id": request_id}))
        return RequestTrace(self._processor, root, offset_ns)

    def flush(self) -> bool:
        """Export every finished span now (blocks: for tests and :meth:`close`)."""
        return self._provider.force_flush()

    def close(self) -> None:
        """Flush, stop the export thread and stop diverting the SDK's warnings (blocks; see :meth:`aclose`)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._provider.shutdown()
        finally:
            for name in _SDK_LOGGERS:
                logging.getLogger(name).removeFilter(self._filter)
            self._limited.flush()

    async def aclose(self, timeout_s: float) -> None:
        """:meth:`close` on a thread of its own, awaited at most ``timeout_s`` (an unreachable collector
        cannot hold the proxy's shutdown; the export thread is a daemon and dies with the process)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if not done.done():
                done.set_result(error)

        def run() -> None:
            error: BaseException | None = None
            try:
                self.close()
            except BaseException as exc:  # reported on the loop, never lost
                error = exc
            try:
                loop.call_soon_threadsafe(settle, error)
            except RuntimeError:  # the loop closed first: nobody is waiting
                pass

        threading.Thread(target=run, name="atom-kv-otel-close", daemon=True).start()
        try:
            error = await asyncio.wait_for(asyncio.shield(done), timeout_s)
        except asyncio.TimeoutError:
            logger.warning("OpenTelemetry: the last spans were not exported to %s within %.1fs; dropped",
                           self.endpoint, timeout_s)
            return
        if error is not None:
            logger.warning("OpenTelemetry: closing the exporter failed: %s: %s", type(error).__name__, error)


# an engine's spans (Server-Timing) in the order they happen within its leg
_PREFILL_ORDER = ("prefill_queue", "prefill_compute")
_DECODE_ORDER = ("decode_admission", "kv_wait", "decode_first_step")


def _span_id() -> int:
    """A random non-zero span id (the SDK's own generator draws them the same way)."""
    while True:
        span_id = random.getrandbits(64)
        if span_id:
            return span_id


class RequestTrace:
    """One request's trace while it runs: the root span (open from the request's arrival), the
    ``traceparent`` header its legs carry, the pair that served it, and the breakdown spans so far
    (``perf_counter`` pairs, turned into child spans by :meth:`finish`)."""

    __slots__ = ("_processor", "root", "_offset_ns", "_spans", "leg_header", "prefill", "decode",
                 "first_token_forwarded", "concurrent_dispatch", "_finished")

    def __init__(self, processor: BatchSpanProcessor, root: "SdkSpan", offset_ns: int) -> None:
        self._processor = processor
        self.root = root
        self._offset_ns = offset_ns
        self._spans: list[tuple[str, float, float]] = []
        ctx = root.get_span_context()
        header = b"traceparent: 00-%032x-%016x-%02x\r\n" % (ctx.trace_id, ctx.span_id, ctx.trace_flags)
        state = ctx.trace_state.to_header() if ctx.trace_state else ""
        if state:  # the propagator validated it: list members of safe characters only
            header += b"tracestate: " + state.encode("ascii") + b"\r\n"
        self.leg_header = header
        self.prefill: tuple[str, int] | None = None
        self.decode: tuple[str, int] | None = None
        self.first_token_forwarded = False
        self.concurrent_dispatch = False
        self._finished = False

    # ------------------------------------------------------------------ recording (the event loop)
    def leg(self, role: str, url: str, rank: int) -> bytes:
        """A leg goes to ``url``, DP rank ``rank`` (``role`` "P" or "D"; a retry overwrites): the
        header lines that carry this trace to the engine."""
        if role == "P":
            self.prefill = (url, rank)
        else:
            self.decode = (url, rank)
        return self.leg_header

    def span(self, name: str, start: float, end: float) -> None:
        """A proxy span from ``start`` to ``end`` (``perf_counter`` seconds)."""
        self._spans.append((name, start, end))

    def engine_leg(self, role: str, sent: float, answered: float, engine: dict[str, float], rest: str) -> None:
        """A leg sent at ``sent`` and answered at ``answered``: the engine's spans (seconds, by span name)
        in their order from ``sent``, then ``rest`` up to ``answered``."""
        cursor = sent
        for name in (_PREFILL_ORDER if role == "P" else _DECODE_ORDER):
            seconds = engine.get(name)
            if seconds is None:
                continue
            end = min(cursor + seconds, answered)
            self._spans.append((name, cursor, end))
            cursor = end
        self._spans.append((rest, cursor, answered))

    # ------------------------------------------------------------------ the end
    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    def finish(self, status: int) -> None:
        """The request is over with ``status`` (499: the client left): end the root and hand every
        span to the export thread's queue. Once; later calls do nothing."""
        if self._finished:
            return
        self._finished = True
        root = self.root
        if root.is_recording():
            attrs: dict[str, str | int | bool] = {
                "http.response.status_code": status,
                "atom_kv.first_token_forwarded": self.first_token_forwarded,
                "atom_kv.concurrent_dispatch": self.concurrent_dispatch,
            }
            for role, target in (("prefill", self.prefill), ("decode", self.decode)):
                if target is not None:
                    attrs[f"atom_kv.{role}.url"], attrs[f"atom_kv.{role}.dp_rank"] = target
            root.set_attributes(attrs)
            if status >= 500:
                root.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
            # The children are finished already (their times are known), so they go straight to the export
            # queue as ReadableSpans, sampled once with the root they share: a tracer's start_span/end per
            # child (sampling, attribute checks, locks) made tracing cost 2.5x more of the loop's time.
            parent = root.get_span_context()
            scope, resource, on_end = root.instrumentation_scope, root.resource, self._processor.on_end
            for name, start, end in sorted(self._spans, key=lambda s: s[1]):
                context = SpanContext(parent.trace_id, _span_id(), False, parent.trace_flags, parent.trace_state)
                on_end(ReadableSpan(name, context, parent, resource, start_time=self._ns(start),
                                    end_time=self._ns(max(start, end)), instrumentation_scope=scope))
        root.end(end_time=self._ns(time.perf_counter()))
