"""Wire messages: ATOM-compatible layout, versions, and garbage handling."""

from __future__ import annotations

import os
import random

import msgpack
import msgspec
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

#: random bytes, the same in every collection (parameters must be: pytest-xdist compares them)
_RANDOM_JUNK = random.Random(20261127).randbytes(64)


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
    msg = wire.decode(raw, wire.RegistrationMessage)
    assert isinstance(msg, RegisterPing)
    assert (msg.role, msg.dp_size, msg.tp_size) == ("D", 2, 8)


def test_hello_is_its_own_type():
    assert isinstance(wire.decode(msgpack.packb({"type": "HELLO"}), wire.RegistrationMessage), HelloPing)


def test_handshake_family_round_trip():
    compat = CompatInfo(model_id="m", dtype="float16", num_layers=2, num_kv_heads=4, head_dim=16, block_size=16)
    req = HandshakeRequest(engine_id="e", tp_rank=1, tp_size=2, compat=compat, backend="tcp", nonce="n" * 32)
    done = DoneReading(transfer_id="x", engine_id="e", tp_rank=0, tp_size=1, block_offset=2, num_blocks=3,
                       blocks_digest=wire.blocks_digest([4, 5, 6]), ts=1.0, nonce="m" * 32, mac="a" * 64)
    release = wire.Release(transfer_id="x", reason="client_gone", sender="proxy", ts=1.0, nonce="m" * 32)
    proof = wire.HandshakeProof(nonce="p" * 32, proof="b" * 64)
    for msg in (req, done, release, proof, wire.PeerProofRequest(nonce="q" * 32)):
        assert wire.decode(wire.encode(msg), wire.HandshakeMessage) == msg
    reply = HandshakeReply(ok=True, compat=compat, descriptor=b"\x00\x01")
    assert wire.decode(wire.encode(reply), wire.HandshakeReply) == reply
    challenge = wire.HandshakeChallenge(engine_id="P", tp_rank=0, nonce="p" * 32, proof="c" * 64)
    sealed = wire.SealedHandshakeReply(reply=wire.encode(reply), mac="d" * 64)
    for msg in (reply, challenge, sealed):
        assert wire.decode(wire.encode(msg), wire.HandshakeReplyMessage) == msg


def test_no_message_has_a_field_for_the_token():
    """Tokens are proven, never sent: no Struct on the wire can carry one (fields about the model's
    tokens, like ``first_token_ids``, are not secrets)."""
    import msgspec

    structs = [obj for name in wire.__all__
               if isinstance(obj := getattr(wire, name), type) and issubclass(obj, msgspec.Struct)]
    assert len(structs) >= 25
    def secret(field: str) -> bool:
        return field == "token" or field.endswith("_token") or "secret" in field or "password" in field

    carrying = sorted(s.__name__ for s in structs if any(secret(f) for f in s.__struct_fields__))
    assert carrying == [], carrying


def test_handshake_port_messages_carry_their_protocol_version():
    for msg in (DoneReading(transfer_id="x", engine_id="e", tp_rank=0, tp_size=1), wire.Release(transfer_id="x"),
                wire.PeerProofRequest(nonce=""), wire.DoneAck(transfer_id="x", tp_rank=0, valid=True)):
        assert msgpack.unpackb(wire.encode(msg))["v"] == wire.HANDSHAKE_PROTOCOL_VERSION == 2


def test_peek_version_reads_v_from_messages_that_do_not_decode():
    newer = msgpack.packb({"t": "hs", "v": 999, "something": "else"})
    with pytest.raises(WireError):
        wire.decode(newer, wire.HandshakeMessage)
    assert wire.peek_version(newer) == 999
    for junk in (b"", os.urandom(32), msgpack.packb([1, 2]), msgpack.packb({"v": "2"}), msgpack.packb({"v": True})):
        assert wire.peek_version(junk) is None


def test_blocks_digest_depends_on_the_ids_and_their_order():
    assert wire.blocks_digest([1, 2, 3]) == wire.blocks_digest((1, 2, 3))
    assert len({wire.blocks_digest(ids) for ids in ([1, 2, 3], [3, 2, 1], [1, 2], [1, 2, 4], [])}) == 5


def test_read_family_round_trip():
    req = ReadRequest(req_id=7, ranges=[ReadRange(0, 4096, 8192)])
    assert wire.decode(wire.encode(req), wire.ReadRequest) == req
    rep = ReadReply(req_id=7, ok=False, error="out of range")
    assert wire.decode(wire.encode(rep), wire.ReadReply) == rep


