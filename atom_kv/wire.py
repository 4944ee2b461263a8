"""Every message atom-kv puts on a ZeroMQ socket, and the ``kv_transfer_params``
engines and proxies exchange over HTTP, as msgspec Structs.

:func:`encode` writes any message; ``decode(data, Type)`` reads one (decoders
are built once per type and cached). Decoding anything that is not a
well-formed message of that type raises :class:`WireError` (and only that),
so a receive loop can ``except WireError``, count it and carry on.

Every message carries ``v`` (protocol version). The registration ping keeps
ATOM's msgpack map layout exactly (``type``/``role``/``index``/...), so ATOM's
proxy accepts our engines and our proxy accepts ATOM's; ``v``, ``engine_id``,
the signature keys ``ts``/``nonce``/``mac`` and the KV events endpoints are extra
keys older peers ignore.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import Annotated, Any, Hashable, Literal, Mapping, Optional, TypeVar, Union, cast, get_args

import msgspec

from atom_kv.config import MAX_PORT, FieldError, PeerPort, validate_fields

__all__ = [
    "MAX_PARAMS_BLOCKS",
    "MAX_PRODUCER_DP_SIZE",
    "MAX_PRODUCER_RANKS",
    "MAX_TRANSFER_ID_CHARS",
    "KV_FEATURE_RENDEZVOUS",
    "BlocksAnswer",
    "BlocksQuery",
    "PROTOCOL_VERSION",
    "AutoDescriptor",
    "BlockIds",
    "CMA_PROTOCOL_VERSION",
    "CmaChallenge",
    "CmaDescriptor",
    "CmaGrantReply",
    "CmaGrantRequest",
    "CompatInfo",
    "DoneAck",
    "DoneReading",
    "HANDSHAKE_PROTOCOL_VERSION",
    "HandshakeChallenge",
    "HandshakeMessage",
    "HandshakeProof",
    "HandshakeReply",
    "HandshakeReplyMessage",
    "HandshakeRequest",
    "HelloPing",
    "Issued",
    "KVTransferParams",
    "MoriIODescriptor",
    "NixlDescriptor",
    "PeerProof",
    "PeerProofRequest",
    "ReadRange",
    "ReadReply",
    "ReadRequest",
    "RegionInfo",
    "RegionSpan",
    "RegisterAnswer",
    "RegisterPing",
    "RegistrationMessage",
    "Release",
    "SealedHandshakeReply",
    "TCP_PROTOCOL_VERSION",
    "TcpDescriptor",
    "TcpHello",
    "TcpHelloReply",
    "TcpServerHello",
    "TransferId",
    "WireError",
    "adoptable_transfer_id",
    "blocks_digest",
    "decode",
    "encode",
    "handshake_port",
    "peek_version",
    "prepare_decoders",
]

PROTOCOL_VERSION = 1

T = TypeVar("T")


class WireError(ValueError):
    """Bytes that are not a valid message of the expected family."""


# Bounds on what a peer that has not proven anything may send (checked while decoding, before anything is kept).
#: a name: an engine id, a model, a backend, a dtype, a layout label, a sender
Name = Annotated[str, msgspec.Meta(max_length=256)]
#: one ``kv_features`` entry, and how many an engine announces at most
FeatureName = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
MAX_KV_FEATURES = 32
#: a host name or address (DNS names are at most 253 characters)
HostName = Annotated[str, msgspec.Meta(max_length=255)]
#: an http URL an engine advertises
UrlText = Annotated[str, msgspec.Meta(max_length=1024)]
#: a ZeroMQ address a proxy connects to (``tcp://`` and a host name or address, a port)
EventsAddress = Annotated[str, msgspec.Meta(max_length=300)]
#: a rank, a size, a count: never negative, never huge
Rank = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
#: a transfer id as it travels on the handshake port (at most 128 characters, as adopted from a request)
WireTransferId = Annotated[str, msgspec.Meta(max_length=128)]


# --------------------------------------------------------------------------
# Discovery: engine rank 0 (DEALER) -> proxy (ROUTER)
# --------------------------------------------------------------------------
class RegisterPing(msgspec.Struct, tag_field="type", tag="register", kw_only=True):
    """ATOM's registration ping. ``role`` is "P" (prefill) or "D" (decode).

    With a shared ``auth_token`` the sender signs it (:func:`atom_kv.auth.sign_fields`,
    purpose :data:`atom_kv.auth.PURPOSE_REGISTER`): ``ts`` (unix seconds), ``nonce``
    and ``mac``; the token itself is never sent."""

    role: Literal["P", "D"]
    index: Name
    request_address: UrlText
    handshake_port: int
    dp_size: int = 1
    tp_size: int = 1
    transfer_mode: Name = "read"
    v: int = PROTOCOL_VERSION
    engine_id: Optional[Name] = None
    model: Optional[Name] = None
    #: what the engine's connector takes part in (``kv_features``, e.g. "rendezvous"), for engines whose
    #: HTTP server cannot announce it on ``/health`` (vLLM's); None: nothing said here
    kv_features: Optional[Annotated[list[FeatureName], msgspec.Meta(max_length=MAX_KV_FEATURES)]] = None
    #: where proxies connect to follow the engine's KV cache events (vLLM's wire, DP rank 0's endpoint: rank
    #: N publishes on its port + N), and its replay endpoint; ``tcp://HOST:PORT``, ``*`` meaning the host of
    #: ``request_address``. None: the engine publishes none (ATOM's and MoRIIO's pings never say)
    kv_events: Optional[EventsAddress] = None
    kv_events_replay: Optional[EventsAddress] = None
    #: the sender reads the proxy's :class:`RegisterAnswer` to this ping (atom-kv's pinger sets it; ATOM's own
    #: engines do not, and get no answer they never asked for)
    answers: bool = False
    ts: Optional[float] = None
    nonce: Optional[Name] = None
    mac: Optional[Name] = None
    #: the engine is leaving (its first SIGTERM): the proxy gives it no new legs; its in-flight ones finish
    draining: bool = False


#: a human-readable explanation on the wire (one log line)
DetailText = Annotated[str, msgspec.Meta(max_length=512)]
#: what a :class:`RegisterAnswer` says
RegisterStatus = Literal["registered", "refused", "stale"]
REGISTERED: Literal["registered"] = "registered"
REFUSED: Literal["refused"] = "refused"
STALE: Literal["stale"] = "stale"


class RegisterAnswer(msgspec.Struct, tag_field="type", tag="register_answer", kw_only=True):
    """The proxy's answer to a :class:`RegisterPing` that set ``answers`` (proxy ROUTER -> engine DEALER).

    ``status``: ``registered`` (``reason`` ``unreachable`` while the proxy cannot reach the engine's
    URL); ``refused`` with ``reason`` one of ``token``, ``limits``, ``format``, ``withdrawn``,
    ``address``, ``version``; or ``stale`` (a signed ping whose timestamp is outside the proxy's window:
    the two clocks differ). ``detail`` says why in one line. Informational only: the engine logs it."""

    status: RegisterStatus
    reason: Name = ""
    detail: DetailText = ""
    v: int = PROTOCOL_VERSION


class HelloPing(msgspec.Struct, tag_field="type", tag="HELLO", kw_only=True):
    """ATOM's initial hello; carries nothing we use and is ignored."""


