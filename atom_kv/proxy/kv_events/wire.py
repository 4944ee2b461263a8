"""The KV cache event wire of vLLM and ATOM, as msgspec Structs, and the one decoder of a received message.

A message is ZeroMQ frames: vLLM's ``[topic, seq, payload]`` (``seq`` 8 bytes big-endian, counting from
0 in each publisher process), or ATOM's ``[payload]`` / ``[topic, payload]`` without a seq. The payload
is one msgpack ``EventBatch`` (``ts``, ``events``, ``data_parallel_rank``) in one of two shapes:

- positional arrays: the batch and each event tagged by its class name as the first element (older
  vLLM, ATOM); trailing fields that equal their default may be left out (ATOM omits them), and
  trailing fields a newer publisher adds are ignored;
- maps: the batch a map, each event a map with a ``"type"`` key (vLLM since PR #42892).

Events: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared`` (ATOM's may name a ``medium``), and ATOM's
``BlockTransferred``. Block hashes are 64-bit ints, signed or unsigned (vLLM's exceed 2^63), or bytes.

:class:`EventDecoder` decodes one message and raises :class:`~atom_kv.wire.WireError` (only that) for
anything that is not one, naming the reason (:attr:`~DecodeFailure.reason` is the counter label).
A batch whose events fail the typed union as a whole is decoded event by event: the good events are
kept, the bad or unknown ones counted (:attr:`DecodedBatch.bad_events`).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Optional, Union

import msgspec

from atom_kv.wire import WireError

__all__ = [
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "BlockTransferred", "DecodeFailure", "DecodedBatch",
    "EventBatch", "EventDecoder", "MapAllBlocksCleared", "MapBlockRemoved", "MapBlockStored",
    "MapBlockTransferred", "MapEventBatch", "END_SEQ", "encode_seq",
]

#: a block hash: an int in int64 or uint64 range (msgpack carries both), or bytes (a full digest)
EngineHash = Union[int, Annotated[bytes, msgspec.Meta(max_length=64)]]
#: a token id: checked to be a uint32 where the index packs them (a range check here costs a third of decoding)
TokenId = int
#: a medium ("GPU", "CPU", "DISK", "REMOTE") or a cache-spec kind
ShortName = Annotated[str, msgspec.Meta(max_length=64)]
LoraName = Annotated[str, msgspec.Meta(max_length=256)]
BlockSize = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]

#: the replay end marker's seq (the payload is empty)
END_SEQ = -1


# --------------------------------------------------------------------------
# Positional form (array_like, tag = class name): older vLLM and ATOM
# --------------------------------------------------------------------------
class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A positional KV cache event; ``kind`` names it whatever its shape."""

    kind: ClassVar[str] = ""


class BlockStored(_ArrayEvent, tag="BlockStored"):
    """A run of full blocks became cached: ``block_hashes[i]`` holds ``token_ids[i*block_size:(i+1)*block_size]``,
    the first one's parent is ``parent_block_hash`` (None: the run starts the prompt)."""

    kind: ClassVar[str] = "BlockStored"
    block_hashes: list[EngineHash]
    parent_block_hash: Optional[EngineHash]
    token_ids: list[TokenId]
    block_size: BlockSize
    lora_id: Optional[int] = None
    medium: Optional[ShortName] = "GPU"
    lora_name: Optional[LoraName] = None
    extra_keys: Optional[list[Any]] = None
    group_idx: Optional[int] = 0
    kv_cache_spec_kind: Optional[ShortName] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    """Blocks left ``medium``."""

    kind: ClassVar[str] = "BlockRemoved"
    block_hashes: list[EngineHash]
    medium: Optional[ShortName] = "GPU"
    group_idx: Optional[int] = 0


class AllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    """Every block (of ``medium``, when ATOM names one) left the cache."""

    kind: ClassVar[str] = "AllBlocksCleared"
    medium: Optional[ShortName] = None


