"""Fuzzing the engine's binary ports: a producer rank's handshake port (ZeroMQ), the tcp data path's
read server and the cma/gpu_ipc grant endpoint, all with an auth token, and the rendezvous (blocks
queries on a handshake port without a token, where anyone may ask), in this process.

Random bytes, and well-formed frames of every message kind carrying random field values
(hypothesis). Asserted: the serving threads stay up and still serve a real peer, memory stays
bounded, nothing is logged with a traceback, and no message hit an unexpected error (every
failure went through the counted, rate-limited refusal path). Bounded in time."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import socket

import msgpack
import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom_kv import wire
from atom_kv.auth import PURPOSE_DONE, PURPOSE_RELEASE, sign_struct
from atom_kv.config import KVTransferConfig
from atom_kv.connector.handshake import request_handshake
from atom_kv.connector.handshake_auth import peer_proof
from atom_kv.testing.procfs import rss_bytes
from atom_kv.transfer import ReadOp
from atom_kv.transfer._grant import GrantServer, request_grant
from atom_kv.transfer._sockio import frame, recv_frame
from atom_kv.transfer.tcp import TcpBackend
from tests.conftest import free_port
from tests.connector.inproc import producer_engine
from tests.connector.kvutil import compat

TOKEN = "fuzz-token-5f0c2a9d7b1e4c38"
FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


def _rss_settled() -> int:
    """This process's RSS once garbage is collected and freed heap handed back (``malloc_trim``): what
    glibc keeps after a burst is no leak, and there is more of it the busier the machine (threads that
    contend for the heap get arenas of their own, and the fuzzed messages queue deeper in ZeroMQ, in
    this process, while the server catches up). The bounds below are about what stays held."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
        if trim is not None:
            trim(0)
    return rss_bytes()


def _fields_of(*structs) -> list[str]:
    return sorted({name for s in structs for name in s.__struct_fields__})


_HS_TAGS = ["hs", "hs_proof", "proof_req", "done", "release", "issued", "blocks_q", "hs_ok", "bogus"]
_HS_FIELDS = _fields_of(wire.HandshakeRequest, wire.HandshakeProof, wire.DoneReading, wire.Release, wire.Issued,
                        wire.BlocksQuery, wire.CompatInfo)


