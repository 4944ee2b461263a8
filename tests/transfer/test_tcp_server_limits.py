"""The tcp read server under hostile or broken connections (real sockets on
127.0.0.1): threads and memory stay bounded, nothing is allocated for a
frame before the reader authenticated, slow and idle connections are
dropped, bad frames are counted and logged rate-limited, and the server
keeps serving real readers throughout."""

from __future__ import annotations

import logging
import socket
import struct
import time
from typing import Any, Iterator

import numpy as np
import pytest

from atom_kv import wire
from atom_kv.config import KVTransferConfig
from atom_kv.transfer import ReadOp
from atom_kv.transfer._sockio import frame, recv_exact, recv_frame, request_frame_limit
from atom_kv.transfer.tcp import TcpBackend
from atom_kv.testing.polling import wait_until
from tests.transfer._raw import closed_by_peer, rss_bytes, tcp_login, tcp_open, thread_count

SIZE = 256 * 1024
BLOCK = 4096


def _cfg(**extra: Any) -> KVTransferConfig:
    return KVTransferConfig(kv_role="kv_producer", transfer_timeout_s=5, handshake_timeout_s=5, **extra)


class Served:
    """An in-process tcp backend serving a patterned buffer."""

    def __init__(self, **config: Any) -> None:
        self.backend = TcpBackend(_cfg(**config), key="served")
        self.buf = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
        self.backend.register_memory(self.buf.ctypes.data, SIZE, align=BLOCK)
        self.descriptor = self.backend.export_descriptor()
        desc = wire.decode(self.descriptor, wire.TcpDescriptor)
        self.host, self.port = desc.host, desc.port

    def stats(self) -> dict[str, int]:
        return self.backend.stats()

    def read_check(self, **reader_config: Any) -> None:
        """A real reader still gets the right bytes."""
        with TcpBackend(_cfg(**reader_config), key="reader") as reader:
            dst = np.zeros(SIZE, dtype=np.uint8)
            reader.register_memory(dst.ctypes.data, SIZE, align=BLOCK)
            peer = reader.add_peer(self.descriptor)
            h = reader.read(peer, [ReadOp(0, 0, 0, BLOCK, 3 * BLOCK)], timeout_s=5)
            assert h.wait(10) and h.error is None, h.error
            assert np.array_equal(dst[: 3 * BLOCK], self.buf[BLOCK : 4 * BLOCK])

    def close(self) -> None:
        self.backend.close()


@pytest.fixture
def make_served() -> Iterator[Any]:
    made: list[Served] = []

    def make(**config: Any) -> Served:
        s = Served(**config)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


def test_many_idle_connections_keep_threads_bounded_and_excess_is_refused(make_served) -> None:
    srv = make_served(tcp={"max_connections": 50, "read_timeout_s": 60, "hello_timeout_s": 60})
    threads_before = thread_count()
    rss_before = rss_bytes()
    socks = [socket.create_connection((srv.host, srv.port), timeout=5) for _ in range(300)]
    try:
        # one address that never authenticated: its newest connections stay, in the strangers' share
        # (tcp.max_connections less the reserve for readers that authenticated before, 50 // 8)
        wait_until(lambda: srv.stats().get("busy_source", 0) == 256, 20, interval=0.02,
                   what="256 oldest connections closed")
        # the count of refusals and of connections held are updated one after the other: both settle
        wait_until(lambda: srv.backend.server.connections == 44, 5, interval=0.02, what="44 connections held")
        assert srv.stats().get("busy_source", 0) == 256
        assert thread_count() - threads_before <= 1, "threads grew with the number of connections"
        assert rss_bytes() - rss_before < 32 << 20
        assert closed_by_peer(socks[0], 5) and not closed_by_peer(socks[-1], 0.2)
    finally:
        _close_all(socks)
    wait_until(lambda: srv.backend.server.connections == 0, 10, interval=0.02, what="connections to be forgotten")
    srv.read_check()


