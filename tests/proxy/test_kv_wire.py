"""The KV event decoder: vLLM's positional and map forms, ATOM's framing and variant, bad input counted as a
reason and never anything but a DecodeFailure."""

from __future__ import annotations

import msgspec
import pytest

from atom_kv.proxy.kv_events.wire import (
    AllBlocksCleared, BlockRemoved, BlockStored, BlockTransferred, DecodeFailure, EventBatch, EventDecoder,
    MapAllBlocksCleared, MapBlockRemoved, MapBlockStored, MapEventBatch, encode_seq,
)
from atom_kv.wire import WireError

pack = msgspec.msgpack.encode
BIG = (1 << 64) - 7  # vLLM's hashes are unsigned 64-bit: past 2^63


@pytest.fixture
def decoder() -> EventDecoder:
    return EventDecoder(1 << 20)


def test_vllm_positional_batch_in_three_frames(decoder):
    # exactly what older vLLM's array_like, tag=True Structs put on the wire
    payload = pack([1.5, [
        ["BlockStored", [BIG, 5], None, list(range(32)), 16, None, "GPU", None],
        ["BlockRemoved", [BIG], "GPU"],
        ["AllBlocksCleared"],
    ], 0])
    batch = decoder.decode_frames([b"", encode_seq(7), payload])
    assert (batch.seq, batch.ts, batch.dp_rank, batch.bad_events) == (7, 1.5, 0, 0)
    stored, removed, cleared = batch.events
    assert stored.kind == "BlockStored" and stored.block_hashes == [BIG, 5] and stored.parent_block_hash is None
    assert stored.token_ids == list(range(32)) and stored.block_size == 16 and stored.medium == "GPU"
    assert removed.kind == "BlockRemoved" and removed.block_hashes == [BIG]
    assert cleared.kind == "AllBlocksCleared" and cleared.medium is None


