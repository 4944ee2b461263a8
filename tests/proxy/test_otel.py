"""The proxy's spans exported to OpenTelemetry (--otlp-traces-endpoint): the span layout, the traceparent
on both legs, failures that stay out of requests, and the one-line error without the packages."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from dataclasses import replace

import pytest

pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra is not installed (pip install 'atom-kv[otel]')")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the otel extra is not installed")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from atom_kv.proxy import __main__ as cli  # noqa: E402
from atom_kv.proxy.observability.metrics import ProxyMetrics  # noqa: E402
from atom_kv.proxy.observability.otel import ProxyTracer  # noqa: E402
from atom_kv.proxy.observability.spans import RequestSpans  # noqa: E402
from atom_kv.testing.ports import free_port  # noqa: E402
from tests.proxy.conftest import FAST, RunningProxy  # noqa: E402
from tests.proxy.fake_engine import post, register  # noqa: E402

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"


class _Clock:
    """A perf_counter the test moves by hand (seconds)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def at(self, ms: float) -> None:
        self.t = 1000.0 + ms / 1e3


@pytest.fixture
def clock(monkeypatch):
    c = _Clock(1000.0)
    monkeypatch.setattr("atom_kv.proxy.observability.spans.time.perf_counter", c)
    return c


@pytest.fixture
def tracer():
    t = ProxyTracer("http://127.0.0.1:9/v1/traces", exporter=InMemorySpanExporter())
    yield t
    t.close()


def _exported(tracer: ProxyTracer):
    tracer.flush()
    spans = list(tracer.exporter.inner.get_finished_spans())
    roots = [s for s in spans if s.kind.name == "SERVER"]
    assert len(roots) == 1, [s.name for s in spans]
    children = sorted((s for s in spans if s is not roots[0]), key=lambda s: (s.start_time, s.end_time))
    return roots[0], children


def _layout(root, children) -> list[tuple[str, float, float]]:
    """(name, start ms, end ms) of each child, relative to the root's start."""
    return [(c.name, round((c.start_time - root.start_time) / 1e6, 3), round((c.end_time - root.start_time) / 1e6, 3))
            for c in children]


def test_sequential_legs_become_children_of_the_callers_trace_in_order(clock, tracer):
    trace = tracer.begin("/v1/completions", "req-1", clock.t, TRACEPARENT, "vendor=abc")
    spans = RequestSpans(ProxyMetrics(), clock.t, trace)
    assert trace.leg("P", "http://p:1", 0).startswith(b"traceparent: 00-%032x-" % TRACE_ID)
    clock.at(1)
    spans.prefill_sent()
    clock.at(50)
    spans.prefill_answered("queue;dur=2, compute;dur=30")
    trace.leg("D", "http://d:2", 3)
    clock.at(51)
    spans.decode_sent(after_prefill=True)
    clock.at(80)
    spans.decode_answered("admission;dur=1, kv_wait;dur=4, first_step;dur=3")
    clock.at(81)
    spans.first_write()
    clock.at(200)
    trace.finish(200)
    trace.finish(500)  # once

    root, children = _exported(tracer)
    assert root.name == "POST /v1/completions"
    assert root.context.trace_id == TRACE_ID and root.parent.span_id == PARENT_ID
    assert trace.leg_header == (b"traceparent: 00-%032x-%016x-01\r\ntracestate: vendor=abc\r\n"
                                % (TRACE_ID, root.context.span_id))
    assert (root.end_time - root.start_time) / 1e6 == pytest.approx(200, abs=1e-3)
    assert dict(root.attributes) == {
        "http.request.method": "POST", "url.path": "/v1/completions", "gen_ai.request.id": "req-1",
        "http.response.status_code": 200, "atom_kv.first_token_forwarded": False,
        "atom_kv.concurrent_dispatch": False, "atom_kv.prefill.url": "http://p:1", "atom_kv.prefill.dp_rank": 0,
        "atom_kv.decode.url": "http://d:2", "atom_kv.decode.dp_rank": 3}
    assert all(c.parent.span_id == root.context.span_id and c.context.trace_id == TRACE_ID for c in children)
    assert _layout(root, children) == [
        ("proxy_admission", 0, 1), ("prefill_queue", 1, 3), ("prefill_compute", 3, 33),
        ("prefill_response", 33, 50), ("proxy_between", 50, 51), ("decode_admission", 51, 52),
        ("kv_wait", 52, 56), ("decode_first_step", 56, 59), ("decode_response", 59, 80), ("proxy_write", 80, 81)]