class BlockTransferred(_ArrayEvent, tag="BlockTransferred"):
    """ATOM: blocks moved between tiers without changing identity (GPU<->CPU/DISK, REMOTE->GPU, GPU->REMOTE)."""

    kind: ClassVar[str] = "BlockTransferred"
    block_hashes: list[EngineHash]
    from_medium: ShortName
    to_medium: ShortName
    group_idx: Optional[int] = 0


ArrayEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared, BlockTransferred]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One publish tick's events, positional (``[ts, events, data_parallel_rank]``)."""

    ts: float
    events: list[ArrayEvent]
    data_parallel_rank: Optional[int] = None


# --------------------------------------------------------------------------
# Map form (tag_field "type"): vLLM since PR #42892
# --------------------------------------------------------------------------
class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag_field="type", tag=True):
    kind: ClassVar[str] = ""


class MapBlockStored(_MapEvent, tag="BlockStored"):
    """:class:`BlockStored` as a map."""

    kind: ClassVar[str] = "BlockStored"
    block_hashes: list[EngineHash]
    token_ids: list[TokenId]
    block_size: BlockSize
    parent_block_hash: Optional[EngineHash] = None
    lora_id: Optional[int] = None
    medium: Optional[ShortName] = "GPU"
    lora_name: Optional[LoraName] = None
    extra_keys: Optional[list[Any]] = None
    group_idx: Optional[int] = 0
    kv_cache_spec_kind: Optional[ShortName] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    """:class:`BlockRemoved` as a map."""

    kind: ClassVar[str] = "BlockRemoved"
    block_hashes: list[EngineHash]
    medium: Optional[ShortName] = "GPU"
    group_idx: Optional[int] = 0


class MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    """:class:`AllBlocksCleared` as a map."""

    kind: ClassVar[str] = "AllBlocksCleared"
    medium: Optional[ShortName] = None


class MapBlockTransferred(_MapEvent, tag="BlockTransferred"):
    """:class:`BlockTransferred` as a map."""

    kind: ClassVar[str] = "BlockTransferred"
    block_hashes: list[EngineHash]
    from_medium: ShortName
    to_medium: ShortName
    group_idx: Optional[int] = 0


MapEvent = Union[MapBlockStored, MapBlockRemoved, MapAllBlocksCleared, MapBlockTransferred]


class MapEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """:class:`EventBatch` as a map."""

    ts: float
    events: list[MapEvent]
    data_parallel_rank: Optional[int] = None


# the fallback shapes: events one by one
class _LooseArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: Optional[int] = None


class _LooseMapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: Optional[int] = None