def test_vllm_map_batch_with_type_keys(decoder):
    payload = pack({"ts": 2.0, "data_parallel_rank": 1, "events": [
        {"type": "BlockStored", "block_hashes": [BIG], "parent_block_hash": 3, "token_ids": list(range(16)),
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None,
         "group_idx": 0, "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": None},
        {"type": "BlockRemoved", "block_hashes": [BIG], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ]})
    batch = decoder.decode_frames([b"topic", encode_seq(0), payload])
    assert (batch.seq, batch.dp_rank) == (0, 1)
    assert [e.kind for e in batch.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert batch.events[0].parent_block_hash == 3 and batch.events[0].kv_cache_spec_kind == "full_attention"


def test_our_structs_encode_to_what_the_decoder_reads_both_shapes(decoder):
    arr = pack(EventBatch(ts=0.0, events=[BlockStored(block_hashes=[1], parent_block_hash=None,
                                                      token_ids=[1] * 16, block_size=16)]))
    mp = pack(MapEventBatch(ts=0.0, events=[MapBlockStored(block_hashes=[1], token_ids=[1] * 16, block_size=16),
                                            MapBlockRemoved(block_hashes=[1]), MapAllBlocksCleared()]))
    assert msgspec.msgpack.decode(arr)[1][0][0] == "BlockStored"
    assert msgspec.msgpack.decode(mp)["events"][0]["type"] == "BlockStored"
    assert decoder.decode_payload(arr, None).events[0].block_hashes == [1]
    assert [e.kind for e in decoder.decode_payload(mp, None).events] == [
        "BlockStored", "BlockRemoved", "AllBlocksCleared"]


def test_atom_framing_and_its_variant(decoder):
    # ATOM main: one frame (or [topic, payload]), no seq; trailing defaults omitted; AllBlocksCleared
    # carries a medium; BlockTransferred; signed hashes accepted as well as unsigned ones
    payload = pack([3.0, [
        ["BlockStored", [-5, BIG], None, list(range(32)), 16],  # lora_id, medium, ... omitted: defaults
        ["BlockStored", [9], -5, list(range(16)), 16, None, "REMOTE"],
        ["BlockRemoved", [9]],
        ["AllBlocksCleared", "CPU"],
        ["BlockTransferred", [BIG], "GPU", "CPU"],
    ]])
    for frames in ([payload], [b"kv", payload]):
        batch = decoder.decode_frames(frames)
        assert batch.seq is None and batch.dp_rank is None and batch.bad_events == 0
        first, second, removed, cleared, moved = batch.events
        assert first.medium == "GPU" and first.group_idx == 0 and first.block_hashes == [-5, BIG]
        assert second.parent_block_hash == -5 and second.medium == "REMOTE"
        assert removed.medium == "GPU"
        assert cleared.kind == "AllBlocksCleared" and cleared.medium == "CPU"
        assert isinstance(moved, BlockTransferred) and (moved.from_medium, moved.to_medium) == ("GPU", "CPU")


def test_trailing_fields_a_newer_publisher_adds_are_ignored(decoder):
    payload = pack([0.0, [["BlockRemoved", [1], "GPU", 0, "a later field", 42],
                          ["AllBlocksCleared", None, "more"]], 0, "extra batch field"])
    batch = decoder.decode_payload(payload, 1)
    assert batch.bad_events == 0 and [e.kind for e in batch.events] == ["BlockRemoved", "AllBlocksCleared"]


def test_bytes_hashes_are_accepted(decoder):
    payload = pack([0.0, [["BlockRemoved", [b"\x01" * 32]]]])
    assert decoder.decode_payload(payload, None).events[0].block_hashes == [b"\x01" * 32]


def test_unknown_or_malformed_events_are_counted_and_the_rest_kept(decoder):
    good = ["BlockRemoved", [1]]
    payload = pack([0.0, [good, ["SomethingNew", 1, 2], ["BlockStored", "not a list"], good,
                          {"type": "BlockRemoved", "block_hashes": [2]}]])
    batch = decoder.decode_payload(payload, 4)
    assert batch.bad_events == 2
    assert [e.block_hashes for e in batch.events] == [[1], [1], [2]]


@pytest.mark.parametrize(("frames", "reason"), [
    ([b"", b"\x00" * 8, b"x", b"y"], "frames"),
    ([], "frames"),
    ([b"", b"\x00" * 7, pack([0.0, []])], "seq"),
    ([b"", encode_seq(-1), pack([0.0, []])], "seq"),
    ([b"", encode_seq(1), b"\xc1garbage"], "msgpack"),
    ([b"", encode_seq(1), b""], "msgpack"),
    ([b"", encode_seq(1), b"\x92\xcb"], "msgpack"),  # truncated
    ([b"", encode_seq(1), pack(["not a ts", []])], "schema"),
    ([b"", encode_seq(1), pack({"ts": 0.0})], "schema"),
    ([b"", encode_seq(1), b"\x91" * 5000 + b"\x90"], "schema"),  # nested arrays where a ts belongs
])
def test_bad_messages_raise_one_failure_naming_the_reason(decoder, frames, reason):
    with pytest.raises(DecodeFailure) as info:
        decoder.decode_frames(frames)
    assert info.value.reason == reason
    assert isinstance(info.value, WireError)


def test_an_oversize_payload_is_refused_before_decoding():
    decoder = EventDecoder(1000)
    payload = pack([0.0, [["BlockRemoved", list(range(500))]]])
    assert len(payload) > 1000
    with pytest.raises(DecodeFailure) as info:
        decoder.decode_frames([b"", encode_seq(0), payload])
    assert info.value.reason == "oversize"
    assert decoder.decode_frames([b"", encode_seq(0), pack([0.0, [["BlockRemoved", [1]]]])]).seq == 0


def test_arrays_nested_past_the_decoders_stack_are_refused(decoder):
    stored = msgspec.msgpack.encode(["BlockStored", [1], None, list(range(16)), 16, None, "GPU", None])
    # the same event with a ninth field (extra_keys, typed Any) nested 100,000 deep
    event = b"\x99" + stored[1:] + b"\x91" * 100_000 + b"\x90"
    payload = b"\x92" + pack(0.0) + b"\x91" + event
    with pytest.raises(DecodeFailure) as info:
        EventDecoder(1 << 22).decode_payload(payload, 0)
    assert info.value.reason == "msgpack"


def test_positional_events_need_their_required_fields(decoder):
    # a BlockStored without its token ids or block size is not one
    batch = decoder.decode_payload(pack([0.0, [["BlockStored", [1], None]]]), None)
    assert batch.events == [] and batch.bad_events == 1
    assert AllBlocksCleared().medium is None and BlockRemoved(block_hashes=[]).medium == "GPU"