def test_a_forwarded_first_token_and_concurrent_legs_are_marked_and_laid_out(clock, tracer):
    trace = tracer.begin("/v1/chat/completions", "req-2", clock.t)
    spans = RequestSpans(ProxyMetrics(), clock.t, trace)
    clock.at(2)
    spans.prefill_sent()
    spans.ready()  # not yet: the prefill has not answered, but ready() is what the relay calls when forwarding
    clock.at(40)
    spans.prefill_answered("queue;dur=1, compute;dur=50")  # longer than the leg: clamped to it
    clock.at(41)
    spans.first_write()
    clock.at(42)
    spans.decode_sent(after_prefill=False)
    clock.at(60)
    spans.decode_answered("")  # an engine without Server-Timing: the whole leg is its response
    clock.at(70)
    trace.finish(200)

    root, children = _exported(tracer)
    assert root.parent is None
    assert root.attributes["atom_kv.first_token_forwarded"] is True
    assert root.attributes["atom_kv.concurrent_dispatch"] is True
    assert "atom_kv.prefill.url" not in root.attributes  # no leg went through the relay's head builder
    # no proxy_between for legs sent together; the engine's spans never run past their leg
    assert _layout(root, children) == [
        ("proxy_admission", 0, 2), ("prefill_queue", 2, 3), ("proxy_write", 2, 41), ("prefill_compute", 3, 40),
        ("prefill_response", 40, 40), ("decode_response", 42, 60)]


