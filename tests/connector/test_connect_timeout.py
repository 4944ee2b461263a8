"""``connect_timeout_s``: a decode rank that cannot connect to a producer rank says so after one connect
timeout and fails the load at its first attempt, instead of waiting out ``handshake_timeout_s`` once per
``transfer_retries`` attempt. A producer that connects and then stays silent still gets the whole
``handshake_timeout_s``.

A port whose listen backlog is full (``unaccepting_port``) drops the connection attempts, as a firewall's
DROP rule does; a port nothing listens on refuses them."""

from __future__ import annotations

import time

import pytest
import zmq

from atom_kv import wire
from atom_kv.config import KVTransferConfig
from atom_kv.connector.handshake import HandshakeError, HandshakeUnreachable, request_handshake
from atom_kv.transfer import PeerUnreachable, create_backend
from tests.conftest import free_port
from tests.connector.engines import run_until
from tests.connector.inproc import consumer_engine
from tests.connector.kvutil import compat

CONNECT_S = 0.5
HANDSHAKE_S = 20.0  # far above what any test here may take: a wait of it is a failure


def _request() -> wire.HandshakeRequest:
    return wire.HandshakeRequest(engine_id="d", tp_rank=0, tp_size=1, compat=compat(), backend="tcp")


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(0)


def _unreachable(ctx: zmq.Context, port: int) -> tuple[HandshakeUnreachable, float]:
    t0 = time.monotonic()
    with pytest.raises(HandshakeUnreachable) as err:
        request_handshake(ctx, "127.0.0.1", port, _request(), HANDSHAKE_S, connect_timeout_s=CONNECT_S)
    return err.value, time.monotonic() - t0


def test_a_handshake_port_that_drops_the_connection_fails_after_one_connect_timeout(ctx, unaccepting_port):
    err, took = _unreachable(ctx, unaccepting_port)
    assert CONNECT_S <= took < HANDSHAKE_S / 4, took
    assert str(err).startswith(f"cannot connect to 127.0.0.1:{unaccepting_port} within 0.5 s (connect_timeout_s): "
                               "never connected: the connection attempt has had no answer"), err


def test_a_handshake_port_that_refuses_the_connection_says_it_was_refused(ctx):
    err, took = _unreachable(ctx, free_port())  # nothing listens there
    assert took < HANDSHAKE_S / 4, took
    assert "(connect_timeout_s): never connected: the connection was refused" in str(err), err


def test_a_connected_but_silent_producer_still_gets_the_handshake_timeout(ctx):
    port = free_port()
    silent = ctx.socket(zmq.ROUTER)  # takes the connection and the request, never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(f"tcp://127.0.0.1:{port}")
    try:
        t0 = time.monotonic()
        with pytest.raises(HandshakeError) as err:
            request_handshake(ctx, "127.0.0.1", port, _request(), 2.0, connect_timeout_s=0.2)
        assert not isinstance(err.value, HandshakeUnreachable)
        assert time.monotonic() - t0 >= 2.0
        assert str(err.value) == f"no handshake reply from 127.0.0.1:{port} within 2 s"
    finally:
        silent.close(0)


def test_a_load_from_an_unreachable_producer_fails_at_its_first_attempt(unaccepting_port):
    D, dw, _ = consumer_engine(free_port(), handshake_timeout_s=HANDSHAKE_S, connect_timeout_s=CONNECT_S,
                               transfer_retries=2)
    try:
        params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "127.0.0.1",
                  "remote_port": unaccepting_port, "remote_handshake_port": unaccepting_port, "remote_tp_size": 1,
                  "remote_block_ids": [0, 1], "transfer_id": "t-unreachable"}
        t0 = time.monotonic()
        D.admit("d1", 20, params)
        run_until([D], lambda: "d1" in D.failed, timeout_s=HANDSHAKE_S / 2)
        assert time.monotonic() - t0 < HANDSHAKE_S / 4
        assert f"cannot connect to 127.0.0.1:{unaccepting_port} within 0.5 s (connect_timeout_s)" in D.failed["d1"]
        stats = dw.stats()
        assert stats["retries"] == 0 and stats["handshake_failures"] == 1, stats  # one attempt, no retry
        assert D.pool.held == {}
    finally:
        dw.close()


def test_a_tcp_read_port_that_drops_the_connection_is_unreachable_after_one_connect_timeout(unaccepting_port):
    cfg = KVTransferConfig.from_dict({"kv_role": "kv_consumer", "backend": "tcp", "connect_timeout_s": CONNECT_S,
                                      "handshake_timeout_s": HANDSHAKE_S})
    backend = create_backend("tcp", cfg, host="127.0.0.1", key="reader")
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachable) as err:
            backend.add_peer(wire.encode(wire.TcpDescriptor(host="127.0.0.1", port=unaccepting_port, key="p")))
        assert CONNECT_S <= time.monotonic() - t0 < HANDSHAKE_S / 4
        assert str(err.value).startswith(f"tcp: cannot connect to peer 127.0.0.1:{unaccepting_port} within 0.5 s "
                                         "(connect_timeout_s)"), err.value
    finally:
        backend.close()
