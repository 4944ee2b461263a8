"""The handshake carries each side's memory kinds: a pair whose backend
cannot move one side's memory is refused, in one line, on both sides."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from atom_kv import wire
from atom_kv.connector.handshake import request_handshake
from atom_kv.transfer.memory import kinds_of, pair_refusal
from tests.conftest import free_port
from tests.connector.engines import run_until
from tests.connector.inproc import consumer_engine, producer_engine
from tests.connector.kvutil import compat

HOST_ONLY = frozenset({"host"})
BOTH = frozenset({"host", "gpu"})


@pytest.mark.parametrize(
    "kinds, peer, refused",
    [
        (HOST_ONLY, ["host"], False),
        (HOST_ONLY, [], False),  # a peer from before the field: host memory
        (HOST_ONLY, ["gpu:0"], True),
        (HOST_ONLY, ["host", "gpu:1"], True),
        (BOTH, ["gpu:3"], False),
        (BOTH, ["host", "gpu:0"], False),
        (frozenset({"gpu"}), ["host"], True),
        (frozenset({"gpu"}), [], True),
        (BOTH, ["tpu:0"], True),  # an unknown label is named, never accepted
    ],
)
def test_pair_refusal_table(kinds, peer, refused):
    why = pair_refusal("be", kinds, peer, "decode engine")
    assert (why is not None) == refused
    if why:
        assert "\n" not in why and "'be'" in why and "decode engine" in why and "use backend 'auto'" in why


def test_labels_to_kinds():
    assert kinds_of([]) == {"host"}
    assert kinds_of(["gpu:0", "gpu:1"]) == {"gpu"}


def test_older_peer_without_the_field_decodes_as_host():
    req = wire.HandshakeRequest(engine_id="d", tp_rank=0, tp_size=1, compat=compat(), backend="cma")
    old = msgspec.msgpack.encode({k: v for k, v in msgspec.structs.asdict(req).items() if k != "memory"} | {"t": "hs"})
    assert wire.decode(old, wire.HandshakeRequest).memory == []
    new = wire.decode(wire.encode(msgspec.structs.replace(req, memory=["gpu:2"])), wire.HandshakeRequest)
    assert new.memory == ["gpu:2"]


def test_producer_refuses_a_decode_engine_whose_memory_its_backend_cannot_read():
    port = free_port()
    P, pw, _ = producer_engine(port, backend="cma")
    ctx = zmq.Context()
    try:
        req = wire.HandshakeRequest(engine_id="d", tp_rank=0, tp_size=1, compat=compat(), backend="cma",
                                    memory=["gpu:0"])
        reply = request_handshake(ctx, "127.0.0.1", port, req, 5.0)
        assert not reply.ok and reply.memory == ["host"]
        assert reply.error.startswith("memory kind mismatch: the decode engine's KV cache is in gpu:0 memory")
        assert "'cma'" in reply.error and "\n" not in reply.error
        ok = request_handshake(ctx, "127.0.0.1", port, msgspec.structs.replace(req, memory=["host"]), 5.0)
        assert ok.ok and ok.memory == ["host"] and ok.descriptor
    finally:
        ctx.destroy(0)
        pw.close()


def test_consumer_refuses_a_prefill_engine_whose_memory_its_backend_cannot_read():
    port = free_port()
    P, pw, _ = producer_engine(port, backend="cma")
    pw._kv.memory = ["gpu:0"]  # stand-in: the producer reports a KV cache in GPU memory
    D, dw, _ = consumer_engine(port, backend="cma")
    try:
        params = P.prefill("r1", 20)
        D.admit("d1", 20, params)
        run_until([P, D], lambda: "d1" in D.failed)
        assert "memory kind mismatch: the prefill engine's KV cache is in gpu:0 memory" in D.failed["d1"]
        assert dw.stats()["retries"] == 0  # a refusal is not retried
    finally:
        pw.close()
        dw.close()