class _Traces(logging.Handler):
    """Every record logged with a traceback, from any thread."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.levelno >= logging.INFO:
            self.records.append(record)


@pytest.fixture(scope="module")
def traces():
    handler = _Traces()
    root = logging.getLogger()
    root.addHandler(handler)
    yield handler
    root.removeHandler(handler)


class _HandshakeTarget:
    def __init__(self) -> None:
        self.port = free_port()
        self.engine, self.worker, _ = producer_engine(self.port, auth_token=TOKEN)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.connect(f"tcp://127.0.0.1:{self.port}")
        self.rss_start = _rss_settled()

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
        self.worker.close()


@pytest.fixture(scope="module")
def handshake(traces):
    t = _HandshakeTarget()
    yield t
    t.close()


@FUZZ
@given(frames=st.lists(st.binary(max_size=600), min_size=1, max_size=3))
def test_random_frames_on_the_handshake_port(handshake, frames):
    handshake.sock.send_multipart(frames)


@FUZZ
@given(tag=st.sampled_from(_HS_TAGS),
       fields=st.dictionaries(st.sampled_from(_HS_FIELDS), _value, max_size=10),
       mac=st.text(max_size=70))
def test_every_message_kind_with_random_fields_on_the_handshake_port(handshake, tag, fields, mac):
    message = {"t": tag, "v": 2, **fields}
    handshake.sock.send(msgpack.packb(message))
    # well-formed notices and a proof with a random MAC: exercise the checks behind the decoder
    for purpose, msg in ((PURPOSE_DONE, wire.DoneReading(transfer_id="x", engine_id="e", tp_rank=0, tp_size=1)),
                         (PURPOSE_RELEASE, wire.Release(transfer_id="x"))):
        forged = msgspec.structs.replace(sign_struct("not-the-token", purpose, msg), mac=mac)
        handshake.sock.send(wire.encode(forged))
    handshake.sock.send(wire.encode(wire.HandshakeProof(nonce="n" * 32, proof=mac, request=mac.encode())))


def test_zz_the_handshake_port_survived(handshake, traces):
    server = handshake.worker.handshake_server
    # the server answers one peer's messages in order: once it answers this, it has handled every fuzzed one
    handshake.sock.send(wire.encode(wire.PeerProofRequest(nonce="sentinel-nonce-0123456789")))
    while True:
        assert handshake.sock.poll(20_000), "the handshake port stopped answering"
        answer = handshake.sock.recv_multipart()[-1]
        try:
            proof = wire.decode(answer, wire.PeerProof)
            if proof.proof == peer_proof(TOKEN, "sentinel-nonce-0123456789", proof.engine_id, proof.tp_rank):
                break
        except wire.WireError:
            continue
    assert server._thread.is_alive()
    reply = request_handshake(handshake.ctx, "127.0.0.1", handshake.port,
                              wire.HandshakeRequest(engine_id="D", tp_rank=0, tp_size=1, compat=compat(),
                                                    backend="tcp"), 10.0, auth_token=TOKEN)
    assert reply.ok, reply.error
    refusals = server.refusals()
    assert "internal" not in refusals, refusals
    assert sum(refusals.values()) > 0
    grew = _rss_settled() - handshake.rss_start
    assert grew < 64 << 20, f"RSS grew by {grew >> 20} MiB"
    assert traces.records == [], [r.getMessage() for r in traces.records][:5]


# ---------------------------------------------------------------------------- tcp data path
SIZE = 64 * 1024


class _TcpTarget:
    def __init__(self) -> None:
        cfg = KVTransferConfig(kv_role="kv_producer", transfer_timeout_s=5, handshake_timeout_s=5, auth_token=TOKEN,
                               tcp={"hello_timeout_s": 1.0})
        self.backend = TcpBackend(cfg, key="fuzzed")
        self.buf = np.arange(SIZE, dtype=np.uint8)
        self.backend.register_memory(self.buf.ctypes.data, SIZE, align=4096)
        self.descriptor = self.backend.export_descriptor()
        desc = wire.decode(self.descriptor, wire.TcpDescriptor)
        self.addr = (desc.host, desc.port)
        self.rss_start = _rss_settled()

    def exchange(self, payloads: list[bytes]) -> None:
        with socket.create_connection(self.addr, timeout=5) as s:
            try:
                recv_frame(s)  # the server's hello
                for payload in payloads:
                    s.sendall(frame(payload))
                s.shutdown(socket.SHUT_WR)
                s.settimeout(3)
                while s.recv(65536):
                    pass
            except (ConnectionError, TimeoutError, OSError, ValueError):
                pass


@pytest.fixture(scope="module")
def tcp(traces):
    t = _TcpTarget()
    yield t
    t.backend.close()


_TCP_FIELDS = _fields_of(wire.TcpHello, wire.ReadRequest)


@FUZZ
@given(data=st.binary(max_size=600))
def test_random_bytes_on_the_tcp_port(tcp, data):
    with socket.create_connection(tcp.addr, timeout=5) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(3)
            while s.recv(65536):
                pass
        except (ConnectionError, TimeoutError, OSError):
            pass


@FUZZ
@given(hello=st.fixed_dictionaries({"t": st.sampled_from(["tcp_hello", "rd", "x"]), "v": st.integers(0, 3)},
                                   optional={"key": _value, "nonce": _value, "proof": _value}),
       proof=st.text(max_size=70),
       extra=st.dictionaries(st.sampled_from(_TCP_FIELDS), _value, max_size=4),
       then=st.lists(st.binary(max_size=200), max_size=2))
def test_hellos_with_random_fields_on_the_tcp_port(tcp, hello, proof, extra, then):
    tcp.exchange([msgpack.packb({**extra, **hello}), *then])
    tcp.exchange([wire.encode(wire.TcpHello(key="k", nonce="n" * 32, proof=proof)), *then])


def test_zz_the_tcp_port_survived(tcp, traces):
    with TcpBackend(KVTransferConfig(kv_role="kv_consumer", transfer_timeout_s=5, handshake_timeout_s=5,
                                     auth_token=TOKEN), key="reader") as reader:
        dst = np.zeros(SIZE, dtype=np.uint8)
        reader.register_memory(dst.ctypes.data, SIZE, align=4096)
        peer = reader.add_peer(tcp.descriptor)
        h = reader.read(peer, [ReadOp(0, 0, 0, 4096, 8192)], timeout_s=5)
        assert h.wait(10) and h.error is None, h.error
        assert np.array_equal(dst[:8192], tcp.buf[4096:12288])
    stats = tcp.backend.stats()
    assert stats.get("internal", 0) == 0, stats
    grew = _rss_settled() - tcp.rss_start
    assert grew < 64 << 20, f"RSS grew by {grew >> 20} MiB"
    assert traces.records == [], [r.getMessage() for r in traces.records][:5]


# ---------------------------------------------------------------------------- the rendezvous (no token)
class _RendezvousTarget(_HandshakeTarget):
    """A producer rank without a token: anyone may ask it for a transfer's blocks."""

    def __init__(self) -> None:
        self.port = free_port()
        self.engine, self.worker, _ = producer_engine(self.port, prefill_wait_timeout_s=0.5)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.connect(f"tcp://127.0.0.1:{self.port}")
        self.rss_start = _rss_settled()


