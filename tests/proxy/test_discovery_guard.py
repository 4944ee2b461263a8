"""ConnectionGuard on real TCP sockets: caps per source and in all, the share kept for known sources,
connections that ended without an event, and descriptors that are not the discovery port's."""

from __future__ import annotations

import socket

import pytest

from atom_kv.proxy.fleet.discovery_guard import ConnectionGuard


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    accepted: list[socket.socket] = []
    clients: list[socket.socket] = []

    def connect(source: str) -> tuple[socket.socket, socket.socket]:
        client = socket.socket()
        client.bind((source, 0))
        client.connect(srv.getsockname())
        conn, _ = srv.accept()
        clients.append(client)
        accepted.append(conn)
        return client, conn

    yield srv.getsockname()[1], connect
    for s in accepted + clients + [srv]:
        s.close()


def _shut(client: socket.socket) -> bool:
    """Whether the server side shut the connection down (the client reads EOF)."""
    client.settimeout(5)
    return client.recv(1) == b""


def test_a_source_past_its_cap_is_shut_down_and_others_are_not(listener):
    port, connect = listener
    guard = ConnectionGuard(port, max_connections=100, per_source=2)
    for _ in range(2):
        _, conn = connect("127.0.0.1")
        assert guard.accepted(conn.fileno()) is None
    client, conn = connect("127.0.0.1")
    problem = guard.accepted(conn.fileno())
    assert problem is not None and "2 connections from 127.0.0.1" in problem
    assert "--discovery-max-connections-per-source 2" in problem
    assert _shut(client)
    _, conn = connect("127.0.0.2")
    assert guard.accepted(conn.fileno()) is None and len(guard) == 3


def test_the_total_cap_keeps_a_quarter_for_sources_that_registered(listener):
    port, connect = listener
    guard = ConnectionGuard(port, max_connections=8, per_source=100)
    guard.trust("127.0.0.9")
    for _ in range(6):
        _, conn = connect("127.0.0.1")
        assert guard.accepted(conn.fileno()) is None
    client, conn = connect("127.0.0.2")  # a stranger: only the unreserved 6
    assert "kept for sources that registered before" in guard.accepted(conn.fileno())
    assert _shut(client)
    for _ in range(2):  # a known source: the reserved 2
        _, conn = connect("127.0.0.9")
        assert guard.accepted(conn.fileno()) is None
    client, conn = connect("127.0.0.9")
    assert guard.accepted(conn.fileno()) is not None and _shut(client)


def test_disconnects_and_connections_that_ended_without_an_event_free_their_slot(listener):
    port, connect = listener
    guard = ConnectionGuard(port, max_connections=100, per_source=1)
    _, first = connect("127.0.0.1")
    assert guard.accepted(first.fileno()) is None
    guard.disconnected(first.fileno())
    assert len(guard) == 0
    assert guard.accepted(first.fileno()) is None  # same connection seen again: counted once
    old_fd = first.fileno()
    first.close()  # gone, and no event said so; its number now names something else
    placeholder = socket.socket()
    try:
        assert placeholder.fileno() == old_fd
        _, second = connect("127.0.0.1")
        assert second.fileno() != old_fd
        assert guard.accepted(second.fileno()) is None and len(guard) == 1
    finally:
        placeholder.close()


def test_a_descriptor_that_is_not_a_connection_on_the_port_is_left_alone(listener, tmp_path):
    port, connect = listener
    guard = ConnectionGuard(port + 1 if port < 65535 else port - 1, max_connections=1, per_source=1)
    client, conn = connect("127.0.0.1")
    assert guard.accepted(conn.fileno()) is None and len(guard) == 0  # another port: not ours to count
    with open(tmp_path / "f", "w") as f:
        assert guard.accepted(f.fileno()) is None and len(guard) == 0
    client.settimeout(0.2)
    with pytest.raises(socket.timeout):
        client.recv(1)  # still open