@pytest.mark.parametrize("token", [None, "tok"])
def test_big_frames_announced_before_auth_allocate_nothing(make_served, token) -> None:
    srv = make_served(auth_token=token, tcp={"read_timeout_s": 60})
    rss_before = rss_bytes()
    socks = []
    for _ in range(16):
        s, greeting = tcp_open(srv.host, srv.port)
        s.sendall(struct.pack("!I", 64 << 20) + b"x")  # announce 64 MiB, then dribble
        socks.append(s)
    try:
        for s in socks:
            assert closed_by_peer(s, 5), "an oversized hello frame was not dropped"
        assert rss_bytes() - rss_before < 32 << 20, "memory grew with the announced frame sizes"
        assert srv.stats()["oversized"] == 16
    finally:
        _close_all(socks)
    srv.read_check(auth_token=token)


def test_request_frames_after_auth_are_bounded_by_max_ranges(make_served) -> None:
    srv = make_served(auth_token="tok", tcp={"max_ranges_per_request": 16})
    s, reply = tcp_login(srv.host, srv.port, "tok")
    with s:
        assert reply.ok and reply.max_ranges == 16
        # more ranges than allowed, in a frame that still fits: refused, connection kept
        triples = np.array([(0, i * 8, 4) for i in range(17)], dtype="<u8").tobytes()
        s.sendall(frame(wire.encode(wire.ReadRequest(req_id=1, ranges=[], packed=triples))))
        refusal = wire.decode(recv_frame(s), wire.ReadReply)
        assert not refusal.ok and "limit 16" in refusal.error
        s.sendall(frame(wire.encode(wire.ReadRequest(req_id=2, ranges=[], packed=triples[:48]))))
        ok = wire.decode(recv_frame(s), wire.ReadReply)
        assert ok.ok and ok.total == 8
        recv_exact(s, 8)
        # a frame announced beyond the limit drops the connection before any allocation
        s.sendall(struct.pack("!I", request_frame_limit(16) + 1))
        assert closed_by_peer(s, 5)
    assert srv.stats()["oversized"] == 1
    # a real reader learns the limit and splits a scattered read into requests of <= 16 ranges
    with TcpBackend(_cfg(auth_token="tok"), key="reader") as reader:
        dst = np.zeros(SIZE, dtype=np.uint8)
        reader.register_memory(dst.ctypes.data, SIZE, align=BLOCK)
        peer = reader.add_peer(srv.descriptor)
        n = SIZE // BLOCK
        perm = np.random.default_rng(5).permutation(n)
        ops = [ReadOp(0, i * BLOCK, 0, int(perm[i]) * BLOCK, BLOCK) for i in range(n)]
        h = reader.read(peer, ops, timeout_s=5)
        assert h.wait(10) and h.error is None, h.error
        assert np.array_equal(dst.reshape(n, BLOCK), srv.buf.reshape(n, BLOCK)[perm])