@pytest.mark.parametrize(
    "message_type",
    [
        wire.RegistrationMessage,
        wire.HandshakeMessage,
        wire.HandshakeReply,
        wire.ReadRequest,
        wire.ReadReply,
        wire.TcpHelloReply,
        wire.TcpDescriptor,
        wire.CmaDescriptor,
        wire.CmaGrantRequest,
        wire.CmaGrantReply,
        wire.AutoDescriptor,
        wire.MoriIODescriptor,
    ],
)
@pytest.mark.parametrize(
    "junk",
    [
        b"",
        b"\xc1",
        _RANDOM_JUNK,
        msgpack.packb({"type": "register", "role": "X"}),
        msgpack.packb({"t": "hs", "engine_id": 5}),
        msgpack.packb([1, 2, 3]),
    ],
)
def test_garbage_raises_only_wire_error(message_type, junk):
    with pytest.raises(WireError):
        wire.decode(junk, message_type)


def test_tcp_hello_garbage_raises_only_wire_error():
    # every TcpHello field has a default, so an untagged map reads as an empty
    # hello (which the server then judges on its missing auth_token); anything
    # else, and any other tag, is a WireError
    for junk in (b"", b"\xc1", msgpack.packb([1, 2, 3]), msgpack.packb({"t": "hs"}), msgpack.packb({"key": 5})):
        with pytest.raises(WireError):
            wire.decode(junk, wire.TcpHello)


def test_wrong_family_is_rejected():
    done = wire.encode(DoneReading(transfer_id="x", engine_id="e", tp_rank=0, tp_size=1))
    with pytest.raises(WireError):
        wire.decode(done, wire.RegistrationMessage)


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
    assert wire.decode(wire.encode(ack), wire.DoneAck) == ack
    ok = wire.DoneAck(transfer_id="P-2", tp_rank=0, valid=True)
    back = wire.decode(wire.encode(ok), wire.DoneAck)
    assert back.valid and back.reason == "" and back.v == wire.HANDSHAKE_PROTOCOL_VERSION
    # an old peer's DoneReading (no want_ack key) decodes with want_ack=False
    old = msgpack.packb({"t": "done", "transfer_id": "x", "engine_id": "e", "tp_rank": 0, "tp_size": 1})
    assert wire.decode(old, wire.HandshakeMessage).want_ack is False
    asking = DoneReading(transfer_id="x", engine_id="e", tp_rank=0, tp_size=1, want_ack=True)
    assert wire.decode(wire.encode(asking), wire.HandshakeMessage).want_ack is True


@pytest.mark.parametrize(
    "junk",
    [
        b"",
        b"\xc1",
        _RANDOM_JUNK,
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"t": "done_ack", "transfer_id": "x", "tp_rank": 0}),  # no verdict
        msgpack.packb({"t": "done_ack", "transfer_id": "x", "tp_rank": "0", "valid": True}),
        msgpack.packb({"t": "done", "transfer_id": "x", "engine_id": "e", "tp_rank": 0, "tp_size": 1}),
    ],
)
def test_done_ack_garbage_raises_only_wire_error(junk):
    with pytest.raises(WireError):
        wire.decode(junk, wire.DoneAck)


def test_decode_error_names_the_type_and_size():
    with pytest.raises(WireError, match=r"^bad DoneAck message \(1 bytes\): "):
        wire.decode(b"\xc1", wire.DoneAck)
    names = "HandshakeRequest or HandshakeProof or PeerProofRequest or DoneReading or Release or Issued or BlocksQuery"
    with pytest.raises(WireError, match=rf"^bad {names} message \(0 bytes\)"):
        wire.decode(b"", wire.HandshakeMessage)


@pytest.mark.parametrize("type_", [wire.DoneAck, wire.HandshakeMessage, wire.RegistrationMessage])
def test_deeply_nested_garbage_raises_only_wire_error(type_):
    # msgpack arrays nested far deeper than any message: the decoder's recursion limit, not a crash
    with pytest.raises(WireError, match="nested too deeply"):
        wire.decode(b"\x81\xa1z" + b"\x91" * 100_000 + b"\xc0", type_)


# --- kv_transfer_params -----------------------------------------------------------
def _producer_params() -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [4, 5],
            "remote_engine_id": "P", "remote_host": "10.0.0.1", "remote_port": 7000,
            "remote_handshake_port": 7000, "remote_tp_size": 2, "remote_dp_rank": 1, "tp_size": 2,
            "dp_rank": 1, "transfer_id": "P-r1"}


def test_params_round_trip_and_unknown_keys():
    raw = dict(_producer_params(), some_router_key={"a": 1})
    p = wire.KVTransferParams.from_dict(raw)
    assert p.to_dict() == _producer_params()  # unset keys are left out, unknown ones dropped
    assert wire.KVTransferParams.from_dict(None) == wire.KVTransferParams()
    assert p.missing_for_load() is None