@pytest.fixture(scope="module")
def rendezvous(traces):
    t = _RendezvousTarget()
    yield t
    t.close()


_BQ_FIELDS = _fields_of(wire.BlocksQuery)


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(_BQ_FIELDS), _value, max_size=8),
       tid=st.text(max_size=140), rank=st.integers(-5, 5000), size=st.integers(-5, 5000),
       wait_ms=st.integers(-5, wire.MAX_BLOCKS_WAIT_MS + 5))
def test_blocks_queries_with_random_fields_on_the_rendezvous(rendezvous, fields, tid, rank, size, wait_ms):
    rendezvous.sock.send(msgpack.packb({"t": "blocks_q", "v": 2, **fields}))
    well_formed = {"t": "blocks_q", "v": 2, "transfer_id": tid, "engine_id": "fuzz", "tp_rank": rank,
                   "tp_size": size, "wait_ms": wait_ms}
    rendezvous.sock.send(msgpack.packb(well_formed))


def test_zz_the_rendezvous_survived(rendezvous, traces):
    server = rendezvous.worker.handshake_server
    rendezvous.sock.send(wire.encode(wire.BlocksQuery(transfer_id="sentinel", engine_id="D", tp_rank=0, tp_size=1)))
    while True:
        assert rendezvous.sock.poll(30_000), "the rendezvous stopped answering"
        try:
            answer = wire.decode(rendezvous.sock.recv_multipart()[-1], wire.BlocksAnswer)
        except wire.WireError:
            continue
        if answer.transfer_id == "sentinel":
            assert not answer.found
            break
    assert server._thread.is_alive()
    assert "internal" not in server.refusals(), server.refusals()
    grew = _rss_settled() - rendezvous.rss_start
    assert grew < 64 << 20, f"RSS grew by {grew >> 20} MiB"
    assert traces.records == [], [r.getMessage() for r in traces.records][:5]


# ---------------------------------------------------------------------------- grant endpoints (cma, gpu_ipc)
class _GrantTarget:
    def __init__(self) -> None:
        self.server = GrantServer(bind_host="127.0.0.1", host="127.0.0.1", auth_token=TOKEN, timeout_s=1.0,
                                       max_connections=64, spans=lambda: [(0, 4096, 4096)], label="fuzzed grants")
        self.addr = ("127.0.0.1", self.server.port)
        self.rss_start = _rss_settled()

    def exchange(self, payloads: list[bytes]) -> None:
        with socket.create_connection(self.addr, timeout=5) as s:
            try:
                recv_frame(s)  # the endpoint's challenge
                for payload in payloads:
                    s.sendall(frame(payload))
                s.shutdown(socket.SHUT_WR)
                s.settimeout(3)
                while s.recv(65536):
                    pass
            except (ConnectionError, TimeoutError, OSError, ValueError):
                pass


@pytest.fixture(scope="module")
def grants(traces):
    t = _GrantTarget()
    yield t
    t.server.close()


_GRANT_FIELDS = _fields_of(wire.CmaGrantRequest)


@FUZZ
@given(data=st.binary(max_size=600))
def test_random_bytes_on_the_grant_endpoint(grants, data):
    grants.exchange([data])


@FUZZ
@given(request=st.fixed_dictionaries({"t": st.sampled_from(["cma_grant", "tcp_hello", "x"]), "v": st.integers(0, 3)},
                                     optional={"pid": _value, "key": _value, "nonce": _value, "proof": _value}),
       extra=st.dictionaries(st.sampled_from(_GRANT_FIELDS), _value, max_size=4),
       proof=st.text(max_size=70), pid=st.integers(-(2**63), 2**63 - 1))
def test_grant_requests_with_random_fields_on_the_grant_endpoint(grants, request, extra, proof, pid):
    grants.exchange([msgpack.packb({**extra, **request})])
    grants.exchange([wire.encode(wire.CmaGrantRequest(pid=pid, key="k", nonce="n" * 32, proof=proof))])


def test_zz_the_grant_endpoint_survived(grants, traces):
    desc = wire.CmaDescriptor(pid=os.getpid(), host_id="h", ctl_host=grants.addr[0], ctl_port=grants.addr[1])
    reply = request_grant(desc, "reader", TOKEN, 5.0)
    assert reply.ok and reply.regions, reply.error
    stats = grants.server.stats()
    assert stats.get("internal", 0) == 0 and stats.get("decode", 0) + stats.get("auth", 0) > 0, stats
    grew = _rss_settled() - grants.rss_start
    assert grew < 64 << 20, f"RSS grew by {grew >> 20} MiB"
    assert traces.records == [], [r.getMessage() for r in traces.records][:5]