def _dribble_until_dropped(s: socket.socket, limit_s: float) -> float:
    """Send one byte every 50 ms; seconds until the server dropped us."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            s.send(b"\x00")
        except OSError:
            return time.monotonic() - t0
        if closed_by_peer(s, 0.05):
            return time.monotonic() - t0
    raise AssertionError(f"a dribbling connection was still open after {limit_s}s")


@pytest.mark.parametrize("token", [None, "tok"])
def test_dribbling_hello_is_dropped_after_the_hello_timeout(make_served, token) -> None:
    srv = make_served(auth_token=token, tcp={"read_timeout_s": 60, "hello_timeout_s": 0.5})
    s, _ = tcp_open(srv.host, srv.port)
    with s:
        s.sendall(struct.pack("!I", 200))
        elapsed = _dribble_until_dropped(s, 5)
    assert 0.3 < elapsed < 3
    assert srv.stats()["timeout"] == 1
    srv.read_check(auth_token=token)


def test_dribbling_request_is_dropped_after_the_read_timeout(make_served) -> None:
    srv = make_served(auth_token="tok", tcp={"read_timeout_s": 0.5, "idle_timeout_s": 60})
    s, reply = tcp_login(srv.host, srv.port, "tok")
    with s:
        assert reply.ok
        time.sleep(0.8)  # idle longer than the read timeout is fine: only a started frame is timed
        s.sendall(struct.pack("!I", 300))
        elapsed = _dribble_until_dropped(s, 5)
    assert 0.3 < elapsed < 3
    assert srv.stats()["timeout"] == 1


def test_idle_connections_are_closed_and_readers_reconnect(make_served) -> None:
    srv = make_served(tcp={"idle_timeout_s": 0.3})
    with TcpBackend(_cfg(tcp={"streams": 1}), key="reader") as reader:  # one connection: round 2 reuses it
        dst = np.zeros(SIZE, dtype=np.uint8)
        reader.register_memory(dst.ctypes.data, SIZE, align=BLOCK)
        peer = reader.add_peer(srv.descriptor)
        for round_ in range(2):
            dst[:] = 0
            h = reader.read(peer, [ReadOp(0, 0, 0, 0, SIZE)], timeout_s=5)
            assert h.wait(10) and h.error is None, f"round {round_}: {h.error}"
            assert np.array_equal(dst, srv.buf)
            wait_until(lambda: srv.backend.server.connections == 0, 5, interval=0.02, what="idle connections closed")
        assert srv.stats()["idle"] >= 2
        assert reader.stats()["reader_stale"] >= 1


def test_decode_failures_are_counted_logged_rate_limited_and_survived(make_served, caplog) -> None:
    srv = make_served(auth_token="tok")
    caplog.set_level(logging.WARNING, logger="atom_kv.transfer")
    deep = b"\x81\xa3zzz" + b"\x91" * 4000 + b"\x00"  # nested deeper than the decoder recurses
    for i in range(30):
        s, _ = tcp_open(srv.host, srv.port)
        with s:
            s.sendall(frame(b"\xc1 not msgpack" if i % 2 else deep))
            reply = wire.decode(recv_frame(s), wire.TcpHelloReply)
            assert not reply.ok and "bad hello" in reply.error
    s, reply = tcp_login(srv.host, srv.port, "tok")
    with s:
        for i in range(30):
            s.sendall(frame(b"\x93garbage"))
            assert not wire.decode(recv_frame(s), wire.ReadReply).ok
    assert srv.stats()["decode"] == 60
    lines = [r for r in caplog.records if "served" in r.getMessage()]
    assert 1 <= len(lines) <= 4, [r.getMessage() for r in lines]
    assert not any(r.exc_info for r in caplog.records), "a bad frame reached the unexpected-error path"
    srv.read_check(auth_token="tok")


@pytest.mark.parametrize("key,value,words", [
    ("tcp.max_ranges_per_request", 0, "an integer in 1..1048576"),
    ("tcp.max_ranges_per_request", 1 << 21, "an integer in 1..1048576"),
    ("tcp.max_connections", 0, ">= 1"),
    ("tcp.server_threads", 0, ">= 1"),
    ("tcp.read_timeout_s", 0, "a positive number of seconds"),
    ("tcp.idle_timeout_s", -1, "a positive number of seconds"),
    ("cma.grant_timeout_s", "soon", "a number"),
    ("cma.grant_max_connections", 0, ">= 1"),
])
def test_server_keys_are_validated_naming_the_key(key: str, value: object, words: str) -> None:
    from atom_kv.config import ConfigError

    with pytest.raises(ConfigError) as err:
        section, name = key.split(".")
        KVTransferConfig.from_dict({"kv_role": "kv_producer", section: {name: value}})
    assert f"`{key}`" in str(err.value) and words in str(err.value) and "\n" not in str(err.value)


def _serve_with_few_fds(conn: Any) -> None:
    """A read server in a process allowed only 96 file descriptors."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (96, hard))
    be = TcpBackend(_cfg(tcp={"max_connections": 10_000, "max_unauthenticated_per_source": 10_000}), key="few-fds")
    buf = np.full(SIZE, 7, dtype=np.uint8)
    be.register_memory(buf.ctypes.data, SIZE, align=BLOCK)
    conn.send(be.export_descriptor())
    conn.recv()  # until told to stop
    conn.send(be.stats())
    be.close()