#: what arrives on a proxy's discovery port from an ATOM-style engine
RegistrationMessage = Union[RegisterPing, HelloPing]


# --------------------------------------------------------------------------
# Handshake port: consumer worker (DEALER) -> producer worker (ROUTER)
# --------------------------------------------------------------------------
class CompatInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What two engines must agree on before a block byte is trusted.

    ``layout`` is the KV-cache layout's label (``atom_kv.connector.cache_layouts``:
    "hnd", "aiter", "aiter-shuffle", vLLM's fused "vllm-hnd" and "vllm-cpu",
    each with "/ratio=N" when a block is N physical blocks, or "mla"); empty,
    as from peers that predate it, means "mla" for an MLA cache and "hnd"
    otherwise.
    """

    model_id: Name
    dtype: Name
    num_layers: Rank
    num_kv_heads: Rank  # total across all TP ranks
    head_dim: Rank
    block_size: Rank
    is_mla: bool = False
    layout: Name = ""

    def __post_init__(self) -> None:
        if not self.layout:
            msgspec.structs.force_setattr(self, "layout", "mla" if self.is_mla else "hnd")


class RegionInfo(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """One registered KV tensor of a rank, as the peer needs to address it.

    ``layer`` and ``kind`` name the tensor ("k", "v", "k_scale", "v_scale",
    a fused "kv", or MLA's "latent" and "index"; see ``cache_layouts.KINDS``);
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


#: version of what travels on a producer rank's handshake port (handshake,
#: peer proofs, done-reading, done-ack, release); 2: tokens are proven by
#: challenge-response, never sent
HANDSHAKE_PROTOCOL_VERSION = 2
#: a nonce on the handshake port: empty, or up to 128 characters (atom-kv's are 32 hex digits)
HandshakeNonce = Annotated[str, msgspec.Meta(max_length=128)]
#: a MAC on the handshake port: empty, or a hex HMAC-SHA256 (64 characters)
HandshakeMac = Annotated[str, msgspec.Meta(max_length=128)]


#: memory kind labels ("host", "gpu:N"): a few short strings
MemoryLabels = Annotated[list[Annotated[str, msgspec.Meta(max_length=16)]], msgspec.Meta(max_length=16)]


def handshake_port(base: int, dp_rank: int, tp_size: int, tp_rank: int, *, pp_rank: int = 0,
                   dp_size: int = 1) -> int:
    """The side-channel port of one producer rank: ATOM main's layout
    (``port_offset.side_channel_port_offset``),
    ``base + pp_rank*(dp_size*tp_size) + dp_rank*tp_size + tp_rank``.

    Every port this package binds or dials for a rank comes from here, so our
    engines and ATOM's find each other's ports. ``dp_size`` matters only for
    pipeline stages after the first."""
    return base + pp_rank * (dp_size * tp_size) + dp_rank * tp_size + tp_rank


class HandshakeRequest(msgspec.Struct, tag_field="t", tag="hs", kw_only=True):
    """A consumer rank asking a producer rank for its descriptor and regions.

    With an ``auth_token`` the consumer sends its challenge ``nonce``; the
    producer then answers with a :class:`HandshakeChallenge` instead of the
    reply. Nothing here is derived from the token."""

    engine_id: Name
    tp_rank: Rank
    tp_size: Rank
    compat: CompatInfo
    backend: Name
    host: HostName = ""
    nonce: HandshakeNonce = ""
    v: int = HANDSHAKE_PROTOCOL_VERSION
    #: memory kinds of this rank's KV cache ("host", "gpu:N"); empty from older peers (= host)
    memory: MemoryLabels = []


class HandshakeChallenge(msgspec.Struct, tag_field="t", tag="hs_challenge", kw_only=True):
    """The producer proves it knows the token first: ``proof`` is an HMAC over
    both nonces and the fields here; ``nonce`` is its challenge to the consumer."""

    engine_id: str
    tp_rank: int
    nonce: HandshakeNonce
    proof: HandshakeMac
    v: int = HANDSHAKE_PROTOCOL_VERSION


#: largest :class:`HandshakeRequest` a producer takes back in a :class:`HandshakeProof` (every field at
#: its bound, in 4-byte UTF-8 characters, encodes to about 8 KiB)
MAX_HANDSHAKE_REQUEST_BYTES = 16 << 10


class HandshakeProof(msgspec.Struct, tag_field="t", tag="hs_proof", kw_only=True):
    """The consumer's answer to a :class:`HandshakeChallenge` (``nonce`` is the
    producer's): an HMAC over both nonces and the request it sent, and that
    request's bytes again (``request``), so the producer keeps only a digest of
    it while it waits for this answer."""

    nonce: HandshakeNonce
    proof: HandshakeMac
    v: int = HANDSHAKE_PROTOCOL_VERSION
    request: Annotated[bytes, msgspec.Meta(max_length=MAX_HANDSHAKE_REQUEST_BYTES)] = b""


class HandshakeReply(msgspec.Struct, tag_field="t", tag="hs_ok", kw_only=True):
    """The producer rank's answer: its descriptor and regions, or the refusal in ``error``."""

    ok: bool
    error: str = ""
    engine_id: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    #: the pipeline stage this rank is; its ``regions`` name the layers it holds
    pp_rank: int = 0
    pp_size: int = 1
    compat: Optional[CompatInfo] = None
    backend: str = ""
    host: str = ""
    descriptor: bytes = b""
    regions: list[RegionInfo] = []
    v: int = HANDSHAKE_PROTOCOL_VERSION
    #: memory kinds of the producer rank's KV cache; empty from older peers (= host)
    memory: MemoryLabels = []


class SealedHandshakeReply(msgspec.Struct, tag_field="t", tag="hs_sealed", kw_only=True):
    """A :class:`HandshakeReply` (its bytes in ``reply``) after a challenge-response,
    with an HMAC over both nonces and those bytes, so nobody can alter it."""

    reply: bytes
    mac: HandshakeMac
    v: int = HANDSHAKE_PROTOCOL_VERSION


class PeerProofRequest(msgspec.Struct, tag_field="t", tag="proof_req", kw_only=True):
    """"Prove you know the token": sent before any signed notice goes to a
    producer rank that has not proven it yet."""

    nonce: HandshakeNonce
    v: int = HANDSHAKE_PROTOCOL_VERSION


class PeerProof(msgspec.Struct, tag_field="t", tag="proof", kw_only=True):
    """The answer to a :class:`PeerProofRequest`: an HMAC over the nonce and
    the fields here (empty when the producer has no token)."""

    engine_id: str
    tp_rank: int
    proof: HandshakeMac = ""
    v: int = HANDSHAKE_PROTOCOL_VERSION


class DoneReading(msgspec.Struct, tag_field="t", tag="done", kw_only=True):
    """Consumer rank ``tp_rank`` of ``tp_size`` finished (or gave up) reading.

    ``block_offset``/``num_blocks``/``blocks_digest`` say which of the
    transfer's blocks it read (:func:`blocks_digest` of
    ``remote_block_ids[block_offset:block_offset + num_blocks]``); the producer
    confirms only a read of its own blocks of that transfer. With a token,
    signed (``ts``, ``nonce``, ``mac``; :func:`atom_kv.auth.sign_struct`)."""

    transfer_id: WireTransferId
    engine_id: Name
    tp_rank: Rank
    tp_size: Rank
    ok: bool = True
    #: ask the producer rank to answer with a :class:`DoneAck`
    want_ack: bool = False
    block_offset: Rank = 0
    num_blocks: Rank = 0
    blocks_digest: Name = ""
    ts: Optional[float] = None
    nonce: Optional[HandshakeNonce] = None
    mac: Optional[HandshakeMac] = None
    v: int = HANDSHAKE_PROTOCOL_VERSION


class DoneAck(msgspec.Struct, tag_field="t", tag="done_ack", kw_only=True):
    """Producer rank ``tp_rank``'s answer to a ``DoneReading(want_ack=True)``:
    ``valid`` is False when the read cannot be trusted (the blocks were
    released, the transfer is not this producer's, or the consumer read other
    blocks), with the reason. With a token, ``mac`` covers the fields and the
    :class:`DoneReading`'s nonce, so an old ack never answers a new question."""

    transfer_id: str
    tp_rank: int
    valid: bool
    reason: str = ""
    mac: Optional[HandshakeMac] = None
    v: int = HANDSHAKE_PROTOCOL_VERSION


class Release(msgspec.Struct, tag_field="t", tag="release", kw_only=True):
    """Nobody will read ``transfer_id``: a producer rank frees its blocks as if
    every consumer had finished. Sent by a decode engine that rejected, aborted
    or finished the request and by a proxy that abandoned the prefill;
    idempotent. ``sender`` and ``reason`` are for the producer's log. With a
    token, signed (``ts``, ``nonce``, ``mac``; :func:`atom_kv.auth.sign_struct`)."""

    transfer_id: WireTransferId
    reason: Name = ""
    sender: Name = ""
    ts: Optional[float] = None
    nonce: Optional[HandshakeNonce] = None
    mac: Optional[HandshakeMac] = None
    v: int = HANDSHAKE_PROTOCOL_VERSION


#: most blocks one :class:`Issued` notice names (a million tokens at 16 tokens a block): it bounds the
#: largest message a producer rank's handshake port accepts
MAX_ISSUED_BLOCKS = 1 << 16
#: a block id on the handshake port: an index into a KV cache
WireBlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class Issued(msgspec.Struct, tag_field="t", tag="issued", kw_only=True):
    """A producer engine's scheduler telling its own ranks that ``block_ids``
    are lent to readers under ``transfer_id``, for engines whose per-step
    metadata reaches the ranks only with their next batch (ATOM): a rank
    confirms reads only of transfers it knows were issued. Signed like
    :class:`Release`."""

    transfer_id: WireTransferId
    block_ids: Annotated[list[WireBlockId], msgspec.Meta(max_length=MAX_ISSUED_BLOCKS)]
    ts: Optional[float] = None
    nonce: Optional[HandshakeNonce] = None
    mac: Optional[HandshakeMac] = None
    v: int = HANDSHAKE_PROTOCOL_VERSION


#: most blocks one transfer may name on the wire (a 2,048-token block holds a long prompt's KV in a few)
MAX_WIRE_BLOCKS = 1 << 20
#: most tokens a rendezvous answer names as the prefill's sampled ones
MAX_FIRST_TOKENS = 16
#: longest a blocks query may ask a producer rank to wait, in milliseconds
MAX_BLOCKS_WAIT_MS = 600_000


class BlocksQuery(msgspec.Struct, tag_field="t", tag="blocks_q", kw_only=True):
    """Consumer rank ``tp_rank`` asking a producer rank which blocks hold
    ``transfer_id`` (the rendezvous of a decode leg dispatched before its
    prefill finished). The producer answers with a :class:`BlocksAnswer` as
    soon as it knows the transfer, or when ``wait_ms`` (capped by its own
    ``prefill_wait_timeout_s``) has passed. With a token, signed like
    :class:`DoneReading` (``ts``, ``nonce``, ``mac``)."""

    transfer_id: WireTransferId
    engine_id: Name
    tp_rank: Rank
    tp_size: Rank
    wait_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCKS_WAIT_MS)] = 0
    ts: Optional[float] = None
    nonce: Optional[HandshakeNonce] = None
    mac: Optional[HandshakeMac] = None
    v: int = HANDSHAKE_PROTOCOL_VERSION


