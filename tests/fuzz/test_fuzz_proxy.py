"""Fuzzing the proxy as a real process: its HTTP server and its discovery port.

Random bytes, and well-formed requests and pings carrying random field values
(hypothesis), against ``python -m atom_kv.proxy`` with a registration token and
two fake engines behind it. Asserted throughout: the process stays up and
keeps serving, its memory stays bounded, no answer is a 500 (a proxy bug) and
nothing it logs is a traceback. And for the HTTP server's own rules: requests
pipelined before random bytes are answered first and in order, a chunked
body's trailers never become headers (their request id never comes back), and
a management route answers only its raw path, never another spelling of it.
Bounded in time: a few hundred examples each."""

from __future__ import annotations

import json
import socket
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom_kv.auth import PURPOSE_REGISTER, sign_fields
from atom_kv.testing.procfs import rss_bytes
from atom_kv.testing.web import http_json as http
from tests.proxy.procs import FakeEngines, ProxyProcess

TOKEN = "fuzz-token-5f0c2a9d7b1e4c38"
ADMIN = "fuzz-admin-0d1e"
FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class _Target:
    def __init__(self) -> None:
        self.engines = FakeEngines("--tokens", "3")
        self.proxy = ProxyProcess("--registration-token", TOKEN, "--admin-token", ADMIN, "--no-release",
                                  "--prefill", self.engines.prefill[0], "--decode", self.engines.decode[0],
                                  "--probe-interval", "0.2", "--header-timeout", "2", "--body-timeout", "2",
                                  "--max-request-bytes", str(1 << 20))
        deadline = time.monotonic() + 10
        while http("GET", self.proxy.url + "/health")[0] != 200:
            assert time.monotonic() < deadline, "the static engines were not probed up"
            time.sleep(0.05)
        self.rss_start = rss_bytes(self.proxy.proc.pid)
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(self.proxy.discovery)

    def alive(self) -> None:
        assert self.proxy.proc.poll() is None, "the proxy exited"
        assert http("GET", self.proxy.url + "/health")[0] == 200

    def close(self) -> str:
        self.dealer.close(0)
        self.ctx.term()
        self.proxy.terminate()
        self.engines.stop()
        return self.proxy.stderr_rest()


@pytest.fixture(scope="module")
def target():
    t = _Target()
    try:
        yield t
    finally:
        t.proxy.kill()
        t.engines.kill()