def test_out_of_file_descriptors_pauses_accepting_without_spinning() -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_with_few_fds, args=(child,), name="few-fds", daemon=True)
    proc.start()
    socks: list[socket.socket] = []
    try:
        assert parent.poll(60), "serving process did not start"
        descriptor = parent.recv()
        desc = wire.decode(descriptor, wire.TcpDescriptor)
        socks = [socket.create_connection((desc.host, desc.port), timeout=5) for _ in range(120)]
        time.sleep(1.5)  # the server runs out of descriptors: it must pause, not retry in a loop
        _close_all(socks)
        socks = []
        with TcpBackend(_cfg(), key="reader") as reader:  # it recovers once descriptors are free
            dst = np.zeros(SIZE, dtype=np.uint8)
            reader.register_memory(dst.ctypes.data, SIZE, align=BLOCK)
            peer = reader.add_peer(descriptor)
            h = reader.read(peer, [ReadOp(0, 0, 0, 0, SIZE)], timeout_s=5)
            assert h.wait(10) and h.error is None, h.error
            assert (dst == 7).all()
        parent.send("stop")
        assert parent.poll(10)
        failed_accepts = parent.recv()["accept"]
        # one failed accept per pause (0.5 s); a server retrying at once counts thousands
        assert 1 <= failed_accepts <= 20, f"{failed_accepts} failed accepts in about 2 s"
    finally:
        _close_all(socks)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _stranger(srv: Served, source: str = "127.0.0.2") -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(5)
    s.connect((srv.host, srv.port))
    return s


def test_strangers_on_one_host_cannot_hold_every_slot(make_served) -> None:
    """Today's reproduction: idle connections that never authenticate held every
    tcp.max_connections slot until the read timeout."""
    srv = make_served(auth_token="tok", tcp={"max_connections": 20, "max_unauthenticated_per_source": 8,
                                           "read_timeout_s": 60, "hello_timeout_s": 60})
    socks = [_stranger(srv) for _ in range(40)]
    try:
        wait_until(lambda: srv.stats().get("busy_source", 0) == 32, 10, interval=0.02, what="32 strangers refused")
        assert srv.backend.server.connections == 8
        srv.read_check(auth_token="tok")  # a reader from another address still gets in
    finally:
        _close_all(socks)


def test_a_silent_connection_is_dropped_after_the_hello_timeout(make_served) -> None:
    srv = make_served(auth_token="tok", tcp={"read_timeout_s": 60, "hello_timeout_s": 0.3})
    s = _stranger(srv)
    with s:
        t0 = time.monotonic()
        assert closed_by_peer(s, 5), "a connection that never sent its hello was kept"
        assert time.monotonic() - t0 < 3
    assert srv.stats()["timeout"] == 1


def test_invalid_utf8_in_a_hello_proof_is_counted_as_decode_not_internal(make_served) -> None:
    """The issue: a tcp hello whose proof is not UTF-8 was counted as ``internal`` (our own bugs' label).

    msgspec before 0.23 raises ``UnicodeDecodeError`` for it, 0.23 its own ``DecodeError``: both
    must be a refusal counted as ``decode``. Only our own words are asserted, never msgspec's."""
    srv = make_served(auth_token="tok")
    for _ in range(5):
        s, greeting = tcp_open(srv.host, srv.port)
        with s:
            hello = wire.encode(wire.TcpHello(key="k", nonce="n" * 32, proof="p" * 8))
            s.sendall(frame(hello.replace(b"p" * 8, b"\xff\xfe\xc3\x28\xa0\xa1\xf0\x28")))
            reply = wire.decode(recv_frame(s), wire.TcpHelloReply)
            assert not reply.ok and reply.error.startswith("tcp: bad hello: bad TcpHello message (")
    stats = srv.stats()
    assert stats.get("decode") == 5 and "internal" not in stats, stats
    srv.read_check(auth_token="tok")
