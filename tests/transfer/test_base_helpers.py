"""Unit tests for the pure chunking/merging helpers and their bulk (numpy)
counterparts used by the tcp and cma backends."""

from __future__ import annotations

import random

import numpy as np
import pytest

from atom_kv.transfer import MAX_REGION_BYTES, ChunkedRegion, ReadOp, chunk_sizes, merge_ops, split_pair
from atom_kv.transfer._regions import as_op_array, merge_op_array, out_of_bounds, split_large
from atom_kv.transfer.tcp import plan_jobs


# -- chunk_sizes -------------------------------------------------------------
def test_chunk_sizes_small_buffer_is_one_chunk() -> None:
    assert chunk_sizes(10_000, 100) == [10_000]


def test_chunk_sizes_respects_limit_and_alignment() -> None:
    sizes = chunk_sizes(1000, align=64, limit=300)
    assert sizes == [256, 256, 256, 232]
    assert all(s % 64 == 0 for s in sizes[:-1]) and sum(sizes) == 1000


def test_chunk_sizes_default_limit_is_below_2gib() -> None:
    block = 3 * 1024 * 1024
    sizes = chunk_sizes(5 << 30, align=block)
    assert sum(sizes) == 5 << 30
    assert all(s < (1 << 31) and s <= MAX_REGION_BYTES for s in sizes)
    assert all(s % block == 0 for s in sizes[:-1])


@pytest.mark.parametrize("size,align", [(0, 1), (-5, 1), (10, 0)])
def test_chunk_sizes_rejects_bad_input(size: int, align: int) -> None:
    with pytest.raises(ValueError):
        chunk_sizes(size, align)


def test_chunk_sizes_block_larger_than_limit() -> None:
    with pytest.raises(ValueError, match="larger than"):
        chunk_sizes(1000, align=500, limit=400)


# -- ChunkedRegion.locate ------------------------------------------------------
def test_locate_inside_one_chunk() -> None:
    r = ChunkedRegion((7, 8, 9), chunk_bytes=100, total=250)
    assert r.locate(110, 20) == [(8, 10, 20)]


def test_locate_across_chunks() -> None:
    r = ChunkedRegion((7, 8, 9), chunk_bytes=100, total=250)
    assert r.locate(90, 130) == [(7, 90, 10), (8, 0, 100), (9, 0, 20)]


def test_locate_last_short_chunk_and_bounds() -> None:
    r = ChunkedRegion((0, 1, 2), chunk_bytes=100, total=250)
    assert r.locate(200, 50) == [(2, 0, 50)]
    with pytest.raises(ValueError):
        r.locate(200, 51)
    with pytest.raises(ValueError):
        r.locate(-1, 5)


# -- split_pair ---------------------------------------------------------------
def test_split_pair_splits_on_both_sides() -> None:
    local = ChunkedRegion((0, 1), chunk_bytes=60, total=120)
    remote = ChunkedRegion((5, 6), chunk_bytes=50, total=100)
    ops = split_pair(local, 30, remote, 20, 70)
    assert ops == [
        ReadOp(0, 30, 5, 20, 30),
        ReadOp(1, 0, 6, 0, 40),
    ]
    assert sum(op.size for op in ops) == 70


def test_split_pair_byte_for_byte_model() -> None:
    rng = random.Random(3)
    local = ChunkedRegion((0, 1, 2, 3), chunk_bytes=37, total=140)
    remote = ChunkedRegion((10, 11, 12), chunk_bytes=50, total=150)
    lbuf = [[0] * 37 for _ in range(4)]
    rbuf = [[(r * 1000 + i) for i in range(50)] for r in range(3)]
    for _ in range(50):
        size = rng.randint(1, 100)
        lo, ro = rng.randint(0, 140 - size), rng.randint(0, 150 - size)
        for op in split_pair(local, lo, remote, ro, size):
            assert op.local_offset + op.size <= 37 and op.remote_offset + op.size <= 50
            for k in range(op.size):
                lbuf[op.local_region][op.local_offset + k] = rbuf[op.remote_region - 10][op.remote_offset + k]
        flat_l = [x for chunk in lbuf for x in chunk]
        flat_r = [x for chunk in rbuf for x in chunk]
        assert flat_l[lo : lo + size] == flat_r[ro : ro + size]


# -- merge_ops and the numpy merge ---------------------------------------------
def test_merge_ops_merges_contiguous_on_both_sides_only() -> None:
    ops = [
        ReadOp(0, 100, 1, 200, 100),
        ReadOp(0, 0, 1, 100, 100),  # before the first: merges
        ReadOp(0, 200, 1, 400, 100),  # local contiguous, remote not: stays
        ReadOp(0, 300, 2, 500, 100),  # other remote region
        ReadOp(0, 400, 2, 600, 0),  # empty: dropped
    ]
    assert merge_ops(ops) == [
        ReadOp(0, 0, 1, 100, 200),
        ReadOp(0, 200, 1, 400, 100),
        ReadOp(0, 300, 2, 500, 100),
    ]


def test_merge_ops_does_not_merge_across_regions() -> None:
    ops = [ReadOp(0, 0, 0, 0, 10), ReadOp(1, 10, 0, 10, 10)]
    assert merge_ops(ops) == ops