# --------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------
class DecodeFailure(WireError):
    """A message that is not a KV event message; ``reason`` is its counter label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class DecodedBatch:
    """One decoded message: its ``seq`` (None: the publisher sends none, as ATOM today), the batch's
    ``events`` (each with a ``kind``), ``dp_rank`` (None: not said) and how many events were unusable."""

    __slots__ = ("seq", "ts", "events", "dp_rank", "bad_events")

    def __init__(self, seq: Optional[int], ts: float, events: list[Any], dp_rank: Optional[int],
                 bad_events: int = 0) -> None:
        self.seq = seq
        self.ts = ts
        self.events = events
        self.dp_rank = dp_rank
        self.bad_events = bad_events


def encode_seq(seq: int) -> bytes:
    """``seq`` as its frame: 8 bytes big-endian (:data:`END_SEQ` signed)."""
    return seq.to_bytes(8, "big", signed=True)


def parse_seq(frame: bytes) -> int:
    """A seq frame as an int (:data:`END_SEQ` for the end marker); :class:`DecodeFailure` if not 8 bytes."""
    if len(frame) != 8:
        raise DecodeFailure("seq", f"seq frame of {len(frame)} bytes (expected 8)")
    return int.from_bytes(frame, "big", signed=True)


_ARRAY_HEADS = frozenset((*range(0x90, 0xA0), 0xDC, 0xDD))
_MAP_HEADS = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))


class EventDecoder:
    """Decodes received messages, each at most ``max_bytes`` of payload. Stateless after construction:
    one per subscriber thread (or bench) is enough, and any number can coexist."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes: must be >= 1, got {max_bytes!r}")
        self.max_bytes = max_bytes
        # one type per pair, so decode_frames picks either pair into the same two names
        self._array: msgspec.msgpack.Decoder[Union[EventBatch, MapEventBatch]] = msgspec.msgpack.Decoder(EventBatch)
        self._map: msgspec.msgpack.Decoder[Union[EventBatch, MapEventBatch]] = msgspec.msgpack.Decoder(MapEventBatch)
        self._loose_array: msgspec.msgpack.Decoder[Union[_LooseArrayBatch, _LooseMapBatch]] = (
            msgspec.msgpack.Decoder(_LooseArrayBatch))
        self._loose_map: msgspec.msgpack.Decoder[Union[_LooseArrayBatch, _LooseMapBatch]] = (
            msgspec.msgpack.Decoder(_LooseMapBatch))
        self._array_event = msgspec.msgpack.Decoder(ArrayEvent)
        self._map_event = msgspec.msgpack.Decoder(MapEvent)

    def decode_frames(self, frames: list[bytes]) -> DecodedBatch:
        """A live message: ``[topic, seq, payload]`` (vLLM) or ``[payload]`` / ``[topic, payload]`` (ATOM)."""
        if len(frames) == 3:
            seq = parse_seq(frames[1])
            if seq < 0:
                raise DecodeFailure("seq", f"negative seq {seq} on a live message")
            return self.decode_payload(frames[2], seq)
        if len(frames) in (1, 2):
            return self.decode_payload(frames[-1], None)
        raise DecodeFailure("frames", f"{len(frames)} frames (expected [topic, seq, payload], [topic, payload] "
                                      "or [payload])")

    def decode_payload(self, payload: bytes, seq: Optional[int]) -> DecodedBatch:
        """One ``EventBatch``, positional or map-shaped."""
        if len(payload) > self.max_bytes:
            raise DecodeFailure("oversize", f"payload of {len(payload)} bytes exceeds {self.max_bytes}")
        if not payload:
            raise DecodeFailure("msgpack", "empty payload")
        head = payload[0]
        if head in _ARRAY_HEADS:
            typed, loose = self._array, self._loose_array
        elif head in _MAP_HEADS:
            typed, loose = self._map, self._loose_map
        else:
            raise DecodeFailure("msgpack", f"payload starts with 0x{head:02x}, not a msgpack array or map")
        try:
            batch = typed.decode(payload)
            return DecodedBatch(seq, batch.ts, batch.events, batch.data_parallel_rank)
        except msgspec.ValidationError:
            pass  # an unknown or malformed event, or a bad batch: look event by event
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise DecodeFailure("msgpack", f"not msgpack ({len(payload)} bytes): {exc}") from None
        except RecursionError:
            raise DecodeFailure("msgpack", f"nested too deeply ({len(payload)} bytes)") from None
        try:
            loose_batch = loose.decode(payload)
        except msgspec.ValidationError as exc:
            raise DecodeFailure("schema", f"not an EventBatch ({len(payload)} bytes): {exc}") from None
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise DecodeFailure("msgpack", f"not msgpack ({len(payload)} bytes): {exc}") from None
        events, bad = [], 0
        for raw in loose_batch.events:
            data = bytes(raw)
            # each event by its own shape (a batch of one shape with events of the other is accepted too)
            decoder = self._array_event if data[:1] and data[0] in _ARRAY_HEADS else self._map_event
            try:
                events.append(decoder.decode(data))
            except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError, RecursionError):
                bad += 1
        return DecodedBatch(seq, loose_batch.ts, events, loose_batch.data_parallel_rank, bad)
