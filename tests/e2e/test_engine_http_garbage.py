"""The reference engine's HTTP port answers malformed HTTP and malformed bodies with 400, without a traceback.

Issue 27: a 30 s fuzz of the port logged 1,087 aiohttp tracebacks at ERROR.
Issue 38: ``"temperature": 1e-310`` or ``NaN`` stopped the engine (F1); a
5000-digit integer, a lone surrogate and a client reset mid-body were 500s
with tracebacks (F10). The tests run in file order; the last one stops the
engine to read its whole log."""

from __future__ import annotations

import json
import socket
import struct
import time

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json

GARBAGE = [
    b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET /he\x00alth HTTP/1.1\r\nHost: x\r\n\r\n",
    # a good request first, then bytes that are not HTTP on the same connection
    b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    c = Cluster([EngineSpec("colocated", num_blocks=32)], with_proxy=False,
                log_dir=str(tmp_path_factory.mktemp("garbage-engine")))
    c.start()
    try:
        yield c
    finally:
        c.close()


def _exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)  # the engine answers and closes the connection (an error always closes it)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _post(port: int, body: bytes, path: str = "/v1/completions") -> tuple[int, dict]:
    """POST ``body`` as it is (bytes no JSON encoder would write); the status and the JSON answer."""
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    answer = _exchange(port, head + body)
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split(b" ")[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def _serves(engine) -> None:
    status, body = _post(engine.ports[0], b'{"prompt": "still here", "max_tokens": 2}')
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    assert engine.engines[0].alive()


@pytest.mark.parametrize("body,param", [
    (b'{"prompt": "hello", "max_tokens": 4, "temperature": 1e-310}', "temperature"),
    (b'{"prompt": "hello", "max_tokens": 4, "temperature": 0.001, "seed": 3}', "temperature"),
    (b'{"prompt": "hello", "max_tokens": 4, "temperature": NaN}', None),  # not JSON: refused by the parser
    (b'{"prompt": "hello", "max_tokens": 4, "temperature": Infinity}', None),
    (b'{"prompt": "hello", "max_tokens": 4, "temperature": 1e400}', None),
    (b'{"prompt": "hello", "max_tokens": 4, "top_p": -1e-300}', "top_p"),
    (b'{"prompt": "hello", "max_tokens": 4, "seed": 18446744073709551616}', "seed"),
], ids=["temperature=1e-310", "temperature=0.001", "temperature=NaN", "temperature=Infinity",
        "temperature=1e400", "top_p=-1e-300", "seed=2**64"])
def test_sampling_values_that_stopped_the_engine_are_a_400_and_it_serves_the_next(engine, body, param):
    for path in ("/v1/completions", "/v1/chat/completions"):
        sent = body if path == "/v1/completions" else body.replace(
            b'"prompt": "hello"', b'"messages": [{"role": "user", "content": "hello"}]')
        status, answer = _post(engine.ports[0], sent, path)
        assert status == 400 and answer["error"]["param"] == param, answer
        _serves(engine)


MALFORMED_BODIES = [
    b'{"prompt": "hello", "max_tokens": ' + b"1" * 5000 + b"}",
    b'{"prompt": "hello", "seed": -' + b"9" * 5000 + b"}",
    b'{"prompt": "\\ud800", "max_tokens": 2}',
    b'{"prompt": "hi", "max_tokens": 2, "stop": "\\udfff"}',
    b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}',
    b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}',  # a surrogate spelt in UTF-8: not UTF-8
    b"\xff\xfe{}",
    b"[" * 100_000,
    b'{"prompt": ' * 50_000,
    b"",
    b"{",
    b'"just a string"',
    b'{"prompt": "x", "max_tokens": 2}  trailing',
]


def test_malformed_bodies_are_a_400_naming_the_problem(engine):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        for body in MALFORMED_BODIES:
            status, answer = _post(engine.ports[0], body, path)
            assert status == 400 and answer["error"]["message"], (path, body[:60], answer)
    _serves(engine)


def _send_then_drop(port: int, data: bytes, *, reset: bool) -> None:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(data)
    time.sleep(0.2)  # the engine is reading the body now
    if reset:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends a RST
    else:
        s.shutdown(socket.SHUT_WR)
        s.settimeout(10)
        while s.recv(65536):
            pass
    s.close()


def test_a_client_gone_mid_body_is_logged_in_one_line(engine):
    port = engine.ports[0]
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    chunked = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n"
    for data in (head + b'{"prompt', chunked):
        for reset in (True, False):
            _send_then_drop(port, data, reset=reset)
    _serves(engine)
    assert engine.engines[0].log_text().count("went away while sending its body") == 4


def test_a_client_gone_before_the_stream_starts_is_logged_in_one_line(engine):
    """Found by the chaos soak (a proxy killed while its decode leg waited for the first token): the client
    resets the connection before the first token; the stream's head then meets a closing transport. Said
    in one line, the request aborted, never a traceback nor a 500."""
    port = engine.ports[0]
    body = json.dumps({"prompt": "gone before the first token " * 4, "max_tokens": 4, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    before = engine.engines[0].log_text()
    n = 4
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(head + body)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends a RST
        s.close()

    def ended() -> bool:
        log = engine.engines[0].log_text()[len(before):]
        return log.count("client disconnected") + log.count("failed inside the engine's HTTP handler") >= n

    wait_until(ended, 30, what="the engine to end every request whose client went away")
    log = engine.engines[0].log_text()[len(before):]
    assert "Traceback" not in log and "failed inside the engine's HTTP handler" not in log, log[-3000:]
    _serves(engine)
    assert http_json("GET", engine.engine_url(0) + "/health")[1]["kv_blocks"]["free"] == 32


def test_malformed_http_is_a_400_and_no_traceback(engine):
    port = engine.ports[0]
    for data in GARBAGE:
        answer = _exchange(port, data)
        assert b" 400 Bad Request\r\n" in answer, (data, answer[:200])
    assert http_json("GET", engine.engine_url(0) + "/health")[0] == 200  # still serving
    engine.engines[0].stop()  # flushes its log
    log = engine.engines[0].log_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert "malformed HTTP request from" in log  # counted and said once, in one line