def _random_ops(rng: np.random.Generator, n: int) -> list[ReadOp]:
    blocks = rng.permutation(n)
    out = []
    for i in range(n):
        b = int(blocks[i]) if rng.random() < 0.3 else i  # mostly adjacent, some shuffled
        out.append(ReadOp(int(rng.integers(0, 2)), i * 16, 3, b * 16, 16 if rng.random() > 0.05 else 0))
    rng.shuffle(out)  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("seed", range(5))
def test_merge_op_array_equals_merge_ops(seed: int) -> None:
    ops = _random_ops(np.random.default_rng(seed), 300)
    expected = [tuple(o) for o in merge_ops(ops)]
    got = [tuple(int(x) for x in row) for row in merge_op_array(as_op_array(ops))]
    assert got == expected
    assert len(got) < len(ops)


def test_as_op_array_shapes() -> None:
    assert as_op_array([]).shape == (0, 5)
    with pytest.raises(ValueError):
        as_op_array(np.zeros((3, 4), dtype=np.int64))


def test_out_of_bounds() -> None:
    sizes = np.array([100, 50], dtype=np.uint64)
    ok = np.array([[0, 0, 100], [1, 10, 40]], dtype=np.int64)
    assert out_of_bounds(ok[:, 0], ok[:, 1], ok[:, 2], sizes) is None
    for bad in ([0, 1, 100], [2, 0, 1], [-1, 0, 1], [1, -5, 10], [0, 0, 0], [0, 2**62, 2**62]):
        t = np.array([[0, 0, 10], bad], dtype=np.int64)
        assert out_of_bounds(t[:, 0], t[:, 1], t[:, 2], sizes) == 1, bad


def test_split_large_and_plan_jobs_cover_every_byte_once() -> None:
    table = np.array([[0, 0, 0, 1000, 10_000], [1, 5, 2, 0, 300]], dtype=np.int64)
    pieces = split_large(table, 4096)
    assert int(pieces[:, 4].max()) <= 4096 and int(pieces[:, 4].sum()) == 10_300
    assert list(pieces[:3, 1]) == [0, 4096, 8192] and list(pieces[:3, 3]) == [1000, 5096, 9192]
    big = np.zeros((5000, 5), dtype=np.int64)
    big[:, 1] = big[:, 3] = np.arange(5000) * 8192
    big[:, 4] = 4096
    jobs = plan_jobs(big, streams=4)
    assert len(jobs) >= 4
    joined = np.concatenate(jobs)
    assert np.array_equal(joined, big)


def test_merge_op_array_equals_merge_ops_with_huge_offsets() -> None:
    # values beyond 31 bits take the general sort path
    ops = [op._replace(remote_offset=op.remote_offset + (1 << 40)) for op in _random_ops(np.random.default_rng(9), 200)]
    expected = [tuple(o) for o in merge_ops(ops)]
    got = [tuple(int(x) for x in row) for row in merge_op_array(as_op_array(ops))]
    assert got == expected


def test_merge_op_array_keeps_sorted_input_and_merges_all() -> None:
    ops = [ReadOp(0, i * 8, 0, i * 8, 8) for i in range(100)]
    got = merge_op_array(as_op_array(ops))
    assert got.tolist() == [[0, 0, 0, 0, 800]]


def test_read_handle_untracked_settles_on_finish() -> None:
    from atom_kv.transfer.base import ReadHandle

    h = ReadHandle()
    assert not h.settled()
    assert h._finish("boom") and not h._finish(None)
    assert h.error == "boom" and h.settled()


def test_read_state_settles_only_after_every_job_reported() -> None:
    from atom_kv.transfer._jobs import ReadState
    from atom_kv.transfer.base import ReadHandle

    h = ReadHandle()
    state = ReadState(h, rid=1, jobs=3)
    h._finish("deadline passed")  # what the deadline thread does
    assert h.done() and not h.settled()
    state.job_done("connection reset")  # a worker still inside recv comes back
    assert not h.settled()
    state.job_skipped()  # a queued job dropped unstarted
    assert not h.settled()
    state.job_done(None)
    assert h.settled() and h.error == "deadline passed"


def test_read_state_success() -> None:
    from atom_kv.transfer._jobs import ReadState
    from atom_kv.transfer.base import ReadHandle

    h = ReadHandle()
    state = ReadState(h, rid=2, jobs=2)
    state.job_done(None)
    assert not h.done()
    state.job_done(None)
    assert h.ok and h.settled()


def test_a_failed_read_handle_carries_a_typed_reason_next_to_its_words():
    from atom_kv.transfer import ReadFailure, ReadHandle

    h = ReadHandle()
    assert h._finish("tcp read 1: timed out after 1.00s", ReadFailure.TIMEOUT)
    assert not h._finish("later", ReadFailure.CLOSED)  # the first result wins, reason included
    assert (h.error, h.reason) == ("tcp read 1: timed out after 1.00s", ReadFailure.TIMEOUT)
    unnamed = ReadHandle()
    unnamed._finish("a backend that names no reason")
    assert unnamed.reason is ReadFailure.TRANSPORT
    ok = ReadHandle()
    ok._finish(None, ReadFailure.TIMEOUT)
    assert ok.error is None and ok.reason is None and ok.ok