class BlocksAnswer(msgspec.Struct, tag_field="t", tag="blocks_a", kw_only=True):
    """Producer rank ``tp_rank``'s answer to a :class:`BlocksQuery`: the
    transfer's ``block_ids`` when ``found``, else why not (released, never
    issued within the wait). With a token, ``mac`` covers the fields and the
    query's nonce, like :class:`DoneAck`."""

    transfer_id: WireTransferId
    tp_rank: Rank
    found: bool
    block_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_WIRE_BLOCKS)] = []
    #: the producer's pipeline stages: a consumer that did not know them refuses the load
    pp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    #: the token the prefill sampled, when its engine passed it (the decode may continue from it)
    first_token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_FIRST_TOKENS)] = []
    #: with ``found``: the producer holds the blocks for at least this long after answering, whatever a
    #: third party's release says (only the asking engine's own notices end it early); 0 promises nothing.
    #: A consumer whose read ended well inside it needs no confirmation (:mod:`atom_kv.connector.consumer`)
    lease_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCKS_WAIT_MS)] = 0
    #: without ``found``: the producer's scheduler still has the request queued or computing; ask again
    coming: bool = False
    reason: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    mac: Optional[HandshakeMac] = None
    v: int = HANDSHAKE_PROTOCOL_VERSION