def test_params_fall_back_to_atoms_unprefixed_keys():
    p = wire.KVTransferParams.from_dict({"remote_port": 7001, "tp_size": 4, "dp_rank": 2})
    assert (p.producer_handshake_port, p.producer_tp_size, p.producer_dp_rank) == (7001, 4, 2)
    q = wire.KVTransferParams.from_dict({"remote_port": 7001, "remote_handshake_port": 7002, "remote_tp_size": 1,
                                         "tp_size": 4})
    assert (q.producer_handshake_port, q.producer_tp_size, q.producer_dp_rank) == (7002, 1, 0)


def test_params_missing_for_load_names_the_first_missing_key():
    order = ["remote_block_ids", "remote_engine_id", "remote_host", "transfer_id", "remote_handshake_port"]
    for i, key in enumerate(order):
        raw = {k: v for k, v in _producer_params().items() if k not in order[i:] and k != "remote_port"}
        assert wire.KVTransferParams.from_dict(raw).missing_for_load() == key


@pytest.mark.parametrize(
    "raw,key",
    [
        ({"remote_port": 70000}, "remote_port"),
        ({"remote_block_ids": "1,2"}, "remote_block_ids"),
        ({"remote_tp_size": 0}, "remote_tp_size"),
        ({"do_remote_decode": "yes"}, "do_remote_decode"),
        ({"dp_rank": -1}, "dp_rank"),
        ([1, 2], "kv_transfer_params"),
    ],
)
def test_bad_params_name_the_key(raw, key):
    from atom_kv.config import FieldError

    with pytest.raises(FieldError) as info:
        wire.KVTransferParams.from_dict(raw)
    assert info.value.key == key and f"`{key}`" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "change,key,allowed",
    [
        ({"remote_tp_size": 2_000_000}, "remote_tp_size", "an integer in 1..1024"),
        ({"tp_size": 1025}, "tp_size", "an integer in 1..1024"),
        ({"remote_pp_size": 1025}, "remote_pp_size", "an integer in 1..1024"),
        ({"remote_dp_size": 1025}, "remote_dp_size", "an integer in 1..1024"),
        ({"remote_dp_rank": 1024}, "remote_dp_rank", "an integer in 0..1023"),
        ({"dp_rank": 10**12}, "dp_rank", "an integer in 0..1023"),
        ({"remote_handshake_port": 0}, "remote_handshake_port", "a TCP port in 1..65535"),
        ({"remote_port": 65536}, "remote_port", "a TCP port in 1..65535"),
        ({"remote_block_ids": [0] * ((1 << 20) + 1)}, "remote_block_ids", "a list of 1..1048576 block"),
        ({"remote_block_ids": [1 << 32]}, "remote_block_ids", "each in 0..4294967295"),
        ({"remote_block_ids": []}, "remote_block_ids", "a list of 1..1048576 block"),
        ({"remote_host": "h" * 256}, "remote_host", "a host name or address of 1..255 characters"),
        ({"remote_engine_id": "e" * 257}, "remote_engine_id", "1..256 characters"),
        ({"transfer_id": "t" * 129}, "transfer_id", "1..128 characters"),
        # sizes each in range whose ranks do not fit: the product, and the last rank's port
        ({"remote_tp_size": 64, "remote_pp_size": 32}, "remote_pp_size", "at most 1024"),
        ({"remote_handshake_port": 65535}, "remote_handshake_port", "past 65535"),
        ({"remote_handshake_port": None, "remote_port": 65000, "remote_tp_size": 512}, "remote_port", "past 65535"),
        ({"remote_handshake_port": 64000, "remote_tp_size": 4, "remote_pp_size": 2, "remote_dp_size": 512,
          "remote_dp_rank": 0}, "remote_handshake_port", "port 66051"),
    ],
)
def test_every_key_of_params_is_bounded_where_it_is_decoded(change, key, allowed):
    """A client of a decode engine's HTTP port writes these: each key is bounded by what a producer can
    have (MAX_PRODUCER_RANKS ranks, ports in 1..65535, MAX_PARAMS_BLOCKS blocks), in one line naming it."""
    params, errors = wire.KVTransferParams.parse({**_producer_params(), **change})
    (error,) = errors
    text = str(error)
    assert error.key == key and text.startswith(f"`{key}` ") and " must " in text and allowed in text, text
    assert "\n" not in text and len(text) <= 300  # a million block numbers are shown by their start
    assert getattr(params, key) is None  # refused: never used, for the load or for a release
    assert params.remote_host == _producer_params()["remote_host"] or key == "remote_host"  # the rest stands


