import pytest

from atom_kv.connector.layout import (
    HeadOverlap,
    LayoutError,
    TensorLayout,
    block_runs,
    head_overlaps,
    head_range,
    plan_reads,
)
from atom_kv.transfer.base import ChunkedRegion


def test_head_ranges_and_overlaps_for_heterogeneous_tp():
    assert head_range(8, 2, 1) == (4, 8)
    # consumer TP1 reads heads 0-3 from rank 0 and 4-7 from rank 1 of a TP2 producer
    assert head_overlaps(8, 1, 0, 2) == [HeadOverlap(0, 0, 0, 4), HeadOverlap(1, 4, 0, 4)]
    # consumer TP2 rank 1 reads heads 4-7 = local 4-7 of a TP1 producer
    assert head_overlaps(8, 2, 1, 1) == [HeadOverlap(0, 0, 4, 4)]
    assert head_overlaps(8, 4, 3, 2) == [HeadOverlap(1, 0, 2, 2)]
    assert head_overlaps(1, 2, 1, 4, is_mla=True) == [HeadOverlap(1, 0, 0, 1)]


def test_indivisible_heads_are_a_clear_error():
    with pytest.raises(LayoutError, match="num_kv_heads 6 is not divisible by the remote TP size 4"):
        head_overlaps(6, 2, 0, 4)


def test_block_runs():
    assert block_runs([3, 4, 5, 9], [10, 11, 12, 13]) == [(3, 10, 3), (9, 13, 1)]
    with pytest.raises(LayoutError):
        block_runs([1], [1, 2])


def _t(layer, kind, block_bytes, n, chunk=None):
    total = block_bytes * n
    chunk = chunk or total
    ids = tuple(range(100 * layer + (kind == "v") * 50, 100 * layer + (kind == "v") * 50 + -(-total // chunk)))
    return TensorLayout(layer, kind, ChunkedRegion(ids, chunk, total), block_bytes, n)


def test_full_block_runs_merge_into_one_op_per_tensor():
    local = [_t(0, "k", 64, 10), _t(0, "v", 64, 10)]
    remote = [_t(0, "k", 64, 20), _t(0, "v", 64, 20)]
    ops = plan_reads(local, remote, HeadOverlap(0, 0, 0, 4), block_runs([0, 1, 2], [5, 6, 7]), local_heads=4, remote_heads=4)
    assert [(o.local_offset, o.remote_offset, o.size) for o in ops] == [(0, 320, 192), (0, 320, 192)]


def test_head_slices_for_half_the_heads():
    local = [_t(0, "k", 32, 4)]   # 2 local heads of 16 bytes
    remote = [_t(0, "k", 64, 4)]  # 4 remote heads
    ops = plan_reads(local, remote, HeadOverlap(0, 0, 2, 2), [(0, 1, 2)], local_heads=2, remote_heads=4)
    assert [(o.local_offset, o.remote_offset, o.size) for o in ops] == [(0, 64 + 32, 32), (32, 128 + 32, 32)]


def test_ops_split_at_chunk_boundaries():
    local = [_t(0, "k", 64, 8)]
    remote = [_t(0, "k", 64, 8, chunk=128)]  # 2 blocks per chunk
    ops = plan_reads(local, remote, HeadOverlap(0, 0, 0, 1), [(0, 1, 3)], local_heads=1, remote_heads=1)
    assert sum(o.size for o in ops) == 192 and len({o.remote_region for o in ops}) == 2


def test_out_of_range_and_missing_tensors_are_errors():
    with pytest.raises(LayoutError, match="remote block"):
        plan_reads([_t(0, "k", 64, 8)], [_t(0, "k", 64, 2)], HeadOverlap(0, 0, 0, 1), [(0, 1, 2)], local_heads=1, remote_heads=1)
    with pytest.raises(LayoutError, match="no v cache for layer 0"):
        plan_reads([_t(0, "v", 64, 8)], [_t(0, "k", 64, 8)], HeadOverlap(0, 0, 0, 1), [(0, 1, 1)], local_heads=1, remote_heads=1)
    with pytest.raises(LayoutError, match="remote block is 48 bytes"):
        plan_reads([_t(0, "k", 64, 8)], [_t(0, "k", 48, 8)], HeadOverlap(0, 0, 0, 1), [(0, 1, 1)], local_heads=1, remote_heads=1)


@pytest.mark.parametrize("overlap,lh,rh,lbb,rbb", [
    (HeadOverlap(0, 0, 0, 4), 4, 4, 64, 64),   # equal TP: whole blocks
    (HeadOverlap(0, 0, 2, 2), 2, 4, 32, 64),   # half the producer's heads
    (HeadOverlap(1, 2, 0, 2), 4, 2, 64, 32),   # half the consumer's heads
])
def test_plan_array_matches_plan(overlap, lh, rh, lbb, rbb):
    from atom_kv.connector.layout import ReadPlanner

    local = [_t(l, k, lbb, 16) for l in range(2) for k in ("k", "v")]
    remote = [_t(l, k, rbb, 16) for l in range(2) for k in ("k", "v")]
    planner = ReadPlanner(local, remote, overlap, local_heads=lh, remote_heads=rh)
    runs = block_runs([0, 1, 2, 7, 9, 10], [4, 5, 6, 1, 12, 13])
    as_list = sorted(tuple(op) for op in planner.plan(runs))
    as_array = sorted(tuple(int(x) for x in row) for row in planner.plan_array(runs))
    assert as_list == as_array and len(as_list) > 0
    with pytest.raises(LayoutError):
        planner.plan_array([(15, 0, 2)])
