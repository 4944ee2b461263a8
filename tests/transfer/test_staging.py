"""The staging and batching code that GPU memory goes through, run on host
tensors through the host copier (only the device copies themselves differ)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch

from atom_kv.transfer import create_backend
from atom_kv.transfer._batched_copy import copy_ranges, cut_pieces, range_rows, row_unit
from atom_kv.transfer._regions import RegionTable
from atom_kv.transfer.staging import recv_staged, send_staged


def _naive(src: np.ndarray, so, dst: np.ndarray, do, sizes) -> None:
    for a, b, n in zip(so, do, sizes):
        dst[b : b + n] = src[a : a + n]


@pytest.mark.parametrize("block, n, shift", [(4096, 64, 0), (256, 300, 8), (96, 50, 4), (7, 40, 1)])
def test_copy_ranges_matches_one_copy_per_range(block, n, shift):
    rng = np.random.default_rng(block)
    src = rng.integers(0, 256, block * n + shift, dtype=np.uint8)
    dst = np.zeros_like(src)
    want = dst.copy()
    so = rng.permutation(n)[: n // 2] * block + shift
    do = rng.permutation(n)[: n // 2] * block
    sizes = np.full(len(so), block)
    copy_ranges(torch.from_numpy(src), so, torch.from_numpy(dst), do, sizes)
    _naive(src, so, want, do, sizes)
    assert np.array_equal(dst, want)


def test_copy_ranges_contiguous_and_mixed_sizes():
    src = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    dst = np.zeros_like(src)
    copy_ranges(torch.from_numpy(src), np.array([0, 4096]), torch.from_numpy(dst), np.array([8192, 12288]),
                np.array([4096, 8192]))
    assert np.array_equal(dst[8192 : 8192 + 12288], src[:12288]) and not dst[:8192].any()


def test_copy_ranges_is_one_batched_gather_however_many_blocks(monkeypatch):
    calls = []
    real = torch.Tensor.index_select

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_select", counting)
    src = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros_like(src)
    perm = np.random.default_rng(3).permutation(1024)
    copy_ranges(src, perm * 4096, dst, np.arange(1024) * 4096, np.full(1024, 4096))
    assert len(calls) == 1
    assert torch.equal(dst.view(1024, 4096), src.view(-1, 4096)[torch.from_numpy(perm)])


def test_units_and_rows():
    assert row_unit(np.array([4096, 8192]), np.array([12288])) == 4096
    assert row_unit(np.array([3]), np.array([4])) == 1
    assert range_rows(np.array([5, 0]), np.array([2, 3])).tolist() == [5, 6, 0, 1, 2]


def test_cut_pieces_splits_exactly_at_the_chunk():
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 10_000, 200)
    offsets = rng.integers(0, 1 << 20, 200)
    pieces = cut_pieces(offsets, sizes, 4096)
    assert all(int(s.sum()) <= 4096 for _, _, s in pieces)
    assert all(int(s.sum()) == 4096 for _, _, s in pieces[:-1])
    joined = [(int(i), int(o), int(s)) for idx, off, sz in pieces for i, o, s in zip(idx, off, sz)]
    # the sub-ranges cover each original range in order, without gaps
    pos = {}
    for i, o, s in joined:
        assert o == offsets[i] + pos.get(i, 0)
        pos[i] = pos.get(i, 0) + s
    assert [pos[i] for i in range(200)] == sizes.tolist()


class _Staged:
    """A staged region table over one host buffer, with small staging buffers (many pieces)."""

    def __init__(self, data: np.ndarray, chunk: int) -> None:
        self.data = data
        self.table = RegionTable(staging_pairs=1)
        self.table.add(data.ctypes.data, data.nbytes, 1, 1 << 16, staged=True)
        self.table.pool.nbytes = chunk  # the pool's buffers are larger: pieces use their first `chunk` bytes


def test_send_and_receive_staged_through_the_host_copier():
    src = np.random.default_rng(1).integers(0, 256, 1 << 18, dtype=np.uint8)
    dst = np.zeros_like(src)
    server, reader = _Staged(src, 5000), _Staged(dst, 3000)
    n = (1 << 18) // 4096
    perm = np.random.default_rng(2).permutation(n)
    sizes = np.full(n, 4096)
    s_off = perm * 4096 % (1 << 16)
    s_reg = perm * 4096 // (1 << 16)
    d_off = np.arange(n) * 4096 % (1 << 16)
    d_reg = np.arange(n) * 4096 // (1 << 16)
    a, b = socket.socketpair()
    deadline = time.monotonic() + 10
    t = threading.Thread(target=send_staged, args=(a, server.table, s_reg, s_off, sizes, deadline))
    t.start()
    recv_staged(b, reader.table, d_reg, d_off, sizes, deadline)
    t.join(5)
    assert np.array_equal(dst.reshape(n, 4096), src.reshape(n, 4096)[perm])
    a.close()
    b.close()


def test_an_aborted_staged_receive_settles_and_gives_the_buffers_back():
    dst = np.zeros(1 << 16, dtype=np.uint8)
    reader = _Staged(dst, 4096)
    a, b = socket.socketpair()
    a.sendall(bytes(range(256)) * 16)  # one piece, then nothing
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 1

    with pytest.raises(ConnectionAbortedError):
        recv_staged(b, reader.table, np.zeros(4, np.int64), np.arange(4) * 4096, np.full(4, 4096),
                    time.monotonic() + 5, stop)
    assert np.array_equal(dst[:4096], np.frombuffer(bytes(range(256)) * 16, np.uint8))
    with reader.table.pool.lease(time.monotonic() + 0.5):  # the one pair came back
        pass
    a.close()
    b.close()


def test_tcp_stages_gpu_memory_and_host_memory_only_when_asked():
    be = create_backend("tcp", key="staging-kinds")
    try:
        buf = np.zeros(1 << 14, dtype=np.uint8)
        be.register_memory(buf.ctypes.data, buf.nbytes, align=4096)
        assert not be._regions.staged.any() and be._regions.pool is None
        be.stage_host_memory = True
        be.register_memory(buf.ctypes.data, buf.nbytes, align=4096)
        assert be._regions.staged.tolist() == [False, True] and be._regions.pool is not None
    finally:
        be.close()