def test_params_at_their_bounds_are_accepted():
    edge = {**_producer_params(), "remote_tp_size": 512, "tp_size": 512, "remote_pp_size": 2, "remote_dp_size": 1,
            "remote_dp_rank": 0, "dp_rank": 0, "remote_handshake_port": 65535 - 1023,
            "remote_block_ids": list(range(1000)), "remote_host": "h" * 255, "remote_engine_id": "e" * 256,
            "transfer_id": "t" * 128}
    assert wire.KVTransferParams.parse(edge)[1] == []
    assert wire.KVTransferParams.parse({**edge, "remote_handshake_port": 65535 - 1022})[1][0].key == \
        "remote_handshake_port"


def test_adoptable_transfer_ids():
    assert wire.adoptable_transfer_id("cmpl-1f2e 3d") == "cmpl-1f2e 3d"
    assert wire.adoptable_transfer_id("x" * wire.MAX_TRANSFER_ID_CHARS) is not None
    for bad in ("x" * (wire.MAX_TRANSFER_ID_CHARS + 1), "", "line\n", "tab\t", "naïve", 7, None, b"id"):
        assert wire.adoptable_transfer_id(bad) is None, bad


def test_fields_a_stranger_sends_are_bounded_while_decoding():
    from atom_kv.proxy.fleet.discovery import decode_discovery

    ping = {"type": "register", "role": "D", "index": "0", "request_address": "http://h:1/v1/completions",
            "handshake_port": 1}
    decode_discovery(msgpack.packb(ping))
    for key, value in (("index", "i" * 300), ("request_address", "http://h:1/" + "x" * 2000),
                       ("engine_id", "e" * 300), ("model", "m" * 300)):
        with pytest.raises(wire.WireError):
            decode_discovery(msgpack.packb({**ping, key: value}))
    moriio = {"type": "D", "http_address": "h:1" + "0" * 2000, "zmq_address": "handshake:1"}
    with pytest.raises(wire.WireError):
        decode_discovery(msgpack.packb(moriio))
    req = wire.HandshakeRequest(engine_id="x", tp_rank=0, tp_size=1, backend="tcp",
                                compat=wire.CompatInfo(model_id="m", dtype="f", num_layers=1, num_kv_heads=1,
                                                       head_dim=1, block_size=1))
    wire.decode(wire.encode(req), wire.HandshakeMessage)
    for change in (dict(engine_id="e" * 300), dict(host="h" * 300), dict(backend="b" * 300), dict(tp_rank=-1),
                   dict(tp_size=1 << 40)):
        with pytest.raises(wire.WireError):
            wire.decode(wire.encode(msgspec.structs.replace(req, **change)), wire.HandshakeMessage)
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode(wire.Release(transfer_id="t" * 200)), wire.HandshakeMessage)


def test_blocks_query_and_answer_round_trip_and_are_bounded():
    query = wire.BlocksQuery(transfer_id="t", engine_id="D", tp_rank=1, tp_size=2, wait_ms=500, ts=1.0,
                             nonce="n" * 32, mac="a" * 64)
    assert wire.decode(wire.encode(query), wire.HandshakeMessage) == query
    answer = wire.BlocksAnswer(transfer_id="t", tp_rank=0, found=True, block_ids=[3, 4, 9])
    assert wire.decode(wire.encode(answer), wire.BlocksAnswer) == answer
    for change in (dict(transfer_id="t" * 200), dict(wait_ms=wire.MAX_BLOCKS_WAIT_MS + 1), dict(wait_ms=-1),
                   dict(engine_id="e" * 300), dict(tp_rank=-1)):
        with pytest.raises(wire.WireError):
            wire.decode(wire.encode(msgspec.structs.replace(query, **change)), wire.HandshakeMessage)
    for change in (dict(block_ids=[-1]), dict(reason="r" * 2000)):
        with pytest.raises(wire.WireError):
            wire.decode(wire.encode(msgspec.structs.replace(answer, **change)), wire.BlocksAnswer)


def test_pending_params_need_no_block_ids():
    base = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "h", "remote_handshake_port": 1,
            "transfer_id": "t"}
    assert wire.KVTransferParams.from_dict(base).missing_for_load() == "remote_block_ids"
    assert wire.KVTransferParams.from_dict({**base, "remote_blocks_pending": True}).missing_for_load() is None
    assert "remote_blocks_pending" not in wire.KVTransferParams.from_dict(base).to_dict()


def test_prepared_decoders_leave_nothing_to_build_on_the_first_handshake():
    wire.prepare_decoders()
    before = wire._decoder.cache_info()
    for type_ in (wire.HandshakeMessage, wire.HandshakeReplyMessage, wire.AutoDescriptor, wire.CmaDescriptor,
                  wire.TcpDescriptor, wire.NixlDescriptor):
        wire._decoder(type_)
    after = wire._decoder.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 6
