"""What a proxy on loopback tells clients and whom it answers (issue 38, F9), with real proxy processes:

* an engine's failure reaches the client in the proxy's words (which engine, how, the request id), never
  the engine's address or its error text; those are in the log and ``/instances``, and back in the
  client's error only with ``--expose-upstream-errors``;
* a completion body must be declared ``application/json``: a cross-site ``text/plain`` POST gets 415;
* on loopback every route answers only the ``Host`` names of ``--allowed-hosts`` (by default the
  loopback names and the bound address): a DNS-rebinding page's ``Host: evil.example`` gets 421.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest

from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json as http
from atom_kv.testing.web import scrape_metrics
from tests.proxy.procs import FakeEngines, ProxyProcess

_HEALTH = b'{"status":"ok","role":"decode","engine_id":"raw-decode","tp_size":1}'
_MODELS = b'{"object":"list","data":[{"id":"fake-model","max_model_len":32768}]}'
_RID = "exposure-request-1"


class DroppingDecodeEngine:
    """A raw-socket decode engine (its own event loop on a named thread): answers its health probes,
    and drops every completion: a plain one before any answer, a streamed one after its first event."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-dropping-decode-engine",
                                        daemon=True)
        self._server: asyncio.AbstractServer | None = None

    def start(self) -> "DroppingDecodeEngine":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result(10)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                body = await asyncio.wait_for(reader.readexactly(length), 30)
                if head.startswith(b"POST"):
                    if json.loads(body).get("stream"):
                        event = b'data: {"choices":[{"index":0,"text":" t0","finish_reason":null}]}\n\n'
                        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                     b"transfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n" % (len(event), event))
                        await writer.drain()
                    return  # the engine dies here
                answer = _HEALTH if head.startswith(b"GET /health") else _MODELS
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                             % (len(answer), answer))
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@pytest.fixture(scope="module")
def engines():
    healthy = FakeEngines()
    failing = FakeEngines("--fail-status", "500", "--decodes", "0")  # a broken prefill engine
    dropping = DroppingDecodeEngine().start()
    try:
        yield healthy, failing, dropping
    finally:
        healthy.stop()
        failing.stop()
        dropping.close()


def _proxy(prefill: str, decode: str, *flags: str, host: str = "127.0.0.1") -> ProxyProcess:
    proxy = ProxyProcess("--no-discovery", "--prefill", prefill, "--decode", decode, "--max-retries", "0",
                         "--probe-interval", "0.2", *flags, host=host)
    try:
        # no Host header: answered whatever --allowed-hosts says
        wait_until(lambda: _get(proxy.port, "/health", None)[0] == 200, 10, interval=0.05,
                   what="the static engines to be probed up")
    except BaseException:
        proxy.kill()
        raise
    return proxy


def _complete(proxy: ProxyProcess, stream: bool = False) -> tuple[int, str]:
    """One completion; its status and its error message (from the body, or a stream's error event)."""
    status, answer = http("POST", proxy.url + "/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": stream},
                          headers={"X-Request-Id": _RID})
    if stream:
        assert status == 200 and isinstance(answer, str), answer
        events = [e[len("data: "):] for e in answer.split("\n\n") if e.startswith("data: {")]
        errors = [json.loads(e)["error"] for e in events if '"error"' in e]
        assert len(errors) == 1, answer
        return status, errors[0]["message"]
    return status, answer["error"]["message"]


def _last_error(proxy: ProxyProcess, role: str) -> str:
    status, listing = http("GET", proxy.url + "/instances")
    assert status == 200
    entry = next(i for i in listing if i["role"] == role)
    assert entry["last_error"] is not None, entry
    return entry["last_error"]["message"]


# ------------------------------------------------------------------------------------------ error bodies
def test_an_engine_500_reaches_the_client_without_its_address_or_text(engines):
    healthy, failing, _ = engines
    prefill = failing.prefill[0]
    proxy = _proxy(prefill, healthy.decode[0])
    try:
        status, message = _complete(proxy)
        assert status == 502
        assert message == (f"the prefill engine answered 500 (request {_RID}; details in the proxy's log)")
        assert "127.0.0.1" not in message and "fake engine failure" not in message
        # the operator has both: /instances and the log
        assert prefill in _last_error(proxy, "P") and "fake engine failure 500" in _last_error(proxy, "P")
        # the log is read from the proxy's stderr by a thread: the line may be a moment behind the answer
        wait_until(lambda: any(_RID in line and prefill in line and "fake engine failure 500" in line
                               for line in proxy.lines), 10, interval=0.05, what="the failure's log line")
    finally:
        proxy.kill()


def test_an_unreachable_decode_engine_and_a_dropped_stream_are_named_without_the_address(engines):
    healthy, _, dropping = engines
    proxy = _proxy(healthy.prefill[0], dropping.url)
    try:
        status, message = _complete(proxy)
        assert (status, message) == (502, f"the decode engine could not be reached (request {_RID}; details in "
                                          "the proxy's log)")
        assert dropping.url in _last_error(proxy, "D")
        wait_until(lambda: http("GET", proxy.url + "/health")[0] == 200, 10, interval=0.05,
                   what="the decode engine to be probed up again")
        status, message = _complete(proxy, stream=True)
        assert message == (f"decode stream interrupted: the decode engine dropped the connection (request {_RID}; "
                           "details in the proxy's log)")
        assert dropping.url in _last_error(proxy, "D")
    finally:
        proxy.kill()


