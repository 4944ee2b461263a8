"""``python -m atom_kv.proxy`` as a real subprocess: registration, health, SIGTERM, bad input."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import msgpack
import zmq

from tests.conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT)


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("proxy did not listen")


def test_subprocess_registration_health_and_sigterm():
    http, disc = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "atom_kv.proxy", "--host", "127.0.0.1", "--port", str(http),
         "--discovery-host", "127.0.0.1", "--discovery-port", str(disc), "--heartbeat-timeout", "5"],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_listening(http, proc)
        assert _get(f"http://127.0.0.1:{http}/health") == (503, {"status": "unavailable", "prefill": 0, "decode": 0})
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(f"tcp://127.0.0.1:{disc}")
        sock.send(msgpack.packb({"type": "HELLO"}))
        for role, port in (("P", 18001), ("D", 18002)):
            sock.send(msgpack.packb({
                "type": "register", "role": role, "index": "0",
                "request_address": f"http://127.0.0.1:{port}/v1/completions",
                "handshake_port": 6000 + port % 10, "dp_size": 2, "tp_size": 4, "transfer_mode": "read"}))
        deadline = time.monotonic() + 5
        while _get(f"http://127.0.0.1:{http}/health")[0] != 200:
            assert time.monotonic() < deadline, "instances did not register"
            time.sleep(0.05)
        sock.close()
        ctx.term()
        assert _get(f"http://127.0.0.1:{http}/health") == (200, {"status": "ok", "prefill": 1, "decode": 1})
        status, listing = _get(f"http://127.0.0.1:{http}/instances")
        assert status == 200
        assert [(i["role"], i["address"], i["tp_size"], i["dp_size"]) for i in listing] == [
            ("P", "http://127.0.0.1:18001", 4, 2), ("D", "http://127.0.0.1:18002", 4, 2)]
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - started < 3
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atom_kv.proxy", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=20)


def test_bad_cli_input_is_one_line():
    res = _run("--policy", "fastest")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("atom-kv-proxy: error: argument --policy")
    res = _run("--heartbeat-timeout", "-3")
    assert res.returncode == 2 and "--heartbeat-timeout" in res.stderr.strip().splitlines()[-1]


def test_port_in_use_is_one_clear_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = _run("--host", "127.0.0.1", "--port", str(port), "--discovery-host", "127.0.0.1",
                   "--discovery-port", str(free_port()))
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [f"atom-kv-proxy: cannot listen on 127.0.0.1:{port}: address already in use"]
