import logging
import random
import socket
import threading
import time

import msgspec
import pytest
import zmq

from atom_kv import wire
from atom_kv.auth import PURPOSE_REGISTER, AuthError, ReplayWindow, verify_fields
from atom_kv.discovery import build_registration_pinger, parse_proxy_address
from atom_kv.testing.polling import wait_until
from tests.conftest import free_port
from tests.connector.kvutil import config


def non_ephemeral_port() -> int:
    """A free port below the kernel's ephemeral range: a DEALER that keeps dialing a
    closed ephemeral port can self-connect (source port == destination port) and
    occupy it, so a proxy that starts late could not bind it."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(500):
        port = rng.randint(max(1024, low - 12000), low - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port below the ephemeral range")


def _recv_ping(ctx: zmq.Context, port: int, timeout_ms: int = 5000) -> tuple[wire.RegisterPing, zmq.Socket]:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    for attempt in range(50):  # a just-closed ROUTER releases its port asynchronously
        try:
            router.bind(f"tcp://127.0.0.1:{port}")
            break
        except zmq.ZMQError:
            if attempt == 49:
                raise
            time.sleep(0.05)
    assert router.poll(timeout_ms), "no registration ping arrived"
    frames = router.recv_multipart()
    return wire.decode(frames[-1], wire.RegistrationMessage), router


def test_pings_reach_a_proxy_started_late_and_restarted():
    port = non_ephemeral_port()
    cfg = config("kv_producer", 6400, proxy_ip=f"127.0.0.1:{port}", ping_interval_s=0.1, auth_token="s3cret")
    pinger = build_registration_pinger(cfg, role="P", index="0", http_host="127.0.0.1", http_port=8100,
                                       tp_size=2, engine_id="P-1", model="tiny")
    ctx = zmq.Context()
    try:
        pinger.start()
        ping, router = _recv_ping(ctx, port)  # the proxy came up after the pinger
        unsigned = msgspec.structs.replace(ping, ts=None, nonce=None, mac=None)
        assert unsigned == wire.RegisterPing(role="P", index="0", request_address="http://127.0.0.1:8100/v1/completions",
                                             handshake_port=6400, dp_size=1, tp_size=2, transfer_mode="read",
                                             engine_id="P-1", model="tiny", answers=True)
        # signed with the token (which itself never travels): the proxy's check accepts it
        assert ping.mac and ping.nonce and abs(ping.ts - time.time()) < 60
        fields = msgspec.to_builtins(ping)
        verify_fields("s3cret", PURPOSE_REGISTER, fields, ReplayWindow(30.0))
        assert b"s3cret" not in msgspec.msgpack.encode(fields)
        router.close(0)  # proxy restarts
        ping2, router = _recv_ping(ctx, port)
        assert ping2.engine_id == "P-1"
        router.close(0)
        assert pinger.sent >= 2
    finally:
        pinger.close()
        pinger.close()
        ctx.destroy(linger=0)
    assert not pinger._thread.is_alive()


def test_atom_map_layout_on_the_wire():
    import msgpack

    port = free_port()
    cfg = config("kv_consumer", 6500, proxy_ip=f"127.0.0.1:{port}", ping_interval_s=0.1)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    pinger = build_registration_pinger(cfg, role="D", index="3", http_host="10.1.1.1", http_port=9000,
                                       tp_size=1, dp_size=2, engine_id="D-3").start()
    try:
        assert router.poll(5000)
        raw = msgpack.unpackb(router.recv_multipart()[-1])
        assert raw["type"] == "register" and raw["role"] == "D" and raw["index"] == "3"
        assert raw["request_address"] == "http://10.1.1.1:9000/v1/completions"
        assert (raw["handshake_port"], raw["dp_size"], raw["tp_size"], raw["transfer_mode"]) == (6500, 2, 1, "read")
        assert raw["mac"] is None and "auth_token" not in raw  # no token configured: unsigned
    finally:
        pinger.close()
        router.close(0)
        ctx.destroy(linger=0)


def test_no_proxy_means_no_thread():
    pinger = build_registration_pinger(config("kv_producer", 6400), role="P", index="0", http_host="h",
                                       http_port=1, tp_size=1, engine_id="e").start()
    assert pinger._thread is None
    pinger.close()


def test_parse_proxy_address():
    assert parse_proxy_address("10.0.0.1", 36367) == ("10.0.0.1", 36367)
    assert parse_proxy_address("10.0.0.1:4000", 36367) == ("10.0.0.1", 4000)
    assert parse_proxy_address("tcp://h:5", 1) == ("h", 5)
    assert parse_proxy_address("[::1]:7", 1) == ("::1", 7)
    with pytest.raises(ValueError, match="port"):
        parse_proxy_address("h:x", 1)


def test_a_pinger_that_waits_for_its_engine_pings_only_once_the_engine_serves():
    """vLLM and ATOM build their connector before their HTTP server listens: no ping (so no proxy probe of a
    port nobody answers) until that port accepts connections; closing while it waits stops the thread."""
    http_port = free_port()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    cfg = config("kv_consumer", 6500, proxy_ip=f"127.0.0.1:{port}", ping_interval_s=0.1)
    pinger = build_registration_pinger(cfg, role="D", index="0", http_host="127.0.0.1", http_port=http_port,
                                       tp_size=1, engine_id="D-1", wait_until_serving=True).start()
    idle = build_registration_pinger(cfg, role="D", index="1", http_host="127.0.0.1", http_port=free_port(),
                                     tp_size=1, engine_id="D-2", wait_until_serving=True).start()
    server = socket.socket()
    try:
        assert not router.poll(600), "pinged before the engine's HTTP server listened"
        server.bind(("127.0.0.1", http_port))
        server.listen(8)
        assert router.poll(5000), "no ping once the engine's HTTP server listened"
        ping = wire.decode(router.recv_multipart()[-1], wire.RegistrationMessage)
        assert ping.engine_id == "D-1" and pinger.sent >= 1
    finally:
        pinger.close()
        idle.close()
        server.close()
        router.close(0)
        ctx.destroy(linger=0)
    assert not pinger._thread.is_alive() and not idle._thread.is_alive() and idle.sent == 0


def test_a_pinger_announces_its_kv_features_signed_with_the_rest():
    cfg = config("kv_consumer", 6400, proxy_ip="127.0.0.1:1", auth_token="s3cret")
    pinger = build_registration_pinger(cfg, role="D", index="0", http_host="127.0.0.1", http_port=8200,
                                       tp_size=1, engine_id="D-1", kv_features=("rendezvous",))
    fields = msgspec.msgpack.decode(pinger.payload())
    assert fields["kv_features"] == ["rendezvous"]
    verify_fields("s3cret", PURPOSE_REGISTER, fields, ReplayWindow(30.0))
    with pytest.raises(AuthError):  # the features are part of what the MAC covers
        verify_fields("s3cret", PURPOSE_REGISTER, dict(fields, kv_features=["rendezvous", "first_token"]),
                      ReplayWindow(30.0))
    silent = build_registration_pinger(cfg, role="D", index="0", http_host="127.0.0.1", http_port=8200,
                                       tp_size=1, engine_id="D-1")
    assert msgspec.msgpack.decode(silent.payload())["kv_features"] is None


def test_the_pinger_logs_the_first_success_once_then_each_change_and_ignores_answers_nobody_asked_for(caplog):
    """A real ROUTER plays the proxy: it answers each ping from a script, and floods unasked answers once."""
    caplog.set_level(logging.INFO, logger="atom_kv.discovery")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    cfg = config("kv_producer", 6400, proxy_ip=f"127.0.0.1:{port}", ping_interval_s=0.05,
                 registration_answer_timeout_s=30.0)
    pinger = build_registration_pinger(cfg, role="P", index="0", http_host="127.0.0.1", http_port=8100,
                                       tp_size=1, engine_id="P-1").start()
    ok = wire.RegisterAnswer(status="registered")
    refused = wire.RegisterAnswer(status="refused", reason="token", detail="wrong mac")
    unreachable = wire.RegisterAnswer(status="registered", reason="unreachable", detail="but the proxy cannot reach")
    script = [ok, ok, refused, refused, refused, ok, ok, unreachable, unreachable]
    try:
        for n, answer in enumerate(script):
            assert router.poll(5000), "no ping"
            frames = router.recv_multipart()
            assert msgspec.msgpack.decode(frames[-1])["answers"] is True
            router.send_multipart([frames[0], wire.encode(answer)])
            if n == 0:  # answers nobody asked for: read at most as many as pings are outstanding, never logged
                for _ in range(50):
                    router.send_multipart([frames[0], wire.encode(refused)])
        wait_until(lambda: pinger.answers >= len(script), 10, interval=0.02, what="the answers to be read")
    finally:
        pinger.close()
        router.close(0)
        ctx.destroy(linger=0)
    lines = [r.getMessage() for r in caplog.records if "proxy 127.0.0.1" in r.getMessage()]
    assert lines[0].startswith(f"registered with proxy 127.0.0.1:{port} as P engine P-1")
    assert [line.split(" (")[0] for line in lines[1:]] == [
        f"proxy 127.0.0.1:{port} refused registration of P engine P-1", f"registered with proxy 127.0.0.1:{port} again",
        f"proxy 127.0.0.1:{port} registered P engine P-1"]
    assert "(token): wrong mac" in lines[1] and lines[3].endswith("but the proxy cannot reach")
    assert [r.levelname for r in caplog.records if "proxy 127.0.0.1" in r.getMessage()] == [
        "INFO", "WARNING", "INFO", "WARNING"]
    assert pinger.bad_answers >= 40


def _silence_warning(caplog, port: int, timeout_s: float = 10.0) -> str:
    """Ping 127.0.0.1:``port`` (answer timeout 0.3 s) until the pinger warns that nothing came back; that line."""
    caplog.set_level(logging.WARNING, logger="atom_kv.discovery")
    caplog.clear()
    cfg = config("kv_producer", 6400, proxy_ip=f"127.0.0.1:{port}", ping_interval_s=0.1,
                 registration_answer_timeout_s=0.3)
    pinger = build_registration_pinger(cfg, role="P", index="0", http_host="127.0.0.1", http_port=8100,
                                       tp_size=1, engine_id="P-1").start()
    try:
        lines = wait_until(lambda: [r.getMessage() for r in caplog.records if "no answer from proxy" in r.getMessage()],
                           timeout_s, interval=0.02, what="the no-answer warning")
    finally:
        pinger.close()
    assert lines[0].startswith(f"no answer from proxy 127.0.0.1:{port} in 0.3 s: ")
    return lines[0]


def test_no_answer_from_a_port_that_refuses_says_it_never_connected(caplog):
    line = _silence_warning(caplog, non_ephemeral_port())
    assert "never connected" in line and "refused" in line and "nothing came back" not in line, line


def test_no_answer_to_a_connection_attempt_says_it_never_connected_and_why(caplog, unaccepting_port):
    line = _silence_warning(caplog, unaccepting_port)
    assert "never connected" in line and "has had no answer" in line and "firewall" in line, line
    assert "nothing came back" not in line, line


def test_a_proxy_that_takes_the_ping_and_answers_nothing_is_connected_with_nothing_back(caplog):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    try:
        line = _silence_warning(caplog, router.bind_to_random_port("tcp://127.0.0.1"))
    finally:
        router.close(0)
        ctx.term()
    assert "connected, but nothing came back" in line and "never connected" not in line, line


def test_a_port_that_is_no_zeromq_socket_says_the_handshake_did_not_complete(caplog):
    """A server that accepts and closes at once (no ZeroMQ greeting): connected, the handshake never done."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=serve, name="closing-server", daemon=True)
    thread.start()
    try:
        line = _silence_warning(caplog, server.getsockname()[1])
    finally:
        stop.set()
        thread.join(5)
        server.close()
    assert "connected, but the connection closed before ZeroMQ's handshake completed" in line, line
    assert "never connected" not in line and "nothing came back" not in line, line


