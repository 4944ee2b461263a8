"""The tcp read server against hand-made (malformed, malicious) frames on a
raw socket: it answers with errors, never sends unregistered memory, and
keeps serving."""

from __future__ import annotations

import socket
from typing import Iterator

import numpy as np
import pytest

from atom_kv import wire
from atom_kv.config import KVTransferConfig
from atom_kv.transfer.tcp import TcpBackend
from atom_kv.transfer._sockio import frame, recv_exact, recv_frame
from tests.transfer._raw import tcp_login

SIZE = 64 * 1024


@pytest.fixture
def served() -> Iterator[tuple[TcpBackend, np.ndarray, wire.TcpDescriptor]]:
    cfg = KVTransferConfig(kv_role="kv_producer", transfer_timeout_s=2, handshake_timeout_s=2, auth_token="tok")
    be = TcpBackend(cfg)
    buf = np.arange(SIZE, dtype=np.uint8)
    be.max_region_bytes = 16 * 1024
    assert be.register_memory(buf.ctypes.data, SIZE, align=4096) == [0, 1, 2, 3]
    desc = wire.decode(be.export_descriptor(), wire.TcpDescriptor)
    yield be, buf, desc
    be.close()


def _connect(desc: wire.TcpDescriptor, token: str | None = "tok") -> socket.socket:
    s, reply = tcp_login(desc.host, desc.port, token)
    assert reply.ok, reply.error
    return s


def _request(s: socket.socket, req_id: int, triples: list[tuple[int, int, int]]) -> wire.ReadReply:
    packed = np.array(triples, dtype="<u8").tobytes() if triples else b""
    s.sendall(frame(wire.encode(wire.ReadRequest(req_id=req_id, ranges=[], packed=packed))))
    return wire.decode(recv_frame(s), wire.ReadReply)


def test_hello_with_wrong_token_is_refused(served) -> None:
    be, _, desc = served
    s, reply = tcp_login(desc.host, desc.port, "nope")
    with s:
        assert not reply.ok and "auth_token" in reply.error and not reply.proof
        assert s.recv(1) == b""  # server hung up
    assert be.server.auth_failures == 1


def test_malicious_ranges_refused_then_good_read(served) -> None:
    be, buf, desc = served
    with _connect(desc) as s:
        evil = [
            [(3, 16 * 1024 - 10, 20)],  # past the last region's end
            [(4, 0, 1)],  # no such region
            [(0, 2**63, 16)],  # offset wraps negative
            [(0, 0, 2**64 - 1)],  # size wraps negative
            [(0, 0, 0)],  # empty range
            [(0, 0, 16), (2**40, 0, 16)],  # one good, one bad
        ]
        for i, triples in enumerate(evil):
            reply = _request(s, i, triples)
            assert not reply.ok and reply.req_id == i, triples
            assert "outside the registered regions" in reply.error
        # the connection is still in sync: a good request returns the right bytes
        reply = _request(s, 99, [(1, 100, 50), (3, 0, 10)])
        assert reply.ok and reply.total == 60
        data = recv_exact(s, 60)
        expected = np.concatenate([buf[16 * 1024 + 100 : 16 * 1024 + 150], buf[48 * 1024 : 48 * 1024 + 10]])
        assert bytes(data) == expected.tobytes()
    assert be.server.rejected_ranges == len(evil)


def test_garbage_frames_are_counted_and_survived(served) -> None:
    be, buf, desc = served
    with _connect(desc) as s:
        s.sendall(frame(b"\xc1not msgpack"))
        reply = wire.decode(recv_frame(s), wire.ReadReply)
        assert not reply.ok
        s.sendall(frame(wire.encode(wire.ReadRequest(req_id=5, ranges=[], packed=b"\x00" * 7))))
        reply = wire.decode(recv_frame(s), wire.ReadReply)
        assert not reply.ok and "triples" in reply.error
        reply = _request(s, 6, [(0, 0, 8)])
        assert reply.ok and bytes(recv_exact(s, 8)) == buf[:8].tobytes()
    assert be.server.decode_errors == 1


def test_legacy_ranges_list_is_served(served) -> None:
    _, buf, desc = served
    with _connect(desc) as s:
        req = wire.ReadRequest(req_id=1, ranges=[wire.ReadRange(2, 5, 7)])
        s.sendall(frame(wire.encode(req)))
        reply = wire.decode(recv_frame(s), wire.ReadReply)
        assert reply.ok and bytes(recv_exact(s, 7)) == buf[32 * 1024 + 5 : 32 * 1024 + 12].tobytes()


def test_legacy_ranges_beyond_int64_are_refused_and_survived(served) -> None:
    be, buf, desc = served
    with _connect(desc) as s:
        for i, rng in enumerate([wire.ReadRange(2**64 - 1, 0, 1), wire.ReadRange(0, 2**63, 1)]):
            s.sendall(frame(wire.encode(wire.ReadRequest(req_id=i, ranges=[rng]))))
            reply = wire.decode(recv_frame(s), wire.ReadReply)
            assert not reply.ok and reply.req_id == i and "64-bit" in reply.error
        req = wire.ReadRequest(req_id=9, ranges=[wire.ReadRange(0, 3, 4)])
        s.sendall(frame(wire.encode(req)))
        reply = wire.decode(recv_frame(s), wire.ReadReply)
        assert reply.ok and bytes(recv_exact(s, 4)) == buf[3:7].tobytes()
    assert be.server.rejected_ranges == 2


def test_bad_hello_frame(served) -> None:
    be, _, desc = served
    with socket.create_connection((desc.host, desc.port), timeout=2) as s:
        assert wire.decode(recv_frame(s), wire.TcpServerHello).nonce  # the challenge comes first
        s.sendall(frame(b"junk"))
        reply = wire.decode(recv_frame(s), wire.TcpHelloReply)
        assert not reply.ok and "bad hello" in reply.error
    assert be.server.decode_errors == 1