#: what arrives on a producer rank's handshake port
HandshakeMessage = Union[HandshakeRequest, HandshakeProof, PeerProofRequest, DoneReading, Release, Issued,
                         BlocksQuery]
#: what a consumer receives on its handshake connection
HandshakeReplyMessage = Union[HandshakeReply, HandshakeChallenge, SealedHandshakeReply]


def blocks_digest(block_ids: Any) -> str:
    """A short digest of a list of block ids (which blocks a consumer read)."""
    ids = [int(b) for b in block_ids]
    return hashlib.blake2b(struct.pack(f"<{len(ids)}q", *ids), digest_size=16).hexdigest()


# --------------------------------------------------------------------------
# tcp backend read protocol
# --------------------------------------------------------------------------
class ReadRange(msgspec.Struct, array_like=True, frozen=True):
    region: int
    offset: int
    size: int


#: version of the tcp read protocol (server hello, hello, hello reply, read
#: request/reply); 2: the server speaks first and tokens are proven, never sent
TCP_PROTOCOL_VERSION = 2
#: version of the cma grant protocol (challenge, grant request, grant reply)
CMA_PROTOCOL_VERSION = 2
#: a data-path nonce: empty, or up to 128 characters (atom_kv's are 32 hex digits)
Nonce = Annotated[str, msgspec.Meta(max_length=128)]
#: a data-path proof: empty, or a hex HMAC-SHA256 (64 characters)
Proof = Annotated[str, msgspec.Meta(max_length=128)]


