"""--otlp-traces-endpoint against real processes: a proxy in front of a reference P/D pair exports one
streamed request as one OpenTelemetry trace, over OTLP/HTTP, to a fake collector on 127.0.0.1 (a tiny
HTTP server that keeps the POST bodies); the proxy flushes it when it stops. The bodies are decoded
with opentelemetry-proto and the trace's spans checked: the caller's parent, the root's attributes,
one child per breakdown span, and each leg's spans in order inside it."""

from __future__ import annotations

import http.client
import http.server
import json
import threading

import pytest

pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra is not installed (pip install 'atom-kv[otel]')")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the otel extra is not installed")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

from atom_kv.testing.cluster import Cluster, EngineSpec  # noqa: E402
from tests.e2e.helpers import PROMPTS  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
PREFILL_CHAIN = ("proxy_admission", "prefill_queue", "prefill_compute", "prefill_response")
DECODE_CHAIN = ("proxy_between", "decode_admission", "kv_wait", "decode_first_step", "decode_response")
MAX_BODIES = 64


class _FakeCollector:
    """An OTLP/HTTP receiver that keeps what is POSTed to /v1/traces (at most MAX_BODIES bodies of 4 MiB)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers.get("Content-Length", "0"))
                if not 0 <= length <= 4 << 20:
                    self.send_error(413)
                    return
                body = self.rfile.read(length)
                with collector._lock:
                    if len(collector.bodies) < MAX_BODIES:
                        collector.bodies.append(body)
                        collector.paths.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.timeout = 5.0
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="fake-otlp-collector", daemon=True)
        self._thread.start()

    def spans(self) -> list:
        with self._lock:
            bodies = list(self.bodies)
        out = []
        for body in bodies:
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    out.extend(ss.spans)
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    collector = _FakeCollector()
    cluster = Cluster([EngineSpec("P", num_blocks=64), EngineSpec("D", num_blocks=64)],
                      proxy_args=["--otlp-traces-endpoint", collector.url],
                      log_dir=str(tmp_path_factory.mktemp("otel")))
    try:
        cluster.start()
        yield cluster, collector
    finally:
        cluster.close()
        collector.close()


def _stream(url: str, headers: dict[str, str]) -> str:
    """One streamed completion through the proxy; its text."""
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    try:
        body = {"model": "atom-kv-tiny", "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        text = []
        for line in resp.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.extend(c.get("text", "") for c in json.loads(line[6:])["choices"])
        return "".join(text)
    finally:
        conn.close()


def test_a_streamed_request_is_one_trace_under_the_callers_span(traced):
    cluster, collector = traced
    text = _stream(cluster.proxy_url, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Request-Id": "otel-e2e"})
    assert text
    cluster.proxy.stop()  # SIGTERM: the proxy flushes its spans before it exits
    assert cluster.proxy.proc.returncode == 0, cluster.proxy.tail()
    assert set(collector.paths) == {"/v1/traces"}

    spans = [s for s in collector.spans() if s.trace_id.hex() == TRACE_ID]
    (root,) = [s for s in spans if s.parent_span_id.hex() == PARENT_ID]
    assert root.name == "POST /v1/completions"
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["gen_ai.request.id"].string_value == "otel-e2e"
    assert attrs["http.response.status_code"].int_value == 200
    assert attrs["atom_kv.prefill.url"].string_value == cluster.engine_url(cluster.index_of("P"))
    assert attrs["atom_kv.decode.url"].string_value == cluster.engine_url(cluster.index_of("D"))
    assert attrs["atom_kv.prefill.dp_rank"].int_value == 0 and attrs["atom_kv.decode.dp_rank"].int_value == 0
    assert attrs["atom_kv.concurrent_dispatch"].bool_value is False
    # the reference decode engine continues from the prefill's token: the proxy streams it at once
    assert attrs["atom_kv.first_token_forwarded"].bool_value is True

    children = {s.name: s for s in spans if s is not root}
    assert len(children) == len(spans) - 1  # one span per name
    assert all(s.parent_span_id == root.span_id for s in children.values())
    assert set(children) == {*PREFILL_CHAIN, *DECODE_CHAIN, "proxy_write"}
    for s in children.values():  # inside the root, none backwards
        assert root.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano <= root.end_time_unix_nano
    for chain in (PREFILL_CHAIN, DECODE_CHAIN):  # each leg's spans follow one another
        for a, b in zip(chain, chain[1:]):
            assert children[a].end_time_unix_nano == children[b].start_time_unix_nano, (a, b)
    assert children["proxy_between"].start_time_unix_nano == children["prefill_response"].end_time_unix_nano
    # the first token went out from the prefill's answer, before the decode engine answered
    assert children["proxy_write"].start_time_unix_nano >= children["prefill_response"].end_time_unix_nano
    assert children["prefill_compute"].end_time_unix_nano > children["prefill_compute"].start_time_unix_nano
