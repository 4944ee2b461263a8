"""``python -m atom_kv.proxy`` as a real subprocess: registration, health, flags, SIGTERM, bad input, limits."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time

import msgpack
import zmq

from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json as http
from tests.proxy.procs import ENV, ROOT, FakeEngines, ProxyProcess, rss_bytes


def test_subprocess_registration_health_and_sigterm():
    proxy = ProxyProcess("--heartbeat-timeout", "5", "--registration-token", "cli-secret")
    engines = None
    try:
        assert "discovery listening on tcp://127.0.0.1:" in "".join(proxy.lines)  # follows --host
        assert http("GET", proxy.url + "/health") == (503, {"status": "unavailable", "prefill": 0, "decode": 0})
        engines = FakeEngines("--discovery", proxy.discovery, "--dp-size", "2", "--ping-interval", "0.2",
                              "--auth-token", "cli-secret")
        wait_until(lambda: http("GET", proxy.url + "/health")[0] == 200, 10, interval=0.05, what="the engines to register")
        assert http("GET", proxy.url + "/health") == (200, {"status": "ok", "prefill": 1, "decode": 1})
        status, listing = http("GET", proxy.url + "/instances")
        assert status == 200
        assert [(i["role"], i["address"], i["dp_size"], i["state"]) for i in listing] == [
            ("P", engines.prefill[0], 2, "up"), ("D", engines.decode[0], 2, "up")]
        status, answer = http("POST", proxy.url + "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert status == 200 and answer["choices"][0]["text"] == " t0 t1 t2"
        started = time.monotonic()
        assert proxy.terminate() == 0
        assert time.monotonic() - started < 3
        assert "Traceback" not in proxy.stderr_rest()
    finally:
        proxy.kill()
        if engines is not None:
            engines.stop()


def test_static_engines_are_probed_up_and_down():
    engines = FakeEngines()
    proxy = ProxyProcess("--no-discovery", "--prefill", f"{engines.prefill[0]},6301,tp=2", "--decode",
                         engines.decode[0], "--probe-interval", "0.2", "--heartbeat-timeout", "2")
    try:
        wait_until(lambda: http("GET", proxy.url + "/health")[0] == 200, 10, interval=0.05, what="the static engines to be probed up")
        status, listing = http("GET", proxy.url + "/instances")
        p, d = listing
        assert (p["source"], p["handshake_port"], p["tp_size"], p["max_model_len"]) == ("static", 6301, 2, 32768)
        assert d["engine_id"].startswith("fake-D-")  # learnt from the engine's /health
        status, answer = http("POST", proxy.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200
        engines.kill()  # both engines vanish: the next probe finds nobody there
        wait_until(lambda: http("GET", proxy.url + "/health")[0] == 503, 5, interval=0.05, what="the proxy to notice")
        status, listing = http("GET", proxy.url + "/instances")
        assert [i["state"] for i in listing] == ["down", "down"]
        assert http("POST", proxy.url + "/v1/completions", {"prompt": "hi"})[0] == 503
    finally:
        proxy.kill()
        engines.kill()


def test_decode_dying_mid_request_ends_its_clients_at_once():
    """SIGKILL the decode engine while one streamed and one plain request are being decoded:
    the stream ends with an error event and [DONE], the plain one with a 502, both at once."""
    import aiohttp
    import asyncio

    prefill = FakeEngines("--decodes", "0")
    decode = FakeEngines("--prefills", "0", "--token-delay", "0.1", "--tokens", "100")
    proxy = ProxyProcess("--no-discovery", "--prefill", prefill.prefill[0], "--decode", decode.decode[0],
                         "--probe-interval", "0.2", "--decode-timeout", "60")

    async def scenario() -> tuple[list[bytes], int, float, float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            plain = asyncio.create_task(s.post(proxy.url + "/v1/completions", json={"prompt": "x", "max_tokens": 100}))
            async with s.post(proxy.url + "/v1/completions",
                              json={"prompt": "x", "max_tokens": 100, "stream": True}) as r:
                events = [await r.content.readuntil(b"\n\n")]  # decoding is under way
                decode.kill()
                killed = time.monotonic()
                while not events[-1].startswith(b"data: [DONE]"):
                    events.append(await r.content.readuntil(b"\n\n"))
                stream_done = time.monotonic() - killed
            resp = await plain
            await resp.read()
            return events, resp.status, stream_done, time.monotonic() - killed

    try:
        wait_until(lambda: http("GET", proxy.url + "/health")[0] == 200, 10, interval=0.05, what="the static engines to be probed up")
        events, plain_status, stream_s, plain_s = asyncio.run(scenario())
        assert b'"error"' in events[-2] and b"interrupted" in events[-2]
        assert plain_status == 502
        assert stream_s < 2.0 and plain_s < 2.0
        status, body = http("GET", proxy.url + "/health")
        assert status == 503 and body["decode"] == 0  # marked down by the dropped connections, not a heartbeat
    finally:
        proxy.kill()
        prefill.kill()
        decode.kill()


def test_a_huge_dp_size_ping_is_refused_without_growing_memory():
    proxy = ProxyProcess("--allow-open-registration")  # unsigned pings reach the limits check
    try:
        before = rss_bytes(proxy.proc.pid)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(proxy.discovery)
        for _ in range(3):
            sock.send(msgpack.packb({
                "type": "register", "role": "D", "index": "0", "request_address": "http://127.0.0.1:1/v1/completions",
                "handshake_port": 1, "dp_size": 50_000_000, "tp_size": 1, "transfer_mode": "read"}))
        sock.close()
        ctx.term()

        def refused() -> bool:
            status, text = http("GET", proxy.url + "/metrics")
            return 'atom_kv_proxy_rejected_registrations_total{reason="limits"} 3.0' in text

        wait_until(refused, 10, interval=0.05, what="the pings to be refused")
        assert rss_bytes(proxy.proc.pid) - before < 20 * 2**20
        assert http("GET", proxy.url + "/instances") == (200, [])
    finally:
        proxy.kill()


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atom_kv.proxy", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=20)


def test_bad_cli_input_is_one_line():
    res = _run("--policy", "fastest")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("atom-kv-proxy: error: argument --policy")
    res = _run("--heartbeat-timeout", "-3")
    assert res.returncode == 2 and "--heartbeat-timeout" in res.stderr.strip().splitlines()[-1]
    res = _run("--prefill", "10.0.0.5:8000")
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "--prefill" in last and "http URL" in last
    res = _run("--otlp-traces-endpoint", "grpc://collector:4317")
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "otlp_traces_endpoint" in last and "http://collector:4318/v1/traces" in last
    if importlib.util.find_spec("uvloop") is None:
        res = _run("--loop", "uvloop", "--port", "0", "--discovery-port", "0")
        assert res.returncode == 1 and res.stderr.strip().splitlines()[-1] == (
            "atom-kv-proxy: --loop uvloop: uvloop is not installed (pip install uvloop)")


def test_ports_in_use_are_one_clear_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = _run("--host", "127.0.0.1", "--port", str(port), "--discovery-port", "0")
        assert res.returncode == 1 and "Traceback" not in res.stderr
        assert res.stderr.strip().splitlines() == [
            f"atom-kv-proxy: cannot listen on 127.0.0.1:{port}: address already in use"]
        res = _run("--host", "127.0.0.1", "--port", "0", "--discovery-port", str(port))
        assert res.returncode == 1 and "Traceback" not in res.stderr
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith(f"atom-kv-proxy: cannot listen for discovery on 127.0.0.1:{port}:"), res.stderr


def test_every_flag_sets_the_setting_it_names():
    """Each option's dest is a ProxySettings field: a flag that maps to nothing fails here, not at start-up."""
    from atom_kv.proxy.__main__ import build_parser, settings_from_args
    from atom_kv.proxy.settings import ProxySettings

    parser = build_parser()
    assert settings_from_args(parser.parse_args([])) == ProxySettings()
    s = settings_from_args(parser.parse_args([
        "--retry-backoff", "0.25", "--circuit-window", "7", "--probe-interval", "0.5", "--registration-window", "9",
        "--circuit-cooldown", "4", "--otlp-timeout", "3", "--max-retries", "5", "--no-release",
        "--prefill", "http://h:1,6301", "--decode", "http://h:2,dp=2", "--decode", "http://h:3"]))
    assert (s.retry_backoff_s, s.circuit_window_s, s.probe_interval_s, s.registration_window_s,
            s.circuit_cooldown_s, s.otlp_timeout_s, s.max_retries, s.release_prefills) == (
        0.25, 7.0, 0.5, 9.0, 4.0, 3.0, 5, False)
    assert [(e.base_url, e.handshake_port) for e in s.static_prefill] == [("http://h:1", 6301)]
    assert [(e.base_url, e.dp_size) for e in s.static_decode] == [("http://h:2", 2), ("http://h:3", None)]