class ReadRequest(msgspec.Struct, tag_field="t", tag="rd", kw_only=True, array_like=True):
    """``ranges`` to send back in order. ``packed`` (when non-empty) carries
    the same thing in bulk: little-endian uint64 ``(region, offset, size)``
    triples, used instead of ``ranges``. Only sent on an accepted connection
    (after :class:`TcpHelloReply` with ``ok``), at most ``max_ranges`` ranges."""

    req_id: int
    ranges: list[ReadRange]
    v: int = TCP_PROTOCOL_VERSION
    packed: bytes = b""


class ReadReply(msgspec.Struct, tag_field="t", tag="rd_ok", kw_only=True, array_like=True):
    """Answer to one :class:`ReadRequest`; with ``ok``, ``total`` raw bytes follow."""

    req_id: int
    ok: bool
    total: int = 0
    error: str = ""
    v: int = TCP_PROTOCOL_VERSION


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
# nixl backend descriptor (carried opaquely in HandshakeReply.descriptor)
# --------------------------------------------------------------------------
class NixlDescriptor(msgspec.Struct, tag_field="t", tag="nixl", kw_only=True, array_like=True):
    """One NIXL agent's reachability: its name, its agent metadata (connection
    info and registered memory, from ``get_agent_metadata``), the plugins it
    runs, and per registered region (index = region id) its address, size and
    device (-1 for host memory). ``align`` is the gcd of its registered block
    sizes, the granularity of its prepared descriptor lists."""

    agent: str
    metadata: bytes
    plugins: list[str]
    addrs: list[int]
    sizes: list[int]
    devices: list[int]
    align: int = 1
    v: int = PROTOCOL_VERSION


# --------------------------------------------------------------------------
# tcp backend: connection hello and descriptor
# --------------------------------------------------------------------------
class TcpServerHello(msgspec.Struct, tag_field="t", tag="tcp_server_hello", kw_only=True):
    """First frame on a tcp backend connection, sent by the read server.

    ``nonce`` is the server's challenge when it requires the ``auth_token``
    (empty when it does not). ``ok`` is False when the server refuses the
    connection outright (too many connections), with the reason in ``error``.
    """

    ok: bool = True
    error: str = ""
    nonce: Nonce = ""
    v: int = TCP_PROTOCOL_VERSION


class TcpHello(msgspec.Struct, tag_field="t", tag="tcp_hello", kw_only=True):
    """The reader's answer to :class:`TcpServerHello`: who reads and, when the
    server sent a nonce, the reader's ``nonce`` and its ``proof`` (an HMAC
    keyed with the token over both nonces). The token itself never travels."""

    key: str = ""
    nonce: Nonce = ""
    proof: Proof = ""
    v: int = TCP_PROTOCOL_VERSION


class TcpHelloReply(msgspec.Struct, tag_field="t", tag="tcp_hello_ok", kw_only=True):
    """The server's verdict on a :class:`TcpHello`. When the server requires
    the token, ``proof`` is its own HMAC over both nonces (the reader checks
    it before sending a request). ``max_ranges``: the most ranges one
    :class:`ReadRequest` may name on this connection."""

    ok: bool
    error: str = ""
    proof: Proof = ""
    max_ranges: int = 0
    v: int = TCP_PROTOCOL_VERSION


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


class CmaChallenge(msgspec.Struct, tag_field="t", tag="cma_challenge", kw_only=True):
    """First frame on a cma grant connection, sent by the grant endpoint:
    its ``nonce`` when it requires the ``auth_token`` (empty otherwise), or
    ``ok=False`` with the reason when it refuses the connection outright."""

    ok: bool = True
    error: str = ""
    nonce: Nonce = ""
    v: int = CMA_PROTOCOL_VERSION


