"""gpu_ipc's read planning (one vectorised pass: bounds, pointers, runs), the
batched copies by address over a FAKE driver (no GPU here), and the deadline
thread's wake-ups."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

from atom_kv.transfer._deadlines import DeadlineWatch
from atom_kv.transfer._device_copy import AddressCopier, coalesce, copy_by_address
from atom_kv.transfer.base import ReadHandle
from atom_kv.transfer.gpu_ipc.plan import PairTable, Spans, plan_read

REGION = 1 << 16


def _table(n_local: int = 4, n_remote: int = 4, local_devices=None, remote_devices=None,
           local_sizes=None) -> PairTable:
    # the local regions are consecutive in memory (one buffer cut in chunks), the remote ones are not
    local = Spans.of([(1 << 30) + i * REGION for i in range(n_local)], local_sizes or [REGION] * n_local, local_devices or [0] * n_local)
    remote = Spans.of([(1 << 40) + i * 4 * REGION for i in range(n_remote)], [REGION] * n_remote,
                      remote_devices or [1] * n_remote)
    return PairTable(local, remote)


def _ops(rows) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


def test_pointers_are_base_plus_offset_and_runs_coalesce_across_consecutive_local_regions():
    table = _table()
    # region 0's last block and region 1's first are adjacent locally; the remote side continues in region 2
    ops = _ops([(0, REGION - 4096, 2, 0, 4096), (1, 0, 2, 4096, 4096), (3, 0, 0, 0, 4096)])
    plan, bad = plan_read(ops, table)
    assert bad is None and plan.nbytes == 3 * 4096 and plan.ranges == 2
    (batch,) = plan.batches
    assert (batch.dst_device, batch.src_device) == (0, 1)
    assert batch.dst.tolist() == [(1 << 30) + REGION - 4096, (1 << 30) + 3 * REGION]
    assert batch.src.tolist() == [(1 << 40) + 8 * REGION, 1 << 40]
    assert batch.size.tolist() == [8192, 4096]


def test_scattered_rows_stay_apart_in_the_order_given_and_empty_rows_are_dropped():
    perm = np.random.default_rng(1).permutation(64)
    ops = np.zeros((64, 5), dtype=np.int64)
    ops[:, 1] = perm * 4096 % REGION
    ops[:, 0] = perm * 4096 // REGION
    ops[:, 3] = np.arange(64) * 4096 % REGION
    ops[:, 2] = np.arange(64) * 4096 // REGION
    ops[:, 4] = 4096
    ops = np.concatenate([ops, _ops([(0, 0, 0, 0, 0)])])
    plan, bad = plan_read(ops, _table())
    assert bad is None and plan.ranges == 64 and plan.nbytes == 64 * 4096
    assert plan.batches[0].dst.tolist() == ((1 << 30) + perm * 4096).tolist()


def test_a_contiguous_read_of_many_rows_is_one_range():
    n = 64
    ops = np.zeros((n, 5), dtype=np.int64)
    ops[:, 1] = np.arange(n) * 1024
    ops[:, 3] = np.arange(n) * 1024
    ops[:, 4] = 1024
    plan, _ = plan_read(ops, _table())
    assert plan.ranges == 1 and plan.batches[0].size.tolist() == [n * 1024]


@pytest.mark.parametrize("row, local, words", [
    ((0, REGION - 4095, 0, 0, 4096), True, "local range (region 0, offset 61441, size 4096)"),
    ((4, 0, 0, 0, 4096), True, "local range (region 4,"),
    ((-1, 0, 0, 0, 4096), True, "local range (region -1,"),
    ((0, -4096, 0, 0, 4096), True, "local range (region 0, offset -4096,"),
    ((0, 0, 0, REGION - 1, 2), False, "remote range (region 0, offset 65535, size 2) is outside the regions "
                                      "peer p registered"),
    ((0, 0, 9, 0, 1), False, "remote range (region 9,"),
    # offset + size wraps past 2**63: still outside
    ((0, 0, 0, (1 << 63) - 2048, 4096), False, f"remote range (region 0, offset {(1 << 63) - 2048}, size 4096)"),
])
def test_every_row_is_bounds_checked_on_both_sides(row, local, words):
    ops = _ops([(1, 0, 1, 0, 4096), row])
    for table in (_table(), _table(local_sizes=[REGION, REGION, REGION, REGION - 4096 + 4096])):
        plan, bad = plan_read(ops, table)
        assert plan is None and bad.local is local
        assert words in bad.message("gpu_ipc read 7", "p"), bad.message("gpu_ipc read 7", "p")


def test_unequal_region_sizes_are_checked_per_row():
    table = _table(local_sizes=[REGION, 4096, REGION, REGION])
    plan, bad = plan_read(_ops([(1, 0, 0, 0, 8192)]), table)
    assert plan is None and bad.local and bad.row == (1, 0, 0, 0, 8192)
    plan, bad = plan_read(_ops([(1, 0, 0, 0, 4096)]), table)
    assert bad is None and plan.nbytes == 4096


def test_regions_on_several_gpus_make_one_batch_per_device_pair():
    table = _table(local_devices=[0, 0, 2, 2], remote_devices=[1, 3, 1, 3])
    ops = _ops([(0, 0, 0, 0, 4096), (2, 0, 0, 4096, 4096), (0, 4096, 1, 0, 4096), (3, 0, 3, 0, 4096)])
    plan, bad = plan_read(ops, table)
    assert bad is None
    pairs = {(b.dst_device, b.src_device): b.size.tolist() for b in plan.batches}
    assert pairs == {(0, 1): [4096], (2, 1): [4096], (0, 3): [4096], (2, 3): [4096]}


class FakeDriver:
    """A FAKE GPU driver over host memory: logs its calls and does the copies by address."""

    def __init__(self, has_batch: bool) -> None:
        self.has_batch = has_batch
        self.calls: list[tuple] = []

    def ensure_context(self, device: int) -> None:
        self.calls.append(("context", device))

    def copy(self, dst: int, src: int, size: int, stream: int) -> None:
        self.calls.append(("copy", size, stream))
        ctypes.memmove(dst, src, size)

    def copy_batch(self, dst, src, size, stream, device, dst_host, src_host) -> None:
        assert dst.dtype == src.dtype == size.dtype == np.uint64 and dst.flags.c_contiguous
        self.calls.append(("batch", len(size), stream, dst_host, src_host))
        copy_by_address(dst.astype(np.int64), src.astype(np.int64), size.astype(np.int64))


@pytest.mark.parametrize("batched", [True, False], ids=["cuMemcpyBatchAsync", "one-copy-per-range"])
def test_address_copier_makes_one_driver_call_per_batch_where_the_driver_has_it(batched):
    src = np.random.default_rng(2).integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    perm = np.random.default_rng(3).permutation(16)
    d = dst.ctypes.data + np.arange(16, dtype=np.int64) * 4096
    s = src.ctypes.data + perm.astype(np.int64) * 4096
    # strided views, as a plan's columns are
    pairs = np.stack([d, s], axis=1)
    driver = FakeDriver(batched)
    copier = AddressCopier(driver)
    copier.copy(77, 0, pairs[:, 0], pairs[:, 1], np.full(16, 4096, dtype=np.int64), dst_host=True)
    assert np.array_equal(dst.reshape(16, 4096), src.reshape(16, 4096)[perm])
    if batched:
        assert driver.calls == [("context", 0), ("batch", 16, 77, True, False)] and copier.calls == 1
    else:
        assert driver.calls[1:] == [("copy", 4096, 77)] * 16 and copier.calls == 16


def test_copy_by_address_and_coalesce_on_host_memory():
    src = np.random.default_rng(4).integers(0, 256, 1 << 15, dtype=np.uint8)
    dst = np.zeros_like(src)
    d = dst.ctypes.data + np.array([0, 100, 200, 1000], dtype=np.int64)  # a unit of 4: one memmove each
    s = src.ctypes.data + np.array([4, 104, 204, 2000], dtype=np.int64)
    n = np.array([100, 100, 50, 24], dtype=np.int64)
    merged = coalesce(d, s, n)
    assert [x.tolist() for x in merged] == [[d[0], d[3]], [s[0], s[3]], [250, 24]]
    copy_by_address(*merged)
    assert np.array_equal(dst[:250], src[4:254]) and np.array_equal(dst[1000:1024], src[2000:2024])


class _CountingCondition:
    """threading.Condition, counting notify() calls (the deadline thread's wake-ups)."""

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self.notified = 0

    def __enter__(self):
        return self._cond.__enter__()

    def __exit__(self, *exc):
        return self._cond.__exit__(*exc)

    def wait(self, timeout=None):
        return self._cond.wait(timeout)

    def notify(self) -> None:
        self.notified += 1
        self._cond.notify()


def test_the_deadline_thread_is_woken_only_when_the_earliest_deadline_changes():
    cond = _CountingCondition(threading.Condition())
    watch = DeadlineWatch("atomkv-test-deadlines", cond)  # type: ignore[arg-type]
    try:
        handles = [ReadHandle() for _ in range(5)]
        for i, h in enumerate(handles[:4]):
            watch.watch(h, 60 + i, f"read {i}")  # later and later: the earliest stays the first
        assert cond.notified == 1
        watch.watch(handles[4], 0.05, "read 4")  # earlier than all: the thread must wake for it
        assert cond.notified == 2
        assert handles[4].wait(5) and "timed out" in handles[4].error
        assert not any(h.done() for h in handles[:4])
    finally:
        watch.close()
