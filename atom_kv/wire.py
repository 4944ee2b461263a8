"""Every message atom-kv puts on a ZeroMQ socket, as msgspec Structs.

Each message family has one encoder/decoder pair. Decoding anything that is
not a well-formed message of that family raises :class:`WireError` (and only
that), so a receive loop can ``except WireError``, count it and carry on.

Every message carries ``v`` (protocol version). The registration ping keeps
ATOM's msgpack map layout exactly (``type``/``role``/``index``/...), so ATOM's
proxy accepts our engines and our proxy accepts ATOM's; ``v``, ``engine_id``
and the signature keys ``ts``/``nonce``/``mac`` are extra keys older peers ignore.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import msgspec

__all__ = [
    "PROTOCOL_VERSION",
    "WireError",
    "RegisterPing",
    "HelloPing",
    "CompatInfo",
    "RegionInfo",
    "HandshakeRequest",
    "HandshakeReply",
    "DoneReading",
    "DoneAck",
    "ReadRange",
    "ReadRequest",
    "ReadReply",
    "encode",
    "decode_registration",
    "decode_handshake_msg",
    "decode_handshake_reply",
    "decode_done_ack",
    "decode_read_request",
    "decode_read_reply",
    "TcpHello",
    "TcpHelloReply",
    "TcpDescriptor",
    "RegionSpan",
    "CmaDescriptor",
    "CmaGrantRequest",
    "CmaGrantReply",
    "AutoDescriptor",
    "decode_tcp_hello",
    "decode_tcp_hello_reply",
    "decode_tcp_descriptor",
    "decode_cma_descriptor",
    "decode_cma_grant_request",
    "decode_cma_grant_reply",
    "decode_auto_descriptor",
    "MoriIODescriptor",
    "decode_moriio_descriptor",
]

PROTOCOL_VERSION = 1


class WireError(ValueError):
    """Bytes that are not a valid message of the expected family."""


# --------------------------------------------------------------------------
# Discovery: engine rank 0 (DEALER) -> proxy (ROUTER)
# --------------------------------------------------------------------------
class RegisterPing(msgspec.Struct, tag_field="type", tag="register", kw_only=True):
    """ATOM's registration ping. ``role`` is "P" (prefill) or "D" (decode).

    With a shared ``auth_token`` the sender signs it (:func:`atom_kv.auth.sign_fields`,
    purpose :data:`atom_kv.auth.PURPOSE_REGISTER`): ``ts`` (unix seconds), ``nonce``
    and ``mac``; the token itself is never sent."""

    role: Literal["P", "D"]
    index: str
    request_address: str
    handshake_port: int
    dp_size: int = 1
    tp_size: int = 1
    transfer_mode: str = "read"
    v: int = PROTOCOL_VERSION
    engine_id: Optional[str] = None
    model: Optional[str] = None
    ts: Optional[float] = None
    nonce: Optional[str] = None
    mac: Optional[str] = None


class HelloPing(msgspec.Struct, tag_field="type", tag="HELLO", kw_only=True):
    """ATOM's initial hello; carries nothing we use and is ignored."""


_Registration = Union[RegisterPing, HelloPing]