class CmaGrantRequest(msgspec.Struct, tag_field="t", tag="cma_grant", kw_only=True):
    """A reader asking for the region table: its ``pid`` and, when challenged,
    its ``nonce`` and ``proof`` (HMAC over both nonces; the token never travels)."""

    pid: int
    key: str = ""
    nonce: Nonce = ""
    proof: Proof = ""
    v: int = CMA_PROTOCOL_VERSION


class GpuIpcRegion(msgspec.Struct, array_like=True, frozen=True):
    """One registered GPU region as a CUDA/HIP IPC memory handle (what torch's
    ``UntypedStorage._share_cuda_`` returns, with ``offset``/``size`` the
    region's place in the handle's allocation) and its address in the
    serving process (used when reader and server are one process)."""

    region: int
    device: int
    handle: bytes
    offset: int
    size: int
    addr: int
    ref_counter_handle: Optional[bytes] = None
    ref_counter_offset: int = 0
    event_handle: Optional[bytes] = None
    event_sync_required: bool = False
    #: the GPU's UUID: device indices differ between processes that see different GPUs
    uuid: str = ""


class CmaGrantReply(msgspec.Struct, tag_field="t", tag="cma_grant_ok", kw_only=True):
    """The region table a reader may read, or the refusal. ``proof`` is the
    endpoint's HMAC over both nonces when it requires the token."""

    ok: bool
    error: str = ""
    pid: int = 0
    regions: list[RegionSpan] = []
    proof: Proof = ""
    v: int = CMA_PROTOCOL_VERSION
    #: gpu_ipc's memory handles (empty for cma)
    ipc: list[GpuIpcRegion] = []


class AutoDescriptor(msgspec.Struct, tag_field="t", tag="auto_desc", kw_only=True):
    """The inner descriptors of an auto backend (``cma``, ``gpu_ipc``, ``nixl``
    empty when unusable) and the memory kinds it registered (empty from older
    peers: host)."""

    host_id: str
    tcp: bytes
    cma: bytes = b""
    v: int = PROTOCOL_VERSION
    gpu_ipc: bytes = b""
    memory: MemoryLabels = []
    nixl: bytes = b""


# --------------------------------------------------------------------------
# kv_transfer_params: JSON between engines and proxy, inside completion
# requests and responses (ATOM's keys)
# --------------------------------------------------------------------------
#: longest transfer id a producer adopts from a request
MAX_TRANSFER_ID_CHARS = 128
#: a transfer id a producer may adopt: 1..128 printable ASCII characters
TransferId = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=MAX_TRANSFER_ID_CHARS, pattern=r"\A[\x20-\x7e]+\Z",
                 description=f"1..{MAX_TRANSFER_ID_CHARS} printable ASCII characters"),
]

# Bounds on kv_transfer_params, checked where they are decoded (any client of an engine's HTTP port may
# send them; the proxy drops a client's own). A request whose params break one is refused for that key.
#: most ranks (TP size times pipeline stages) of the producer kv_transfer_params may name, and so
#: the most ranks one release goes to (``atom_kv.connector.release.MAX_RELEASE_RANKS``)
MAX_PRODUCER_RANKS = 1024
#: most DP ranks of the producer kv_transfer_params may name
MAX_PRODUCER_DP_SIZE = 1024
#: most blocks kv_transfer_params may name (a decode engine also refuses more than it allocated)
MAX_PARAMS_BLOCKS = MAX_WIRE_BLOCKS
#: the longest engine id and host name kv_transfer_params may carry
MAX_PARAMS_NAME_CHARS = 256
MAX_PARAMS_HOST_CHARS = 255
BlockIds = Annotated[
    list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]],
    msgspec.Meta(min_length=1, max_length=MAX_PARAMS_BLOCKS,
                 description=f"a list of 1..{MAX_PARAMS_BLOCKS} block numbers, each in 0..{(1 << 32) - 1}"),
]
#: a producer's TP size or pipeline stages (their product is checked too, by :meth:`KVTransferParams.parse`)
ProducerSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_PRODUCER_RANKS,
                                           description=f"an integer in 1..{MAX_PRODUCER_RANKS}")]
ProducerDpSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_PRODUCER_DP_SIZE,
                                             description=f"an integer in 1..{MAX_PRODUCER_DP_SIZE}")]
ProducerDpRank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_PRODUCER_DP_SIZE,
                                             description=f"an integer in 0..{MAX_PRODUCER_DP_SIZE - 1}")]
ParamsEngineId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PARAMS_NAME_CHARS,
                                             description=f"1..{MAX_PARAMS_NAME_CHARS} characters")]
ParamsHost = Annotated[str, msgspec.Meta(
    min_length=1, max_length=MAX_PARAMS_HOST_CHARS,
    description=f"a host name or address of 1..{MAX_PARAMS_HOST_CHARS} characters")]
#: a transfer id as a decode leg names it: at most what the handshake port carries (:data:`WireTransferId`)
ParamsTransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TRANSFER_ID_CHARS,
                                               description=f"1..{MAX_TRANSFER_ID_CHARS} characters")]