def test_a_proxy_that_goes_away_after_the_ping_arrived_says_the_connection_was_lost(caplog):
    caplog.set_level(logging.WARNING, logger="atom_kv.discovery")
    port = non_ephemeral_port()  # closed later: a DEALER cannot connect to itself there
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    cfg = config("kv_producer", 6400, proxy_ip=f"127.0.0.1:{port}", ping_interval_s=0.1,
                 registration_answer_timeout_s=1.0)
    pinger = build_registration_pinger(cfg, role="P", index="0", http_host="127.0.0.1", http_port=8100,
                                       tp_size=1, engine_id="P-1").start()
    try:
        assert router.poll(5000), "no ping arrived"
        router.close(0)  # the proxy goes away without answering
        lines = wait_until(lambda: [r.getMessage() for r in caplog.records if "no answer from proxy" in r.getMessage()],
                           10, interval=0.02, what="the no-answer warning")
    finally:
        pinger.close()
        ctx.destroy(linger=0)
    assert "connected before, but the connection was lost" in lines[0], lines
    assert "never connected" not in lines[0], lines


def test_leaving_sends_a_signed_draining_ping_at_once_and_waits_for_its_answer():
    """A real ROUTER plays the proxy; pings are 30 s apart, so only leaving() explains a second one now."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    cfg = config("kv_consumer", 6400, proxy_ip=f"127.0.0.1:{port}", ping_interval_s=30.0, auth_token="s3cret",
                 registration_answer_timeout_s=30.0)
    pinger = build_registration_pinger(cfg, role="D", index="0", http_host="127.0.0.1", http_port=8200,
                                       tp_size=1, engine_id="D-1").start()
    window = ReplayWindow(60.0)
    try:
        assert router.poll(5000), "no first ping"
        first = router.recv_multipart()
        assert msgspec.msgpack.decode(first[-1])["draining"] is False
        pinger.leaving()
        assert router.poll(5000), "no draining ping before the next interval"
        frames = router.recv_multipart()
        fields = msgspec.msgpack.decode(frames[-1])
        assert fields["draining"] is True and wire.decode(frames[-1], wire.RegistrationMessage).draining
        verify_fields("s3cret", PURPOSE_REGISTER, fields, window)  # signed like every ping
        with pytest.raises(AuthError):  # ... and the mark is covered by the MAC
            verify_fields("s3cret", PURPOSE_REGISTER, dict(fields, draining=False, nonce="other"), window)
        # the answer to the ping sent before leaving() says nothing about the draining one
        router.send_multipart([first[0], wire.encode(wire.RegisterAnswer(status="registered"))])
        wait_until(lambda: pinger.answers == 1, 5, interval=0.02, what="the first answer")
        assert not pinger.left.is_set()
        router.send_multipart([frames[0], wire.encode(wire.RegisterAnswer(status="registered"))])
        assert pinger.left.wait(5)
    finally:
        pinger.close()
        router.close(0)
        ctx.destroy(linger=0)
    assert pinger.left.is_set()
