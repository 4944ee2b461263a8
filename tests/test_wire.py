"""Wire messages: ATOM-compatible layout, versions, and garbage handling."""

from __future__ import annotations

import os

import msgpack
import pytest

from atom_kv import wire
from atom_kv.wire import (
    CompatInfo,
    DoneReading,
    HandshakeReply,
    HandshakeRequest,
    HelloPing,
    ReadRange,
    ReadReply,
    ReadRequest,
    RegisterPing,
    WireError,
)


def test_registration_ping_has_atoms_keys():
    ping = RegisterPing(
        role="P", index="0", request_address="http://127.0.0.1:8000/v1/completions", handshake_port=6301, tp_size=2
    )
    raw = msgpack.unpackb(wire.encode(ping))
    for key, value in {
        "type": "register",
        "role": "P",
        "index": "0",
        "request_address": "http://127.0.0.1:8000/v1/completions",
        "handshake_port": 6301,
        "dp_size": 1,
        "tp_size": 2,
        "transfer_mode": "read",
        "v": wire.PROTOCOL_VERSION,
    }.items():
        assert raw[key] == value


def test_atom_ping_from_plain_msgpack_decodes_with_extra_keys():
    raw = msgpack.packb(
        {
            "type": "register",
            "role": "D",
            "index": "3",
            "request_address": "http://10.1.1.1:9000/v1/completions",
            "handshake_port": 7000,
            "dp_size": 2,
            "tp_size": 8,
            "transfer_mode": "read",
            "something_new": [1, 2],
        }
    )
    msg = wire.decode_registration(raw)
    assert isinstance(msg, RegisterPing)
    assert (msg.role, msg.dp_size, msg.tp_size) == ("D", 2, 8)


def test_hello_is_its_own_type():
    assert isinstance(wire.decode_registration(msgpack.packb({"type": "HELLO"})), HelloPing)


def test_handshake_family_round_trip():
    compat = CompatInfo(model_id="m", dtype="float16", num_layers=2, num_kv_heads=4, head_dim=16, block_size=16)
    req = HandshakeRequest(engine_id="e", tp_rank=1, tp_size=2, compat=compat, backend="tcp", auth_token="t")
    done = DoneReading(transfer_id="x", engine_id="e", tp_rank=0, tp_size=1)
    assert wire.decode_handshake_msg(wire.encode(req)) == req
    assert wire.decode_handshake_msg(wire.encode(done)) == done
    reply = HandshakeReply(ok=True, compat=compat, descriptor=b"\x00\x01")
    assert wire.decode_handshake_reply(wire.encode(reply)) == reply


def test_read_family_round_trip():
    req = ReadRequest(req_id=7, ranges=[ReadRange(0, 4096, 8192)])
    assert wire.decode_read_request(wire.encode(req)) == req
    rep = ReadReply(req_id=7, ok=False, error="out of range")
    assert wire.decode_read_reply(wire.encode(rep)) == rep


@pytest.mark.parametrize(
    "decode",
    [
        wire.decode_registration,
        wire.decode_handshake_msg,
        wire.decode_handshake_reply,
        wire.decode_read_request,
        wire.decode_read_reply,
        wire.decode_tcp_hello_reply,
        wire.decode_tcp_descriptor,
        wire.decode_cma_descriptor,
        wire.decode_cma_grant_request,
        wire.decode_cma_grant_reply,
        wire.decode_auto_descriptor,
        wire.decode_moriio_descriptor,
    ],
)
@pytest.mark.parametrize(
    "junk",
    [
        b"",
        b"\xc1",
        os.urandom(64),
        msgpack.packb({"type": "register", "role": "X"}),
        msgpack.packb({"t": "hs", "engine_id": 5}),
        msgpack.packb([1, 2, 3]),
    ],
)
def test_garbage_raises_only_wire_error(decode, junk):
    with pytest.raises(WireError):
        decode(junk)


def test_tcp_hello_garbage_raises_only_wire_error():
    # every TcpHello field has a default, so an untagged map reads as an empty
    # hello (which the server then judges on its missing auth_token); anything
    # else, and any other tag, is a WireError
    for junk in (b"", b"\xc1", msgpack.packb([1, 2, 3]), msgpack.packb({"t": "hs"}), msgpack.packb({"key": 5})):
        with pytest.raises(WireError):
            wire.decode_tcp_hello(junk)


def test_wrong_family_is_rejected():
    done = wire.encode(DoneReading(transfer_id="x", engine_id="e", tp_rank=0, tp_size=1))
    with pytest.raises(WireError):
        wire.decode_registration(done)


def test_every_message_carries_a_version():
    import msgspec

    tagged = [
        obj for name in wire.__all__
        if isinstance(obj := getattr(wire, name), type) and issubclass(obj, msgspec.Struct)
        and obj.__struct_config__.tag is not None
    ]
    assert len(tagged) >= 15
    for cls in tagged:
        if cls is HelloPing:  # ATOM's empty hello: ignored on receipt, never versioned by ATOM
            continue
        assert "v" in cls.__struct_fields__, cls.__name__


def test_done_ack_round_trip_and_want_ack_default():
    ack = wire.DoneAck(transfer_id="P-1", tp_rank=1, valid=False, reason="released")
    assert wire.decode_done_ack(wire.encode(ack)) == ack
    ok = wire.DoneAck(transfer_id="P-2", tp_rank=0, valid=True)
    back = wire.decode_done_ack(wire.encode(ok))
    assert back.valid and back.reason == "" and back.v == wire.PROTOCOL_VERSION
    # an old peer's DoneReading (no want_ack key) decodes with want_ack=False
    old = msgpack.packb({"t": "done", "transfer_id": "x", "engine_id": "e", "tp_rank": 0, "tp_size": 1})
    assert wire.decode_handshake_msg(old).want_ack is False
    asking = DoneReading(transfer_id="x", engine_id="e", tp_rank=0, tp_size=1, want_ack=True)
    assert wire.decode_handshake_msg(wire.encode(asking)).want_ack is True


@pytest.mark.parametrize(
    "junk",
    [
        b"",
        b"\xc1",
        os.urandom(64),
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"t": "done_ack", "transfer_id": "x", "tp_rank": 0}),  # no verdict
        msgpack.packb({"t": "done_ack", "transfer_id": "x", "tp_rank": "0", "valid": True}),
        msgpack.packb({"t": "done", "transfer_id": "x", "engine_id": "e", "tp_rank": 0, "tp_size": 1}),
    ],
)
def test_done_ack_garbage_raises_only_wire_error(junk):
    with pytest.raises(WireError):
        wire.decode_done_ack(junk)