def test_an_unsampled_caller_gets_no_spans_but_its_flags_travel_on(clock, tracer):
    trace = tracer.begin("/v1/completions", "req-3", clock.t, f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-00")
    spans = RequestSpans(ProxyMetrics(), clock.t, trace)
    spans.prefill_sent()
    spans.first_write()
    trace.finish(200)
    tracer.flush()
    assert tracer.exporter.inner.get_finished_spans() == ()
    header = trace.leg("P", "http://p:1", 0)
    assert header.startswith(b"traceparent: 00-%032x-" % TRACE_ID) and header.endswith(b"-00\r\n")
    assert b"%016x" % PARENT_ID not in header  # the proxy's own span id, not the caller's


def test_a_malformed_traceparent_starts_a_new_trace(clock, tracer):
    trace = tracer.begin("/v1/completions", "req-4", clock.t, "00-zz-\r\nx: y-01")
    trace.finish(400)
    root, children = _exported(tracer)
    assert root.parent is None and root.context.trace_id != 0 and children == []
    assert root.attributes["http.response.status_code"] == 400
    assert b"\r\nx" not in trace.leg_header


def test_export_failures_are_logged_rate_limited_and_never_raised(clock, caplog):
    tracer = ProxyTracer(f"http://127.0.0.1:{free_port()}/v1/traces", timeout_s=0.5, log_interval_s=60)
    try:
        with caplog.at_level(logging.WARNING):
            for i in range(3):
                trace = tracer.begin("/v1/completions", f"r{i}", clock.t)
                trace.finish(200)
                tracer.flush()  # three batches, three failures: nobody connects
    finally:
        tracer.close()
    assert tracer.exporter.failures == 3
    failed = [r for r in caplog.records if "failed" in r.getMessage() and r.name == "atom_kv.proxy.observability.otel"]
    assert 1 <= len(failed) <= 3, [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry") and r.levelno >= logging.WARNING]


async def test_both_legs_carry_the_proxys_traceparent_and_the_trace_is_exported(make_engine):
    proxy = RunningProxy(replace(FAST, otlp_traces_endpoint="http://127.0.0.1:9/v1/traces"))
    proxy.state.tracer = tracer = ProxyTracer("http://127.0.0.1:9/v1/traces", exporter=InMemorySpanExporter())
    await proxy.start()
    try:
        prefill, decode = await make_engine("P"), await make_engine("D")
        await register(proxy, prefill, decode)
        status, _, _ = await post(proxy.url, {"model": "m", "prompt": "hello", "max_tokens": 3},
                                  headers={"traceparent": TRACEPARENT, "x-request-id": "otel-1"})
        assert status == 200
    finally:
        await proxy.stop()  # flushes and closes the tracer
    spans = tracer.exporter.inner.get_finished_spans()
    (root,) = [s for s in spans if s.kind.name == "SERVER"]
    assert root.parent.span_id == PARENT_ID and root.attributes["gen_ai.request.id"] == "otel-1"
    assert root.attributes["atom_kv.prefill.url"] == prefill.base_url
    assert root.attributes["atom_kv.decode.url"] == decode.base_url
    sent = f"00-{TRACE_ID:032x}-{root.context.span_id:016x}-01"
    legs = [r for e in (prefill, decode) for r in e.received if r.path == "/v1/completions"]
    assert [r.headers.get("traceparent") for r in legs] == [sent, sent]
    names = [s.name for s in sorted(spans, key=lambda s: s.start_time) if s is not root]
    assert names[0] == "proxy_admission" and names[-1] == "proxy_write" and "decode_response" in names
    assert proxy.state.tracer is None


async def test_without_the_flag_no_tracer_and_no_traceparent(pd_pair):
    proxy, prefill, decode = await pd_pair()
    assert proxy.state.tracer is None and proxy.state.completions.tracer is None
    status, _, _ = await post(proxy.url, {"model": "m", "prompt": "hello", "max_tokens": 3},
                              headers={"traceparent": TRACEPARENT})
    assert status == 200
    legs = [r for e in (prefill, decode) for r in e.received if r.path == "/v1/completions"]
    assert len(legs) == 2 and all("traceparent" not in r.headers for r in legs)


def test_without_the_flag_the_proxy_imports_no_opentelemetry():
    probe = ("import sys; from atom_kv.proxy.__main__ import build_parser, settings_from_args; "
             "from atom_kv.proxy.app import create_app; "
             "create_app(settings_from_args(build_parser().parse_args(['--port', '0']))); "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'opentelemetry', 'google'}))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_without_the_packages_one_line_and_exit_2(monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "opentelemetry" or m.startswith(("opentelemetry.",
                                                                                  "atom_kv.proxy.observability.otel"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # what an environment without the extra gives
    rc = cli.main(["--port", "0", "--no-discovery", "--prefill", "http://127.0.0.1:1", "--decode",
                   "http://127.0.0.1:2", "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "pip install 'atom-kv[otel]'" in err and "Traceback" not in err


def test_only_http_protobuf_is_spoken(monkeypatch):
    settings = replace(FAST, otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")  # vLLM's default protocol
    assert "OTLP over HTTP only" in cli.tracing_problem(settings)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert cli.tracing_problem(settings) is None
    assert cli.tracing_problem(FAST) is None


async def test_closing_waits_for_a_silent_collector_no_longer_than_its_bound(caplog):
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        tracer = ProxyTracer(f"http://127.0.0.1:{silent.getsockname()[1]}/v1/traces", timeout_s=30)
        trace = tracer.begin("/v1/completions", "r", time.perf_counter())
        trace.finish(200)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING):
            await tracer.aclose(0.5)
        assert time.monotonic() - t0 < 2.0
    assert any("not exported" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
