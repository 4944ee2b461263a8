"""``/readiness`` and ``/liveness`` on a real proxy process (``python -m atom_kv.proxy``):

* readiness is 503 with a one-line JSON reason until a usable prefill/decode pair exists (engines that
  register through real pings, or static engines that start answering), then 200;
* liveness is 200 whenever the proxy serves, with engines or without;
* neither needs the admin token (like ``/health``), and both answer only the allowed ``Host`` names.
"""

from __future__ import annotations

import json
import socket

from atom_kv.testing.polling import wait_until
from atom_kv.testing.ports import free_port_range
from atom_kv.testing.web import http_json
from tests.proxy.procs import FakeEngines, ProxyProcess

ADMIN = "probe-test-admin-token"


def _get(port: int, path: str, host: str) -> tuple[int, bytes]:
    """``GET path`` over a raw socket with exactly this ``Host``: status and body."""
    head = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode())
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _ready(proxy: ProxyProcess) -> bool:
    return http_json("GET", proxy.url + "/readiness", timeout=5)[0] == 200


def test_readiness_waits_for_a_registered_pair_and_liveness_answers_throughout():
    proxy = ProxyProcess("--allow-open-registration", "--admin-token", ADMIN)
    engines = None
    try:
        status, body = http_json("GET", proxy.url + "/readiness", timeout=5)
        assert status == 503, body
        assert body["status"] == "not ready" and body["prefill"] == 0 and body["decode"] == 0, body
        assert body["reason"] == "no prefill engine known; no decode engine known", body
        _, raw = _get(proxy.port, "/readiness", "localhost")
        assert raw.count(b"\n") == 0 and json.loads(raw) == body  # the whole answer is one line
        assert http_json("GET", proxy.url + "/liveness", timeout=5) == (200, {"status": "alive"})
        assert http_json("GET", proxy.url + "/instances", timeout=5)[0] == 401  # the token is on

        engines = FakeEngines("--discovery", proxy.discovery, "--ping-interval", "0.2")
        wait_until(lambda: _ready(proxy), 15, interval=0.1, what="readiness once the pair registered")
        status, body = http_json("GET", proxy.url + "/readiness", timeout=5)
        assert (status, body) == (200, {"status": "ready", "prefill": 1, "decode": 1})
        assert http_json("GET", proxy.url + "/liveness", timeout=5) == (200, {"status": "alive"})
    finally:
        if engines is not None:
            engines.stop()
        proxy.kill()


def test_readiness_names_known_engines_that_are_not_usable_until_they_answer():
    base = free_port_range(2)  # below the ephemeral range: still free when the engines bind them later
    prefill, decode = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"
    proxy = ProxyProcess("--no-discovery", "--prefill", prefill, "--decode", decode, "--probe-interval", "0.2")
    engines = None
    try:
        status, body = http_json("GET", proxy.url + "/readiness", timeout=5)
        assert status == 503, body
        assert body["reason"] == ("none of the 1 known prefill engine(s) is usable (/instances has each one's "
                                  "state); none of the 1 known decode engine(s) is usable (/instances has each "
                                  "one's state)"), body
        assert http_json("GET", proxy.url + "/liveness", timeout=5) == (200, {"status": "alive"})

        engines = FakeEngines("--prefill-port", str(base), "--decode-port", str(base + 1))
        wait_until(lambda: _ready(proxy), 15, interval=0.1, what="readiness once the static engines answer")
        engines.stop()  # gone: the next probe of these static engines is refused, and readiness follows
        wait_until(lambda: http_json("GET", proxy.url + "/readiness", timeout=5)[0] == 503, 15, interval=0.1,
                   what="readiness to drop once the engines stopped")
        assert http_json("GET", proxy.url + "/liveness", timeout=5) == (200, {"status": "alive"})
    finally:
        if engines is not None:
            engines.stop()
        proxy.kill()


def test_the_probes_answer_without_the_admin_token_and_only_to_allowed_hosts():
    proxy = ProxyProcess("--allow-open-registration", "--admin-token", ADMIN)
    try:
        for path, status in (("/readiness", 503), ("/liveness", 200)):
            assert _get(proxy.port, path, f"localhost:{proxy.port}")[0] == status, path  # no Authorization
            refused, raw = _get(proxy.port, path, "evil.example")
            assert refused == 421, (path, raw)
            assert "--allowed-hosts" in json.loads(raw)["error"]["message"]
    finally:
        proxy.kill()