def _send_and_close(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(2)
            while s.recv(65536):
                pass
        except (ConnectionError, TimeoutError, OSError):
            pass


def _status_of(port: int, data: bytes) -> int | None:
    """Send a complete request; the status line of the answer (None: closed without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            head = b""
            while b"\r\n" not in head:
                chunk = s.recv(4096)
                if not chunk:
                    return None
                head += chunk
        except ConnectionResetError:
            return None
    return int(head.split(b" ", 2)[1])


_token_chars = st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=":")
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
_completion = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.text(max_size=60) | st.lists(st.integers(-5, 2**40), max_size=6) | _json,
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                                     "content": st.text(max_size=30) | _json}), max_size=3) | _json,
        "max_tokens": st.integers(-3, 4) | st.sampled_from([0, 2**64, 40_000]) | st.text(max_size=3) | st.none(),
        "stream": st.booleans() | _json,
        "stream_options": _json,
        "model": st.text(max_size=20) | _json,
        "kv_transfer_params": _json,
        "min_tokens": st.integers(-2, 3) | _json,
        "max_completion_tokens": st.integers(-2, 3),
        "n": st.integers(-1, 2),
    },
)


@FUZZ
@given(data=st.binary(max_size=2048))
def test_random_bytes_on_the_http_port(target, data):
    _send_and_close(target.proxy.port, data)


@FUZZ
@given(method=st.sampled_from(["GET", "POST", "PUT", "HEAD", "OPTIONS", "DELETE", "PATCH"]),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/instances",
                             "/metrics", "/v1%2Fcompletions", "/v1/%63ompletions", "/", "//", "/x?y=%zz"])
       | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30).map(lambda t: "/" + t),
       headers=st.lists(st.tuples(st.text(_token_chars, min_size=1, max_size=12),
                                  st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=40)),
                        max_size=6),
       body=st.one_of(_completion.map(lambda d: json.dumps(d).encode()), st.binary(max_size=300)),
       host=st.sampled_from(["localhost", "127.0.0.1", "[::1]:1", "fuzz"]))  # mostly names a loopback proxy answers
def test_well_formed_requests_with_random_fields(target, method, path, headers, body, host):
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}",
            "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in headers
             if k.lower() not in ("content-length", "transfer-encoding", "host", "connection", "expect")]
    data = "\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + body
    status = _status_of(target.proxy.port, data)
    assert status != 500, data[:300]


_ping_keys = ["type", "role", "index", "request_address", "handshake_port", "dp_size", "tp_size",
              "transfer_mode", "v", "engine_id", "model", "ts", "nonce", "mac", "http_address", "zmq_address",
              "kv_events", "kv_events_replay"]


@FUZZ
@given(raw=st.binary(max_size=512) | st.dictionaries(st.sampled_from(_ping_keys) | st.text(max_size=8), _json,
                                                       max_size=12).map(lambda d: msgpack.packb(d)),
       signed=st.dictionaries(st.sampled_from(_ping_keys), _json, max_size=10),
       mac=st.text(max_size=70))
def test_random_and_signed_looking_pings_on_the_discovery_port(target, raw, signed, mac):
    target.dealer.send(raw)
    fields = {"type": "register", "role": "D", "index": "0", "request_address": "http://127.0.0.1:9/v1/completions",
              "handshake_port": 9, "transfer_mode": "read", **signed}
    forged = sign_fields("not-the-token", PURPOSE_REGISTER, {k: v for k, v in fields.items()
                                                             if k not in ("ts", "nonce", "mac")})
    forged["mac"] = mac
    target.dealer.send(msgpack.packb(forged))


def _answers(port: int, data: bytes, count: int) -> list[tuple[int, dict[bytes, bytes]]]:
    """Send ``data`` in one write; the first ``count`` answers read back (status, headers), fewer
    when the proxy closes the connection first."""
    answers = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        f = s.makefile("rb")
        try:
            while len(answers) < count:
                line = f.readline()
                if not line:
                    break
                status = int(line.split(b" ", 2)[1])
                headers = {}
                while (field := f.readline()) not in (b"\r\n", b""):
                    name, _, value = field.partition(b":")
                    headers[name.strip().lower()] = value.strip()
                if b"content-length" in headers:
                    f.read(int(headers[b"content-length"]))
                elif headers.get(b"transfer-encoding") == b"chunked":
                    while (size := int(f.readline().split(b";")[0], 16)) > 0:
                        f.read(size + 2)
                    f.readline()
                answers.append((status, headers))
                if headers.get(b"connection") == b"close":
                    break
        except (ConnectionError, TimeoutError, OSError, ValueError, IndexError):
            pass
    return answers


_garbage = st.binary(max_size=400) | st.sampled_from([
    b"HELLO THERE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /health HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"])


@settings(FUZZ, max_examples=80)
@given(good=st.integers(1, 3), tail=_garbage)
def test_requests_read_before_anything_are_answered_first_and_in_order(target, good, tail):
    """Whatever follows them in the same write, the requests before it get their own answers, in order."""
    data = b"".join(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Request-Id: good-%d\r\n\r\n" % i
                    for i in range(good))
    answers = _answers(target.proxy.port, data + tail, good)
    assert [(status, headers.get(b"x-request-id")) for status, headers in answers] == \
        [(200, b"good-%d" % i) for i in range(good)], tail


@settings(FUZZ, max_examples=80)
@given(prompt=st.text(max_size=40), cuts=st.lists(st.integers(1, 30), max_size=4),
       trailers=st.lists(st.tuples(st.text(_token_chars, min_size=1, max_size=12),
                                   st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)),
                         max_size=5),
       trailer_id=st.text(st.characters(min_codepoint=0x30, max_codepoint=0x7A, categories=["L", "N"]),
                          min_size=1, max_size=20))
def test_chunked_trailers_are_dropped(target, prompt, cuts, trailers, trailer_id):
    body = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()
    chunks, at = [], 0
    for cut in cuts:
        if at < len(body):
            chunks.append(body[at:at + cut])
            at += cut
    chunks.append(body[at:])
    lines = [(k, v) for k, v in trailers] + [("X-Request-Id", "trailer-" + trailer_id)]
    data = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in chunks if c)
            + b"0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in lines).encode("latin-1") + b"\r\n")
    answers = _answers(target.proxy.port, data, 1)
    assert answers, data
    status, headers = answers[0]
    assert status != 500, data
    assert headers.get(b"x-request-id", b"") != ("trailer-" + trailer_id).encode(), data


def _spellings(path: str) -> st.SearchStrategy[str]:
    """``path`` written another way: a character percent-encoded, a slash doubled, a dot segment
    or a trailing slash added, or in absolute form."""
    def encode_one(i: int) -> str:
        i = 1 + i % (len(path) - 1)
        return path[:i] + "%%%02X" % ord(path[i]) + path[i + 1:]

    return st.one_of(st.integers(0, 99).map(encode_one), st.just("/" + path), st.just(path + "/"),
                     st.just("/." + path), st.just("/x/.." + path), st.just("http://fuzz" + path),
                     st.just(path.replace("/", "//")))


@settings(FUZZ, max_examples=60)
@given(route=st.sampled_from(["/instances", "/metrics", "/health"]).flatmap(_spellings),
       method=st.sampled_from(["GET", "POST"]))
def test_management_routes_answer_only_their_raw_path(target, route, method):
    data = (f"{method} {route} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {ADMIN}\r\n"
            "Content-Length: 0\r\n\r\n").encode()
    assert _status_of(target.proxy.port, data) == 404, route


def test_zz_the_proxy_survived_stayed_small_and_logged_no_traceback(target):
    """Runs after the fuzzers above (same module, same process)."""
    target.alive()
    status, listing = http("GET", target.proxy.url + "/instances", headers={"Authorization": f"Bearer {ADMIN}"})
    assert status == 200 and len(listing) == 2  # no ping without the token registered anything
    status, metrics = http("GET", target.proxy.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert 'atom_kv_proxy_rejected_registrations_total{reason="auth"}' in metrics
    assert rss_bytes(target.proxy.proc.pid) - target.rss_start < 64 << 20
    log = target.close()
    assert "Traceback" not in log, log[-3000:]
    assert "REGISTRATION IS OPEN" not in log  # it has a token
