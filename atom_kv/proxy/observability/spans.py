"""Where one relayed request's time to first token went, span by span.

The proxy marks what it sees (request in, each leg sent, each leg's answer
head, the first byte written to the client) and adds what each engine
reports in its ``Server-Timing`` header (:mod:`atom_kv.server_timing`):

================  ==========================================================
span              from .. to
================  ==========================================================
proxy_admission   request in .. prefill leg sent (parse, checks, routing)
prefill_queue     prefill engine: request in .. blocks allocated
prefill_compute   prefill engine: blocks .. first token sampled
prefill_response  the rest of the prefill leg (HTTP both ways, JSON)
proxy_between     prefill answer in .. decode leg sent (sequential legs only)
decode_admission  decode engine: request in .. blocks allocated
kv_wait           decode engine: blocks .. remote KV ready (handshake, reads)
decode_first_step decode engine: KV ready .. its first token
decode_response   the rest of the decode leg up to its answer's head
proxy_write       first bytes in hand .. first byte written to the client
================  ==========================================================

Handshake and KV read times are the decode engine's transfer statistics on
its ``/metrics``. Every span is observed once per request into the
``atom_kv_proxy_span_seconds`` histogram, labelled by span (no sampling).
With ``--otlp-traces-endpoint`` the same spans also go to the request's
OpenTelemetry trace (:mod:`atom_kv.proxy.observability.otel`); without it ``trace`` is None.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from atom_kv.server_timing import parse_server_timing

if TYPE_CHECKING:
    from atom_kv.proxy.observability.metrics import ProxyMetrics
    from atom_kv.proxy.observability.otel import RequestTrace

__all__ = ["RequestSpans", "SPANS"]

SPANS = ("proxy_admission", "prefill_queue", "prefill_compute", "prefill_response", "proxy_between",
         "decode_admission", "kv_wait", "decode_first_step", "decode_response", "proxy_write")

_PREFILL = {"queue": "prefill_queue", "compute": "prefill_compute"}
_DECODE = {"admission": "decode_admission", "kv_wait": "kv_wait", "first_step": "decode_first_step"}


class RequestSpans:
    """Owns one request's marks; observes each span into the proxy's span histogram as soon as
    it is known, and records it in the request's trace when there is one (``trace``)."""

    __slots__ = ("_metrics", "t0", "trace", "_prefill_sent", "_prefill_done", "_decode_sent", "_ready", "_written")

    def __init__(self, metrics: "ProxyMetrics", t0: float | None = None, trace: "RequestTrace | None" = None) -> None:
        self._metrics = metrics
        self.t0 = time.perf_counter() if t0 is None else t0
        self.trace = trace
        self._prefill_sent = self._prefill_done = self._decode_sent = self._ready = 0.0
        self._written = False

    def _observe(self, span: str, seconds: float) -> None:
        m = self._metrics
        m.child(m.spans, span).observe(max(0.0, seconds))

    def prefill_sent(self) -> None:
        self._prefill_sent = time.perf_counter()
        self._observe("proxy_admission", self._prefill_sent - self.t0)
        if self.trace is not None:
            self.trace.span("proxy_admission", self.t0, self._prefill_sent)

    def prefill_answered(self, server_timing: str) -> None:
        now = self._prefill_done = time.perf_counter()
        engine = self._engine(server_timing, _PREFILL)
        self._observe("prefill_response", now - self._prefill_sent - sum(engine.values()))
        if self.trace is not None:
            self.trace.engine_leg("P", self._prefill_sent, now, engine, "prefill_response")

    def decode_sent(self, after_prefill: bool) -> None:
        self._decode_sent = time.perf_counter()
        if after_prefill and self._prefill_done:
            self._observe("proxy_between", self._decode_sent - self._prefill_done)
        if self.trace is not None:
            if after_prefill and self._prefill_done:
                self.trace.span("proxy_between", self._prefill_done, self._decode_sent)
            self.trace.concurrent_dispatch = not after_prefill

    def decode_answered(self, server_timing: str) -> None:
        now = time.perf_counter()
        engine = self._engine(server_timing, _DECODE)
        self._observe("decode_response", now - self._decode_sent - sum(engine.values()))
        if self.trace is not None:
            self.trace.engine_leg("D", self._decode_sent, now, engine, "decode_response")
        if not self._ready:
            self._ready = now

    def ready(self) -> None:
        """The bytes of the client's first token are in hand before the decode leg answered: the
        prefill's token, forwarded (once; later calls are ignored)."""
        if not self._ready:
            self._ready = time.perf_counter()
            if self.trace is not None:
                self.trace.first_token_forwarded = True

    def first_write(self) -> None:
        """The client's first byte went out."""
        if self._written:
            return
        self._written = True
        now = time.perf_counter()
        self._observe("proxy_write", now - (self._ready or now))
        if self.trace is not None:
            self.trace.span("proxy_write", self._ready or now, now)

    def _engine(self, value: str, names: dict[str, str]) -> dict[str, float]:
        spans = {names[k]: v for k, v in parse_server_timing(value).items() if k in names} if value else {}
        for span, seconds in spans.items():
            self._observe(span, seconds)
        return spans