#: an engine's ``/health`` ``kv_features`` entry: as a decode engine it continues from
#: ``first_token_ids`` (never recomputes the prefill's token) and honours ``first_token_sent``
KV_FEATURE_FIRST_TOKEN = "first_token"
#: an engine (prefill or decode) whose connector takes part in the block-id
#: rendezvous (:class:`BlocksQuery`): the proxy may send a pair's decode leg
#: with ``remote_blocks_pending`` while the prefill still computes
KV_FEATURE_RENDEZVOUS = "rendezvous"


class KVTransferParams(msgspec.Struct, kw_only=True):
    """The ``kv_transfer_params`` of one completion request or response.

    A prefill request carries ``do_remote_decode`` (and, from a proxy that
    names transfers, ``transfer_id``); the prefill's response and the decode
    request carry the producer's coordinates (``remote_*``, ``tp_size``,
    ``dp_rank``, ``transfer_id``). Every key is optional here; unknown keys
    are ignored (other routers add their own). :meth:`from_dict` validates,
    and bounds every key (any client of an engine's HTTP port may write
    them): at most :data:`MAX_PRODUCER_RANKS` producer ranks, every rank's
    port within 1..65535, at most :data:`MAX_PARAMS_BLOCKS` blocks, short strings.
    Hints the connector does not act on stay outside this schema, so a bad
    one never costs the request its remote KV: ``first_token_ids`` (the
    prefill's sampled token) and ``first_token_sent`` (the proxy streamed it),
    checked by the engine that uses them (see :data:`KV_FEATURE_FIRST_TOKEN`).
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: Optional[ParamsEngineId] = None
    remote_block_ids: Optional[BlockIds] = None
    remote_host: Optional[ParamsHost] = None
    remote_port: Optional[PeerPort] = None
    remote_handshake_port: Optional[PeerPort] = None
    remote_dp_size: Optional[ProducerDpSize] = None
    remote_tp_size: Optional[ProducerSize] = None
    remote_dp_rank: Optional[ProducerDpRank] = None
    remote_pp_size: Optional[ProducerSize] = None
    tp_size: Optional[ProducerSize] = None
    dp_rank: Optional[ProducerDpRank] = None
    transfer_id: Optional[ParamsTransferId] = None
    #: a decode leg sent while its prefill computes: no ``remote_block_ids``
    #: yet; the decode's ranks learn them from the producer's handshake port
    #: (:class:`BlocksQuery`, keyed by ``transfer_id``; see :data:`KV_FEATURE_RENDEZVOUS`)
    remote_blocks_pending: Optional[bool] = None
    #: with ``remote_blocks_pending``: the decode engine continues from the
    #: prefill's sampled token, which the rendezvous answer carries
    #: (:class:`BlocksAnswer` ``first_token_ids``), instead of computing it again
    first_token_pending: Optional[bool] = None

    @classmethod
    def from_dict(cls, data: Any) -> "KVTransferParams":
        """Validate an engine request's ``kv_transfer_params`` (``None`` means none).

        Raises :class:`~atom_kv.config.FieldError` with one line naming the
        key and what it allows.
        """
        params, errors = cls.parse(data)
        if errors:
            raise errors[0]
        return params

    @classmethod
    def parse(cls, data: Any) -> tuple["KVTransferParams", list[FieldError]]:
        """Validate ``data`` (``None`` means none) in one pass, leniently: the
        params of every key that validates, and one :class:`~atom_kv.config.FieldError`
        per key that does not (none when all do; the first is what
        :meth:`from_dict` raises). A request refused for one key can still name
        its producer by the others."""
        if data is None:
            return cls(), []
        if not isinstance(data, Mapping):
            return cls(), [FieldError("kv_transfer_params",
                                      f"`kv_transfer_params` must be an object, got {type(data).__name__}")]
        errors: list[FieldError] = []
        try:
            params = msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            valid, errors = validate_fields(data, cls)
            params = cls(**valid)
            errors = [_clipped(e) for e in errors] or [
                FieldError("kv_transfer_params", f"`kv_transfer_params`: {exc}")]
        layout_error = params._producer_layout_error()
        if layout_error is None:
            return params, errors
        return msgspec.structs.replace(params, **{layout_error.key: None}), [*errors, layout_error]

    def _producer_layout_error(self) -> Optional[FieldError]:
        """The key that places the producer's ranks where no rank can be, or None: its TP size
        times its pipeline stages at most :data:`MAX_PRODUCER_RANKS`, and its last rank's
        handshake port (:func:`handshake_port`) at most 65535. Each size is in range already."""
        tp, pp = self.producer_tp_size, self.remote_pp_size or 1
        if tp * pp > MAX_PRODUCER_RANKS:  # each is at most that: only a second stage gets here
            tp_key = "remote_tp_size" if self.remote_tp_size is not None else "tp_size"
            return FieldError("remote_pp_size", f"`remote_pp_size` times `{tp_key}` must be at most "
                                                f"{MAX_PRODUCER_RANKS} (the producer ranks one request may name), "
                                                f"got {pp} x {tp}")
        base = self.producer_handshake_port
        if base is None:
            return None
        dp = self.producer_dp_rank
        last = handshake_port(base, dp, tp, tp - 1, pp_rank=pp - 1, dp_size=max(self.remote_dp_size or 1, dp + 1))
        if last <= MAX_PORT:
            return None
        port_key = "remote_handshake_port" if self.remote_handshake_port is not None else "remote_port"
        return FieldError(port_key, f"`{port_key}` must leave room for every producer rank it names: with "
                                    f"{tp} TP rank(s), {pp} stage(s) and DP rank {dp} the last would listen on "
                                    f"port {last}, past {MAX_PORT}")

    def to_dict(self) -> dict[str, Any]:
        """The params as a JSON-ready dict, without the keys that are unset (None)."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}

    # The producer's coordinates; ATOM-style senders may give only the
    # unprefixed or the older key.
    @property
    def producer_handshake_port(self) -> Optional[int]:
        return self.remote_handshake_port if self.remote_handshake_port is not None else self.remote_port

    @property
    def producer_tp_size(self) -> int:
        return next((v for v in (self.remote_tp_size, self.tp_size) if v is not None), 1)

    @property
    def producer_dp_rank(self) -> int:
        return next((v for v in (self.remote_dp_rank, self.dp_rank) if v is not None), 0)

    def missing_for_load(self) -> Optional[str]:
        """The first key a decode-side load needs but these params lack, or None."""
        needed = {
            "remote_block_ids": [] if self.remote_blocks_pending else self.remote_block_ids,
            "remote_engine_id": self.remote_engine_id,
            "remote_host": self.remote_host,
            "transfer_id": self.transfer_id,
            "remote_handshake_port": self.producer_handshake_port,
        }
        return next((key for key, value in needed.items() if value is None), None)