def test_expose_upstream_errors_gives_the_client_the_engines_address_and_text(engines):
    healthy, failing, dropping = engines
    proxy = _proxy(failing.prefill[0], healthy.decode[0], "--expose-upstream-errors")
    try:
        status, message = _complete(proxy)
        assert status == 502 and failing.prefill[0] in message and "fake engine failure 500" in message
    finally:
        proxy.kill()
    proxy = _proxy(healthy.prefill[0], dropping.url, "--expose-upstream-errors")
    try:
        status, message = _complete(proxy)
        assert status == 502 and dropping.url in message and "unreachable" in message
    finally:
        proxy.kill()


# ------------------------------------------------------------------------------------------ Content-Type
def _post_raw(url: str, path: str, content_type: str | None) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    headers = {} if content_type is None else {"Content-Type": content_type}
    req = urllib.request.Request(url + path, data=b'{"prompt": "hi", "max_tokens": 2}', method="POST",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_completion_body_not_declared_json_is_415_and_reaches_no_engine(engines):
    healthy, _, _ = engines
    proxy = _proxy(healthy.prefill[0], healthy.decode[0])
    try:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for content_type in ("text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
                                 "multipart/form-data; boundary=x", "application/jsonp", None):
                status, raw = _post_raw(proxy.url, path, content_type)
                assert status == 415, (path, content_type, raw)
                assert raw.count("\n") == 0  # one line
                message = json.loads(raw)["error"]["message"]
                assert "Content-Type" in message and "application/json" in message, message
        metrics = scrape_metrics(proxy.url + "/metrics")
        assert metrics['atom_kv_proxy_refused_requests_total{reason="content_type"}'] == 12
        assert metrics.get("atom_kv_proxy_dp_rank_requests_total", 0) == 0  # no leg went to any engine
        for content_type in ("application/json", "Application/JSON; charset=UTF-8", " application/json ;x=y"):
            assert _post_raw(proxy.url, "/v1/completions", content_type)[0] == 200, content_type
    finally:
        proxy.kill()


# ------------------------------------------------------------------------------------------ Host
def _get(port: int, path: str, host: str | None, method: str = "GET", body: bytes = b"") -> tuple[int, bytes]:
    """One request over a raw socket with exactly this ``Host`` (None: none), its status and body."""
    head = f"{method} {path} HTTP/1.1\r\n" + (f"Host: {host}\r\n" if host is not None else "")
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


_COMPLETION = b'{"prompt": "hi", "max_tokens": 2}'


def test_a_rebinding_host_is_refused_on_loopback_and_the_loopback_names_are_answered(engines):
    healthy, _, _ = engines
    proxy = _proxy(healthy.prefill[0], healthy.decode[0])
    port = proxy.port
    try:
        for host in ("evil.example", f"evil.example:{port}", "localhost.evil.example", "127.0.0.1.nip.io"):
            for method, path, body in (("GET", "/health", b""), ("GET", "/v1/models", b""), ("GET", "/instances", b""),
                                       ("GET", "/metrics", b""), ("POST", "/v1/completions", _COMPLETION),
                                       ("POST", "/v1/chat/completions", b'{"messages": []}')):
                status, raw = _get(port, path, host, method, body)
                assert status == 421, (host, path, raw)
                message = json.loads(raw)["error"]["message"]
                assert "Host" in message and "--allowed-hosts" in message and b"\n" not in raw
        metrics = scrape_metrics(proxy.url + "/metrics")
        assert metrics['atom_kv_proxy_refused_requests_total{reason="host"}'] == 24
        assert metrics.get("atom_kv_proxy_dp_rank_requests_total", 0) == 0  # no completion went to an engine
        for host in (f"localhost:{port}", "localhost", f"127.0.0.1:{port}", f"[::1]:{port}", "LocalHost", None):
            assert _get(port, "/health", host)[0] == 200, host
        assert _get(port, "/v1/completions", f"localhost:{port}", "POST", _COMPLETION)[0] == 200
        assert _get(port, "/health", "x", "GET")[0] == 421
        assert _get(port, "/health", "a, b", "GET")[0] == 421
    finally:
        proxy.kill()


def test_allowed_hosts_replaces_the_default_and_applies_beyond_loopback(engines):
    healthy, _, _ = engines
    proxy = _proxy(healthy.prefill[0], healthy.decode[0], "--allowed-hosts", "proxy.example,10.0.0.5:10001")
    try:
        assert _get(proxy.port, "/health", "proxy.example:8080")[0] == 200  # a name alone: any port
        assert _get(proxy.port, "/health", "10.0.0.5:10001")[0] == 200
        assert _get(proxy.port, "/health", "10.0.0.5:10002")[0] == 421  # a name with a port: that port
        assert _get(proxy.port, "/health", f"localhost:{proxy.port}")[0] == 421  # the default is replaced
    finally:
        proxy.kill()
    # beyond loopback the operator names the hosts, or there is no check
    proxy = _proxy(healthy.prefill[0], healthy.decode[0], host="0.0.0.0")
    try:
        assert _get(proxy.port, "/health", "evil.example")[0] == 200
    finally:
        proxy.kill()
    proxy = _proxy(healthy.prefill[0], healthy.decode[0], "--allowed-hosts", "proxy.example", host="0.0.0.0")
    try:
        assert _get(proxy.port, "/health", "evil.example")[0] == 421
        assert _get(proxy.port, "/health", "proxy.example")[0] == 200
    finally:
        proxy.kill()


def test_a_bad_allowed_hosts_entry_is_one_line():
    import subprocess
    import sys

    from tests.proxy.procs import ENV, ROOT

    res = subprocess.run([sys.executable, "-m", "atom_kv.proxy", "--allowed-hosts", "localhost,http://x/"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=20)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--allowed-hosts: 'http://x/' is not a host name" in res.stderr.strip().splitlines()[-1]
