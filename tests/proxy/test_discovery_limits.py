"""The discovery port's pre-auth ceiling, against a real proxy process and real ZeroMQ DEALERs: frames over
the largest legitimate ping, from many connections, leave its memory bounded; connections past the caps
are shut down; a legitimate engine still registers and is answered."""

from __future__ import annotations

import threading
import time

import msgspec
import zmq

from atom_kv.auth import PURPOSE_REGISTER, sign_fields
from atom_kv.proxy.fleet.pings import MAX_PING_BYTES, decode_discovery, largest_ping_bytes
from atom_kv.testing.polling import wait_until
from atom_kv.testing.procfs import rss_bytes
from atom_kv.testing.web import http_json as http
from atom_kv.wire import RegisterAnswer, RegisterPing, decode, encode
from tests.proxy.procs import ProxyProcess

TOKEN = "limits-secret"
MiB = 2**20


def _signed_ping(http_port: int = 9) -> bytes:
    ping = RegisterPing(role="D", index="0", request_address=f"http://127.0.0.1:{http_port}/v1/completions",
                        handshake_port=1, answers=True)
    return msgspec.msgpack.encode(sign_fields(TOKEN, PURPOSE_REGISTER, msgspec.to_builtins(ping)))


def _answer(endpoint: str, source: str | None = None, timeout_s: float = 15.0) -> RegisterAnswer:
    """One signed ping from a fresh DEALER (bound to ``source`` if given); its answer."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        host_port = endpoint[len("tcp://"):]
        sock.connect(f"tcp://{source}:0;{host_port}" if source else endpoint)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # resend: a connection shut down by the guard drops its queue
            sock.send(_signed_ping())
            if sock.poll(1000):
                return decode(sock.recv(), RegisterAnswer)
        raise AssertionError("no answer from the proxy")
    finally:
        sock.close(0)
        ctx.term()


def test_the_size_bound_covers_the_largest_legitimate_ping():
    assert largest_ping_bytes() < MAX_PING_BYTES <= 32 * 1024
    wide = "\U0001F600"
    ping = RegisterPing(role="P", index=wide * 256, request_address="http://h:1/" + wide * 1000, handshake_port=1,
                        engine_id=wide * 256, model=wide * 256, kv_features=[wide * 64] * 32, answers=True)
    assert len(encode(ping)) <= largest_ping_bytes()
    decode_discovery(encode(ping))  # legitimate: accepted by the decoder


def test_many_connections_of_oversized_frames_leave_the_proxys_memory_bounded():
    proxy = ProxyProcess("--registration-token", TOKEN)
    ctx = zmq.Context()
    socks = []
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            try:
                peak[0] = max(peak[0], rss_bytes(proxy.proc.pid))
            except (OSError, RuntimeError):
                return
    sampler = threading.Thread(target=sample, name="test-rss-sampler", daemon=True)
    try:
        assert _answer(proxy.discovery).status == "registered"  # warm: the port works
        idle = rss_bytes(proxy.proc.pid)
        sampler.start()
        # a ping-shaped map of 46 KiB: over the bound, under the 64 KiB the port took before, and slow to
        # decode (milliseconds), so a proxy that reads it queues what it cannot yet look at
        frame = msgspec.msgpack.encode({"type": "register", **{f"k{i}": i for i in range(5400)}})
        assert MAX_PING_BYTES < len(frame) < 64 * 1024
        for _ in range(64):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.connect(proxy.discovery)
            socks.append(sock)
        for _ in range(100):  # 64 x 100 x 48 KiB = 300 MiB offered
            for sock in socks:
                try:
                    sock.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    pass
        time.sleep(3.0)  # let the I/O threads push what they can
        assert _answer(proxy.discovery, source="127.0.0.2").status == "registered"  # still serving
        stop.set()
        sampler.join(5)
        grown = peak[0] - idle
        assert grown < 40 * MiB, f"RSS grew {grown / MiB:.0f} MiB above idle"
        assert proxy.proc.poll() is None
    finally:
        stop.set()
        for sock in socks:
            sock.close(0)
        ctx.term()
        proxy.kill()


def test_connections_past_the_per_source_cap_are_shut_down_and_a_known_engine_still_registers():
    proxy = ProxyProcess("--registration-token", TOKEN, "--discovery-max-connections-per-source", "4",
                         "--discovery-max-connections", "8")
    ctx = zmq.Context()
    socks = []
    try:
        assert _answer(proxy.discovery, source="127.0.0.3").status == "registered"  # a source that registered
        for _ in range(20):  # idle connections from one stranger
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 2000)
            sock.connect(proxy.discovery)
            socks.append(sock)

        def refused() -> bool:
            _, text = http("GET", proxy.url + "/metrics")
            return 'atom_kv_proxy_rejected_registrations_total{reason="connections"}' in text
        wait_until(refused, 15, what="connections past the cap to be refused")
        # the stranger holds at most its 4; a second stranger fills the rest of the unreserved share ...
        for _ in range(4):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.4:0;127.0.0.1:{proxy.discovery_port}")
            socks.append(sock)
        # ... and the source that registered before still gets in, on the reserved share
        assert _answer(proxy.discovery, source="127.0.0.3").status == "registered"
        assert "connections from 127.0.0.1 already open" in "".join(proxy.lines)
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
        proxy.kill()