#: longest error line about one key of kv_transfer_params (the value shown is cut to fit)
MAX_PARAMS_ERROR_CHARS = 300


def _clipped(error: FieldError) -> FieldError:
    """``error`` in at most :data:`MAX_PARAMS_ERROR_CHARS` characters (a value of a million
    block numbers is shown by its start)."""
    text = str(error)
    if len(text) <= MAX_PARAMS_ERROR_CHARS:
        return error
    return FieldError(error.key, text[: MAX_PARAMS_ERROR_CHARS - 24] + f"... ({len(text)} characters)")


def adoptable_transfer_id(value: Any) -> Optional[str]:
    """``value`` when a producer may use it as its transfer id (a
    :data:`TransferId`), else None."""
    try:
        return msgspec.convert(value, TransferId)
    except msgspec.ValidationError:
        return None


# --------------------------------------------------------------------------
# One encoder; one decode() over cached decoders (msgspec's own style).
# --------------------------------------------------------------------------
_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack-encode any message of this module."""
    return _encoder.encode(msg)


@functools.lru_cache(maxsize=64)
def _decoder(type_: Any) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(type_)


def prepare_decoders() -> None:
    """Build the decoder of every message of this module now, once per process.

    msgspec resolves a Struct's annotations when its first decoder is built:
    milliseconds (8 ms for :data:`HandshakeMessage`) that an engine's first
    handshake would otherwise pay. Workers call it when they start."""
    for value in list(globals().values()):
        if isinstance(value, type) and issubclass(value, msgspec.Struct) and value.__module__ == __name__:
            _decoder(value)
    for union in (HandshakeMessage, HandshakeReplyMessage, RegistrationMessage):
        _decoder(union)


def decode(data: Union[bytes, bytearray, memoryview], type_: type[T]) -> T:
    """Decode ``data`` as a message of ``type_`` (a Struct of this module, or
    a union of tagged ones such as :data:`RegistrationMessage`).

    Anything that is not a well-formed message of that type raises
    :class:`WireError` (and only that), naming the type and the reason.
    """
    try:
        return _decoder(cast(Hashable, type_)).decode(data)  # a type hashes; mypy cannot tell for type[T]
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"bad {_type_name(type_)} message ({len(data)} bytes): {exc}") from None
    except UnicodeDecodeError:  # a str field that is not UTF-8 (msgspec < 0.23; 0.23 raises DecodeError)
        raise WireError(f"bad {_type_name(type_)} message ({len(data)} bytes): a string is not UTF-8") from None
    except RecursionError:  # a few KiB of nested arrays (0x91 0x91 ...) exhaust the decoder's stack
        raise WireError(f"bad {_type_name(type_)} message ({len(data)} bytes): nested too deeply") from None


class _Versioned(msgspec.Struct):
    v: Any = None


_version_decoder = msgspec.msgpack.Decoder(_Versioned)


def peek_version(data: bytes) -> Optional[int]:
    """The ``v`` of a map-shaped message that failed to decode, when it has an
    integer one (to refuse a newer peer by naming both versions), else None."""
    try:
        v = _version_decoder.decode(data).v
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError):
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _type_name(type_: Any) -> str:
    args = get_args(type_)
    if args:
        return " or ".join(_type_name(a) for a in args)
    return getattr(type_, "__name__", str(type_))
