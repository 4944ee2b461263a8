"""The reference engine's HTTP port answers malformed HTTP with 400, without a traceback (issue 27).

Reproduction before this change: a 30 s fuzz of the port logged 1,087 aiohttp tracebacks at ERROR."""

from __future__ import annotations

import socket

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
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
