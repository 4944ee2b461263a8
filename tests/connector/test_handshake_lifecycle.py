"""The handshake server, the frame server and the connector workers open nothing when they are
constructed: ``start()`` binds and starts threads, ``close()`` stops them (and is safe before
``start()``). And the handshake port hands each message type to its own handler: a type without one is
refused and counted, never taken for a Release."""

from __future__ import annotations

import logging
import socket
import threading
import time

import msgspec
import pytest
import zmq

from atom_kv import wire
from atom_kv.connector import create_worker
from atom_kv.connector.handshake import BasePortHandler, HandshakeServer, MessageContext
from atom_kv.connector.stats import TransferStats
from atom_kv.testing.listeners import listeners
from atom_kv.testing.polling import wait_until
from atom_kv.testing.ports import free_plan_base
from atom_kv.transfer._events import EndpointEvents
from atom_kv.transfer._frame_server import FrameServer, ServerLimits
from tests.conftest import free_port
from tests.connector.kvutil import OS_ASSIGNED, compat, config, make_caches


def _ours() -> set[str]:
    """Names of this process's connector threads (every one is named atom-kv-* or atomkv-*)."""
    return {t.name for t in threading.enumerate() if t.name.startswith(("atom-kv", "atomkv"))}


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_gone(names: set[str], timeout_s: float = 5.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while (left := names & _ours()) and time.monotonic() < deadline:
        time.sleep(0.02)  # thread exit has no event to wait on; bounded
    return left


class Recorder(BasePortHandler):
    """A rank that records what its port hands it, by method."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.got = threading.Event()

    def identity(self) -> tuple[str, int]:
        return "P", 0

    def answer_handshake(self, request):
        self.calls.append(("answer_handshake", request))
        return wire.HandshakeReply(ok=True, engine_id="P")

    def on_done(self, msg, respond) -> None:
        self.calls.append(("on_done", msg))
        if respond is not None:
            respond(wire.DoneAck(transfer_id=msg.transfer_id, tp_rank=0, valid=True))

    def on_release(self, msg) -> None:
        self.calls.append(("on_release", msg))
        self.got.set()

    def on_issued(self, msg) -> None:
        self.calls.append(("on_issued", msg))


def _server(port: int, handler=None) -> tuple[zmq.Context, HandshakeServer]:
    ctx = zmq.Context()
    return ctx, HandshakeServer(ctx, handler or Recorder(), bind_host="127.0.0.1", port=port, auth_token=None,
                                stats=TransferStats("P"), name="atom-kv-hs-server-lifecycle")


def test_a_handshake_server_binds_and_runs_only_between_start_and_close():
    port = free_port()
    before = _ours()
    ctx, server = _server(port)
    try:
        assert _port_free(port), "constructing the server bound its port"
        assert _ours() == before, "constructing the server started a thread"
        server.close()  # before start: nothing to stop
        server.close()
        with pytest.raises(RuntimeError, match="start"):
            server.start()  # a closed server stays closed
        _, second = _server(port)
        second.start()
        try:
            assert not _port_free(port)
            assert "atom-kv-hs-server-lifecycle" in _ours()
        finally:
            second.close()
        assert not _wait_gone({"atom-kv-hs-server-lifecycle"})
        # ZeroMQ's I/O thread lets the bind go just after close() returns
        wait_until(lambda: _port_free(port), 5.0, interval=0.02, what=f"port {port} free after close()")
    finally:
        ctx.destroy(linger=0)


def test_a_frame_server_binds_and_runs_only_between_start_and_close():
    port = free_port()
    before = _ours()
    limits = ServerLimits(max_connections=4, max_frame=1024, read_timeout_s=1.0, idle_timeout_s=1.0, threads=2)
    events = EndpointEvents(logging.getLogger(__name__), "lifecycle events")

    def make() -> FrameServer:
        return FrameServer("atomkv-lifecycle", "lifecycle", "127.0.0.1", limits, events, greet=lambda c: b"hi",
                           refuse_busy=lambda why: b"busy", handle=lambda c, p: False, port=port)

    unstarted = make()
    assert _port_free(port) and _ours() == before
    unstarted.close()
    server = make().start()
    try:
        assert server.port == port and not _port_free(port)
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.settimeout(2)
            assert s.recv(16)[-2:] == b"hi"  # the greeting frame: it serves
        started = _ours() - before
        assert len(started) == 3  # the selector thread and two handlers
    finally:
        server.close()
    assert not _wait_gone(started)
    assert _port_free(port)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_a_connector_worker_opens_nothing_until_it_starts(role):
    cfg = config(role, free_plan_base(1, blocks=3), backend="tcp", **{key: None for key in OS_ASSIGNED})
    before_threads, before_ports = _ours(), listeners(v6=False)
    w = create_worker(cfg, engine_id="E", host="127.0.0.1", tp_rank=0, tp_size=1, compat=compat())
    assert listeners(v6=False) - before_ports == set(), "constructing the worker opened a listener"
    assert _ours() == before_threads, "constructing the worker started a thread"
    w.close()  # before start: safe, and nothing is left
    assert _ours() == before_threads

    w = create_worker(cfg, engine_id="E", host="127.0.0.1", tp_rank=0, tp_size=1, compat=compat())
    try:
        w.register_kv_caches(make_caches(4, 0, 1, fill=True))  # starts the worker first
        started = _ours() - before_threads  # a decode rank's pools start their threads on first use
        if role == "kv_producer":
            assert "atom-kv-hs-server-tp0" in started  # and the tcp read server, once registered
            assert ("127.0.0.1", cfg.handshake_port) in listeners(v6=False)
        assert w.start() is w  # idempotent
    finally:
        w.close()
    assert not _wait_gone(started)
    assert listeners(v6=False) - before_ports == set()


def _dealer(port: int) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return ctx, sock


def test_each_message_type_reaches_its_own_handler():
    port = free_port()
    rank = Recorder()
    ctx, server = _server(port, rank)
    server.start()
    dctx, dealer = _dealer(port)
    try:
        done = wire.DoneReading(transfer_id="t1", engine_id="D", tp_rank=0, tp_size=1, ok=True, want_ack=True)
        dealer.send(wire.encode(wire.Issued(transfer_id="t1", block_ids=[1, 2])))
        dealer.send(wire.encode(done))
        assert dealer.poll(5000), "no confirmation"
        ack = wire.decode(dealer.recv(), wire.DoneAck)
        assert ack.transfer_id == "t1" and ack.valid
        dealer.send(wire.encode(wire.Release(transfer_id="t1", reason="test", sender="D")))
        assert rank.got.wait(5)
        assert [name for name, _ in rank.calls] == ["on_issued", "on_done", "on_release"]
        assert server.refusals() == {}
    finally:
        dealer.close(0)
        dctx.term()
        server.close()
        ctx.destroy(linger=0)


def test_a_message_type_without_a_handler_is_refused_and_counted_never_taken_for_a_release():
    rank = Recorder()
    stats = TransferStats("P")
    ctx = zmq.Context()
    server = HandshakeServer(ctx, rank, bind_host="127.0.0.1", port=0, auth_token=None, stats=stats,
                             name="atom-kv-hs-server-dispatch")
    try:
        stranger = wire.HandshakeChallenge(engine_id="P", tp_rank=0, nonce="n" * 32, proof="")
        server._dispatch(MessageContext(b"id", wire.encode(stranger), "127.0.0.9"), stranger)

        class NotOnTheWire(msgspec.Struct):
            transfer_id: str = "t9"

        server._dispatch(MessageContext(b"id", b"", ""), NotOnTheWire())
        assert rank.calls == []
        assert server.refusals() == {"type": 2}
        assert stats.snapshot()["bad_messages"] == 2
    finally:
        server.close()
        ctx.destroy(linger=0)
