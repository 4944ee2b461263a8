"""Challenge-response on the data path (tcp read server, cma grant endpoint),
with real sockets on 127.0.0.1: wrong tokens are refused, counted and
logged rate-limited; the token never crosses the wire (recorded through a
relay and by fake servers); a server that cannot prove the token is refused
before anything else is sent; ``v`` mismatches are refused naming both
versions."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Callable

import msgspec
import numpy as np
import pytest

from atom_kv import wire
from atom_kv.config import KVTransferConfig
from atom_kv.transfer import ReadOp, TransferError, create_backend
from atom_kv.transfer.cma.syscalls import cma_unavailable_reason
from atom_kv.transfer._sockio import FRAME_HEADER, frame, recv_frame
from tests.transfer._raw import Recorder, record_until_closed, tcp_open

TOKEN = "s3cret-Token-4711"
SIZE = 64 * 1024
BLOCK = 4096
TCP_V = wire.TCP_PROTOCOL_VERSION
CMA_V = wire.CMA_PROTOCOL_VERSION

CMA_REASON = cma_unavailable_reason()
needs_cma = pytest.mark.skipif(CMA_REASON is not None, reason=CMA_REASON or "")


def _cfg(token: str | None = TOKEN, **extra: Any) -> KVTransferConfig:
    return KVTransferConfig(kv_role="kv_consumer", auth_token=token, transfer_timeout_s=3, handshake_timeout_s=3,
                            cma={"grant_timeout_s": 3}, **extra)


class Side:
    """One in-process backend with a registered, patterned buffer."""

    def __init__(self, name: str, token: str | None, key: str, **extra: Any) -> None:
        self.backend = create_backend(name, _cfg(token, **extra), key=key)
        self.buf = np.random.default_rng(abs(hash(key)) % 1000).integers(0, 256, SIZE, dtype=np.uint8)
        self.backend.register_memory(self.buf.ctypes.data, SIZE, align=BLOCK)

    def read_from(self, other: "Side", descriptor: bytes | None = None) -> str:
        peer = self.backend.add_peer(descriptor or other.backend.export_descriptor())
        self.buf[:] = 0
        h = self.backend.read(peer, [ReadOp(0, 0, 0, 0, SIZE)], timeout_s=3)
        assert h.wait(6) and h.error is None, h.error
        assert np.array_equal(self.buf, other.buf)
        return peer

    def close(self) -> None:
        self.backend.close()


@pytest.fixture
def sides():
    made: list[Side] = []

    def make(name: str, token: str | None, key: str, **extra: Any) -> Side:
        s = Side(name, token, key, **extra)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _frames(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos + FRAME_HEADER.size <= len(data):
        (n,) = FRAME_HEADER.unpack_from(data, pos)
        out.append(data[pos + FRAME_HEADER.size : pos + FRAME_HEADER.size + n])
        pos += FRAME_HEADER.size + n
    return out


def _server_lines(caplog: pytest.LogCaptureFixture, label: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and label in r.getMessage()]


# -- wrong tokens ---------------------------------------------------------------
@pytest.mark.parametrize("backend", ["tcp", pytest.param("cma", marks=needs_cma)])
def test_wrong_or_missing_token_is_refused_counted_and_logged_rate_limited(sides, caplog, backend: str) -> None:
    server = sides(backend, TOKEN, "server")
    caplog.set_level(logging.WARNING, logger="atom_kv.transfer")
    for i in range(20):
        reader = sides(backend, "wrong" if i % 2 else None, f"bad{i}")
        with pytest.raises(TransferError, match="auth_token"):
            reader.backend.add_peer(server.backend.export_descriptor())
        reader.close()
    assert server.backend.stats()["auth"] == 20
    lines = _server_lines(caplog, "server")
    assert 1 <= len(lines) <= 3, lines  # one line, then only counted (a summary follows later)
    sides(backend, TOKEN, "good").read_from(server)


def test_reader_with_a_token_refuses_a_server_without_one(sides) -> None:
    server = sides("tcp", None, "open-server")
    reader = sides("tcp", TOKEN, "reader")
    with pytest.raises(TransferError, match="does not authenticate.*same auth_token"):
        reader.backend.add_peer(server.backend.export_descriptor())


# -- the token never travels -------------------------------------------------------
def test_tcp_token_never_on_the_wire(sides) -> None:
    server, reader = sides("tcp", TOKEN, "server"), sides("tcp", TOKEN, "reader")
    desc = wire.decode(server.backend.export_descriptor(), wire.TcpDescriptor)
    relay = Recorder(upstream=(desc.host, desc.port))
    try:
        desc.port = relay.port
        reader.read_from(server, wire.encode(desc))
        reader.backend.close()
    finally:
        relay.close()
    sent, received = bytes(relay.to_server), bytes(relay.to_reader)
    assert b"tcp_hello" in sent and b"rd" in sent and len(received) > SIZE  # the whole session went through
    for blob in (sent, received):
        assert TOKEN.encode() not in blob
        assert TOKEN.encode().hex().encode() not in blob


@needs_cma
def test_cma_token_never_on_the_wire(sides) -> None:
    server, reader = sides("cma", TOKEN, "server"), sides("cma", TOKEN, "reader")
    desc = wire.decode(server.backend.export_descriptor(), wire.CmaDescriptor)
    relay = Recorder(upstream=(desc.ctl_host, desc.ctl_port))
    try:
        desc.ctl_port = relay.port
        reader.read_from(server, wire.encode(desc))
    finally:
        relay.close()
    sent, received = bytes(relay.to_server), bytes(relay.to_reader)
    assert b"cma_grant" in sent and b"cma_grant_ok" in received
    for blob in (sent, received):
        assert TOKEN.encode() not in blob


# -- mutual: a server that cannot prove the token gets nothing further ---------------
Script = Callable[[socket.socket, bytearray], None]


def _fake_tcp_server(answer: Callable[[wire.TcpHello], wire.TcpHelloReply]) -> Script:
    def script(conn: socket.socket, log: bytearray) -> None:
        conn.sendall(frame(wire.encode(wire.TcpServerHello(nonce=os.urandom(16).hex()))))
        data = recv_frame(conn)
        log += frame(data)
        conn.sendall(frame(wire.encode(answer(wire.decode(data, wire.TcpHello)))))
        record_until_closed(conn, log)

    return script


@pytest.mark.parametrize("answer", [
    lambda hello: wire.TcpHelloReply(ok=True, proof="0" * 64, max_ranges=8192),  # a guess
    lambda hello: wire.TcpHelloReply(ok=True, proof=hello.proof, max_ranges=8192),  # the reader's own proof, reflected
    lambda hello: wire.TcpHelloReply(ok=True, max_ranges=8192),  # no proof at all
], ids=["guessed", "reflected", "missing"])
def test_tcp_reader_refuses_a_server_that_cannot_prove_the_token(sides, answer) -> None:
    reader = sides("tcp", TOKEN, "reader")
    fake = Recorder(script=_fake_tcp_server(answer))
    try:
        desc = wire.TcpDescriptor(host="127.0.0.1", port=fake.port, key="fake")
        with pytest.raises(TransferError, match="could not prove it knows the auth_token"):
            reader.backend.add_peer(wire.encode(desc))
    finally:
        fake.close()
    frames = _frames(bytes(fake.to_server))
    assert len(frames) == 1, "the reader sent more than its hello to an unproven server"
    hello = wire.decode(frames[0], wire.TcpHello)
    assert len(hello.nonce) == 32 and len(hello.proof) == 64
    assert TOKEN.encode() not in bytes(fake.to_server)


@needs_cma
def test_cma_reader_refuses_a_grant_endpoint_that_cannot_prove_the_token(sides) -> None:
    reader = sides("cma", TOKEN, "reader")

    def script(conn: socket.socket, log: bytearray) -> None:
        conn.sendall(frame(wire.encode(wire.CmaChallenge(nonce=os.urandom(16).hex()))))
        data = recv_frame(conn)
        log += data
        req = wire.decode(data, wire.CmaGrantRequest)
        regions = [wire.RegionSpan(0, reader.buf.ctypes.data, SIZE)]
        conn.sendall(frame(wire.encode(wire.CmaGrantReply(ok=True, pid=os.getpid(), regions=regions,
                                                          proof=req.proof))))

    fake = Recorder(script=script)
    try:
        from atom_kv.transfer._hostid import host_identity

        desc = wire.CmaDescriptor(pid=os.getpid(), host_id=host_identity(), ctl_host="127.0.0.1",
                                  ctl_port=fake.port, key="fake")
        with pytest.raises(TransferError, match="could not prove it knows the auth_token"):
            reader.backend.add_peer(wire.encode(desc))
    finally:
        fake.close()
    assert TOKEN.encode() not in bytes(fake.to_server)


@needs_cma
def test_cma_grant_endpoint_counts_and_survives_undecodable_requests(sides, caplog) -> None:
    server = sides("cma", TOKEN, "server")
    desc = wire.decode(server.backend.export_descriptor(), wire.CmaDescriptor)
    caplog.set_level(logging.WARNING, logger="atom_kv.transfer")
    for payload in (b"\xc1junk", b"\x81\xa3zzz" + b"\x91" * 4000 + b"\x00", b"\x93\x01\x02\x03") * 5:
        with socket.create_connection((desc.ctl_host, desc.ctl_port), timeout=3) as s:
            assert wire.decode(recv_frame(s), wire.CmaChallenge).ok
            s.sendall(frame(payload))
            reply = wire.decode(recv_frame(s), wire.CmaGrantReply)
            assert not reply.ok and "bad grant request" in reply.error
    assert server.backend.stats()["decode"] == 15
    assert 1 <= len(_server_lines(caplog, "server")) <= 3
    assert not any(r.exc_info for r in caplog.records)
    sides("cma", TOKEN, "good").read_from(server)


# -- protocol versions --------------------------------------------------------------
def test_tcp_hello_v999_is_refused_naming_both_versions(sides) -> None:
    server = sides("tcp", TOKEN, "server")
    desc = wire.decode(server.backend.export_descriptor(), wire.TcpDescriptor)
    for payload in (
        wire.encode(wire.TcpHello(key="future", v=999)),
        msgspec.msgpack.encode({"t": "tcp_hello", "v": 999, "key": ["a", "newer", "shape"]}),  # undecodable too
    ):
        s, _ = tcp_open(desc.host, desc.port)
        with s:
            s.sendall(frame(payload))
            reply = wire.decode(recv_frame(s), wire.TcpHelloReply)
            assert not reply.ok and "v999" in reply.error and f"v{TCP_V}" in reply.error, reply.error
    assert server.backend.stats()["version"] == 2


@needs_cma
def test_cma_grant_request_v999_is_refused_naming_both_versions(sides) -> None:
    server = sides("cma", TOKEN, "server")
    desc = wire.decode(server.backend.export_descriptor(), wire.CmaDescriptor)
    with socket.create_connection((desc.ctl_host, desc.ctl_port), timeout=3) as s:
        assert wire.decode(recv_frame(s), wire.CmaChallenge).nonce
        s.sendall(frame(wire.encode(wire.CmaGrantRequest(pid=os.getpid(), v=999))))
        reply = wire.decode(recv_frame(s), wire.CmaGrantReply)
    assert not reply.ok and "v999" in reply.error and f"v{CMA_V}" in reply.error, reply.error
    assert server.backend.stats()["version"] == 1


def test_reader_refuses_a_server_speaking_v999(sides) -> None:
    reader = sides("tcp", None, "reader")

    def script(conn: socket.socket, log: bytearray) -> None:
        conn.sendall(frame(wire.encode(wire.TcpServerHello(v=999))))
        record_until_closed(conn, log)

    fake = Recorder(script=script)
    try:
        with pytest.raises(TransferError, match=rf"v999.*v{TCP_V}"):
            reader.backend.add_peer(wire.encode(wire.TcpDescriptor(host="127.0.0.1", port=fake.port)))
    finally:
        fake.close()
    assert fake.to_server == b"", "the reader answered a server of another protocol version"


@pytest.mark.parametrize("garbage", [b"\xc1\xc1 garbage", b"\x81\xa3zzz" + b"\x91" * 4000 + b"\x00"],
                         ids=["undecodable", "nested-too-deep"])
def test_reader_survives_garbage_from_a_server_and_counts_it(sides, garbage: bytes) -> None:
    reader = sides("tcp", None, "reader")

    def script(conn: socket.socket, log: bytearray) -> None:
        conn.sendall(frame(garbage))
        record_until_closed(conn, log)

    fake = Recorder(script=script)
    try:
        for _ in range(3):
            with pytest.raises(TransferError, match="bad hello"):
                reader.backend.add_peer(wire.encode(wire.TcpDescriptor(host="127.0.0.1", port=fake.port)))
    finally:
        fake.close()
    assert reader.backend.stats()["reader_bad_reply"] == 3