# --------------------------------------------------------------------------
# Handshake port: consumer worker (DEALER) -> producer worker (ROUTER)
# --------------------------------------------------------------------------
class CompatInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What two engines must agree on before a block byte is trusted."""

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int  # total across all TP ranks
    head_dim: int
    block_size: int
    is_mla: bool = False


class RegionInfo(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """One registered KV tensor of a rank, as the peer needs to address it.

    ``layer`` and ``kind`` ("k", "v" or "latent") name the tensor;
    ``region_ids`` are the backend's chunk ids, each ``chunk_bytes`` long
    except possibly the last; ``block_bytes`` is the bytes of one block of
    this rank's slice; ``num_blocks`` the tensor's block count.
    """

    layer: int
    kind: str
    region_ids: list[int]
    chunk_bytes: int
    block_bytes: int
    num_blocks: int


class HandshakeRequest(msgspec.Struct, tag_field="t", tag="hs", kw_only=True):
    engine_id: str
    tp_rank: int
    tp_size: int
    compat: CompatInfo
    backend: str
    host: str = ""
    auth_token: Optional[str] = None
    v: int = PROTOCOL_VERSION


class HandshakeReply(msgspec.Struct, tag_field="t", tag="hs_ok", kw_only=True):
    ok: bool
    error: str = ""
    engine_id: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    compat: Optional[CompatInfo] = None
    backend: str = ""
    host: str = ""
    descriptor: bytes = b""
    regions: list[RegionInfo] = []
    v: int = PROTOCOL_VERSION


class DoneReading(msgspec.Struct, tag_field="t", tag="done", kw_only=True):
    """Consumer rank ``tp_rank`` of ``tp_size`` finished (or gave up) reading."""

    transfer_id: str
    engine_id: str
    tp_rank: int
    tp_size: int
    ok: bool = True
    auth_token: Optional[str] = None
    #: ask the producer rank to answer with a :class:`DoneAck` (older peers ignore it)
    want_ack: bool = False
    v: int = PROTOCOL_VERSION


class DoneAck(msgspec.Struct, tag_field="t", tag="done_ack", kw_only=True):
    """Producer rank ``tp_rank``'s answer to a ``DoneReading(want_ack=True)``:
    ``valid`` is False when it had already released the transfer's blocks
    (they may hold another request's KV), with the reason."""

    transfer_id: str
    tp_rank: int
    valid: bool
    reason: str = ""
    v: int = PROTOCOL_VERSION


_HandshakeMsg = Union[HandshakeRequest, DoneReading]


# --------------------------------------------------------------------------
# tcp backend read protocol
# --------------------------------------------------------------------------
class ReadRange(msgspec.Struct, array_like=True, frozen=True):
    region: int
    offset: int
    size: int


class ReadRequest(msgspec.Struct, tag_field="t", tag="rd", kw_only=True, array_like=True):
    """``ranges`` to send back in order. ``packed`` (when non-empty) carries
    the same thing in bulk: little-endian uint64 ``(region, offset, size)``
    triples, used instead of ``ranges``."""

    req_id: int
    ranges: list[ReadRange]
    auth_token: Optional[str] = None
    v: int = PROTOCOL_VERSION
    packed: bytes = b""


class ReadReply(msgspec.Struct, tag_field="t", tag="rd_ok", kw_only=True, array_like=True):
    req_id: int
    ok: bool
    total: int = 0
    error: str = ""
    v: int = PROTOCOL_VERSION


# --------------------------------------------------------------------------
# moriio backend descriptor (carried opaquely in HandshakeReply.descriptor)
# --------------------------------------------------------------------------
class MoriIODescriptor(msgspec.Struct, tag_field="t", tag="mori", kw_only=True, array_like=True):
    """One MORI-IO engine's reachability: its packed ``EngineDesc`` and one
    packed ``MemoryDesc`` plus byte size per registered region (index = region id)."""

    key: str
    engine: bytes
    transport: str
    memories: list[bytes]
    sizes: list[int]
    v: int = PROTOCOL_VERSION


# --------------------------------------------------------------------------
# tcp backend: connection hello and descriptor
# --------------------------------------------------------------------------
class TcpHello(msgspec.Struct, tag_field="t", tag="tcp_hello", kw_only=True):
    """First frame on a tcp backend connection: who reads, with which token."""

    key: str = ""
    auth_token: Optional[str] = None
    v: int = PROTOCOL_VERSION


class TcpHelloReply(msgspec.Struct, tag_field="t", tag="tcp_hello_ok", kw_only=True):
    ok: bool
    error: str = ""
    v: int = PROTOCOL_VERSION


class TcpDescriptor(msgspec.Struct, tag_field="t", tag="tcp_desc", kw_only=True):
    """What a reader needs to reach a tcp backend's read server."""

    host: str
    port: int
    key: str = ""
    host_id: str = ""
    v: int = PROTOCOL_VERSION


# --------------------------------------------------------------------------
# cma backend: descriptor and the control endpoint that grants access
# --------------------------------------------------------------------------
class RegionSpan(msgspec.Struct, array_like=True, frozen=True):
    """One registered region of a process: id, virtual address, size."""

    region: int
    addr: int
    size: int


class CmaDescriptor(msgspec.Struct, tag_field="t", tag="cma_desc", kw_only=True):
    """Where the cma control endpoint of a process is (same host only)."""

    pid: int
    host_id: str
    ctl_host: str
    ctl_port: int
    key: str = ""
    v: int = PROTOCOL_VERSION


class CmaGrantRequest(msgspec.Struct, tag_field="t", tag="cma_grant", kw_only=True):
    pid: int
    key: str = ""
    auth_token: Optional[str] = None
    v: int = PROTOCOL_VERSION


class CmaGrantReply(msgspec.Struct, tag_field="t", tag="cma_grant_ok", kw_only=True):
    ok: bool
    error: str = ""
    pid: int = 0
    regions: list[RegionSpan] = []
    v: int = PROTOCOL_VERSION


class AutoDescriptor(msgspec.Struct, tag_field="t", tag="auto_desc", kw_only=True):
    """Both descriptors of an auto backend; ``cma`` is empty when unusable."""

    host_id: str
    tcp: bytes
    cma: bytes = b""
    v: int = PROTOCOL_VERSION


# --------------------------------------------------------------------------
# One encoder, one decoder per family.
# --------------------------------------------------------------------------
_encoder = msgspec.msgpack.Encoder()
_registration_decoder = msgspec.msgpack.Decoder(_Registration)
_handshake_decoder = msgspec.msgpack.Decoder(_HandshakeMsg)
_handshake_reply_decoder = msgspec.msgpack.Decoder(HandshakeReply)
_done_ack_decoder = msgspec.msgpack.Decoder(DoneAck)
_read_request_decoder = msgspec.msgpack.Decoder(ReadRequest)
_read_reply_decoder = msgspec.msgpack.Decoder(ReadReply)
_tcp_hello_decoder = msgspec.msgpack.Decoder(TcpHello)
_tcp_hello_reply_decoder = msgspec.msgpack.Decoder(TcpHelloReply)
_tcp_descriptor_decoder = msgspec.msgpack.Decoder(TcpDescriptor)
_cma_descriptor_decoder = msgspec.msgpack.Decoder(CmaDescriptor)
_cma_grant_request_decoder = msgspec.msgpack.Decoder(CmaGrantRequest)
_cma_grant_reply_decoder = msgspec.msgpack.Decoder(CmaGrantReply)
_auto_descriptor_decoder = msgspec.msgpack.Decoder(AutoDescriptor)
_moriio_descriptor_decoder = msgspec.msgpack.Decoder(MoriIODescriptor)


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack-encode any message of this module."""
    return _encoder.encode(msg)


def _decoding(decoder: msgspec.msgpack.Decoder, data: bytes, family: str):
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"bad {family} message ({len(data)} bytes): {exc}") from None


def decode_registration(data: bytes) -> _Registration:
    return _decoding(_registration_decoder, data, "registration")


def decode_handshake_msg(data: bytes) -> _HandshakeMsg:
    return _decoding(_handshake_decoder, data, "handshake")


def decode_handshake_reply(data: bytes) -> HandshakeReply:
    return _decoding(_handshake_reply_decoder, data, "handshake reply")


def decode_done_ack(data: bytes) -> DoneAck:
    return _decoding(_done_ack_decoder, data, "done ack")


def decode_read_request(data: bytes) -> ReadRequest:
    return _decoding(_read_request_decoder, data, "read request")


def decode_read_reply(data: bytes) -> ReadReply:
    return _decoding(_read_reply_decoder, data, "read reply")


def decode_moriio_descriptor(data: bytes) -> MoriIODescriptor:
    return _decoding(_moriio_descriptor_decoder, data, "moriio descriptor")


def decode_tcp_hello(data: bytes) -> TcpHello:
    return _decoding(_tcp_hello_decoder, data, "tcp hello")


def decode_tcp_hello_reply(data: bytes) -> TcpHelloReply:
    return _decoding(_tcp_hello_reply_decoder, data, "tcp hello reply")


def decode_tcp_descriptor(data: bytes) -> TcpDescriptor:
    return _decoding(_tcp_descriptor_decoder, data, "tcp descriptor")


def decode_cma_descriptor(data: bytes) -> CmaDescriptor:
    return _decoding(_cma_descriptor_decoder, data, "cma descriptor")


def decode_cma_grant_request(data: bytes) -> CmaGrantRequest:
    return _decoding(_cma_grant_request_decoder, data, "cma grant request")


def decode_cma_grant_reply(data: bytes) -> CmaGrantReply:
    return _decoding(_cma_grant_reply_decoder, data, "cma grant reply")


def decode_auto_descriptor(data: bytes) -> AutoDescriptor:
    return _decoding(_auto_descriptor_decoder, data, "auto descriptor")
