"""The staging code that GPU memory goes through, run on host memory through
the host copier and FAKE device copiers (only the device copies themselves differ)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch

from atom_kv.config import KVTransferConfig
from atom_kv.testing.fake_copier import FakeDeviceCopier
from atom_kv.transfer import create_backend
from atom_kv.transfer._batched_copy import cut_pieces, range_rows
from atom_kv.transfer._regions import RegionTable
from atom_kv.transfer.staging import HostCopier, HostLane, StagedReceiver, StagingPool, recv_staged, send_staged


def test_range_rows():
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

    def __init__(self, data: np.ndarray, chunk: int, buffers: int = 2) -> None:
        self.data = data
        self.table = RegionTable(staging_pairs=1, staging_bytes=chunk, staging_buffers=buffers)
        self.table.add(data.ctypes.data, data.nbytes, 1, 1 << 16, staged=True)

    def use(self, copier) -> None:
        """Every region through ``copier`` (a FAKE device copier)."""
        self.table._copiers[-1] = copier


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
    with reader.table.pool.lease(time.monotonic() + 0.5):  # the one ring came back
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


class _LoggingLane(HostLane):
    """A lane of a FAKE device (host memory): copies done at once, fences and waits logged."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def fence(self, slot):
        self.log.append(("fence", self.name))
        return self.name

    def query(self, token):
        return False  # never complete before waited on: every fence shows up as a wait

    def wait(self, token):
        self.log.append(("wait", token))


class _FakeDeviceCopier(HostCopier):
    """A FAKE device copier on host memory (no GPU here) with a logging lane per ring."""

    def __init__(self, name: str, log: list) -> None:
        super().__init__()
        self.name, self.log, self.device = name, log, 0

    def lane(self):
        return _LoggingLane(self.name, self.log)


class _MixedRegions:
    """Six regions of 16 KiB: 0-1 host (the host copier), 2-3 and 4-5 on two fake devices."""

    def __init__(self, data: np.ndarray, log: list) -> None:
        host = HostCopier()
        self._copiers = [host, host, *[_FakeDeviceCopier("gpu0", log)] * 2, *[_FakeDeviceCopier("gpu1", log)] * 2]
        self._copiers[3] = self._copiers[2]
        self._copiers[5] = self._copiers[4]
        self._data = data
        self._addrs = np.array([data.ctypes.data + i * 16384 for i in range(6)], dtype=np.int64)
        self.pool = StagingPool(host, 1, nbytes=1 << 15, buffers=2)

    def addresses(self, regions):
        return self._addrs.take(regions)

    def copier(self, region):
        return self._copiers[region]


def test_a_piece_mixing_host_and_two_devices_uses_and_fences_each_region_s_copier():
    src = np.random.default_rng(8).integers(0, 256, 6 * 16384, dtype=np.uint8)
    dst = np.zeros_like(src)
    send_log: list = []
    recv_log: list = []
    server, reader = _MixedRegions(src, send_log), _MixedRegions(dst, recv_log)
    # 4 KiB blocks, every piece (32 KiB) mixing host, gpu0 and gpu1 regions, in both directions
    n = 24
    order = np.array([(i % 3) * 8 + i // 3 for i in range(n)])  # interleave the region kinds
    s_reg, s_off = order * 4096 // 16384, order * 4096 % 16384
    d_perm = np.random.default_rng(9).permutation(n)
    d_reg, d_off = d_perm * 4096 // 16384, d_perm * 4096 % 16384
    sizes = np.full(n, 4096)
    a, b = socket.socketpair()
    deadline = time.monotonic() + 10
    t = threading.Thread(target=send_staged, args=(a, server, s_reg, s_off, sizes, deadline))
    t.start()
    recv_staged(b, reader, d_reg, d_off, sizes, deadline)
    t.join(5)
    a.close()
    b.close()
    got = dst.reshape(-1, 4096)[d_perm]
    assert np.array_equal(got, src.reshape(-1, 4096)[order])
    for log in (send_log, recv_log):
        fenced = [name for kind, name in log if kind == "fence"]
        waited = [name for kind, name in log if kind == "wait"]
        # 3 pieces, each holding regions of both fake devices: each device fenced once per piece, each fence waited
        assert sorted(fenced) == ["gpu0"] * 3 + ["gpu1"] * 3
        assert sorted(waited) == sorted(fenced)


def _ranges(n: int, block: int, region: int, seed: int):
    perm = np.random.default_rng(seed).permutation(n)
    return perm * block // region, perm * block % region, perm


def test_the_reader_waits_only_for_a_buffer_it_is_about_to_reuse():
    """With fences that complete 50 ms after they were recorded (a slow FAKE
    device), each wait is for the buffer the next piece goes into, never
    for the piece just scattered; the sender's waits are for the piece it
    is about to send, gathered up to a ring ahead."""
    src = np.random.default_rng(1).integers(0, 256, 1 << 18, dtype=np.uint8)
    dst = np.zeros_like(src)
    server, reader = _Staged(src, 16384, buffers=4), _Staged(dst, 16384, buffers=4)
    s_copier, r_copier = FakeDeviceCopier(0.05, record=True), FakeDeviceCopier(0.05, record=True)
    server.use(s_copier)
    reader.use(r_copier)
    n = (1 << 18) // 4096  # 64 blocks: 16 pieces of 16 KiB, 4 buffers per ring
    s_reg, s_off, perm = _ranges(n, 4096, 1 << 16, 2)
    d_reg, d_off = np.arange(n) * 4096 // (1 << 16), np.arange(n) * 4096 % (1 << 16)
    a, b = socket.socketpair()
    deadline = time.monotonic() + 20
    t = threading.Thread(target=send_staged, args=(a, server.table, s_reg, s_off, np.full(n, 4096), deadline))
    t.start()
    recv_staged(b, reader.table, d_reg, d_off, np.full(n, 4096), deadline)
    t.join(10)
    a.close()
    b.close()
    assert np.array_equal(dst.reshape(n, 4096), src.reshape(n, 4096)[perm])
    log = r_copier.log
    fences = [slot for kind, slot in log if kind == "fence"]
    assert fences == [i % 4 for i in range(16)], "one buffer after the other, round the ring"
    # a wait for buffer s comes after the fence of s's previous piece and before s is filled again (or at the end)
    for i, (kind, slot) in enumerate(log):
        if kind == "wait":
            later = [s for k, s in log[i + 1:] if k == "fence"]
            assert not later or later[0] == slot, log
    assert r_copier.waits <= 16
    # the sender gathered a whole ring ahead: four fences before its first wait
    first_wait = next(i for i, (k, _) in enumerate(s_copier.log) if k == "wait")
    assert [s for k, s in s_copier.log[:first_wait] if k == "fence"] == [0, 1, 2, 3]


def test_a_connection_s_receiver_pipelines_from_one_job_to_the_next():
    """The last scatters of job 1 are still in flight while job 2 is received
    (the old reader waited for them before its next request); each job is
    reported settled once its copies are, in order, and idle() settles the rest."""
    src = np.random.default_rng(4).integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    reader = _Staged(dst, 4096, buffers=4)
    copier = FakeDeviceCopier(0.2)
    reader.use(copier)
    receiver = StagedReceiver(reader.table)
    settled: list[str] = []
    a, b = socket.socketpair()
    half = 1 << 15
    a.sendall(src.tobytes())
    deadline = time.monotonic() + 10
    receiver.receive(b, np.zeros(8, np.int64), np.arange(8) * 4096, np.full(8, 4096), deadline,
                     on_settled=lambda: settled.append("job 1"))
    assert settled == [], "job 1 reported settled while its copies were in flight"
    receiver.receive(b, np.zeros(8, np.int64), half + np.arange(8) * 4096, np.full(8, 4096), deadline,
                     on_settled=lambda: settled.append("job 2"))
    assert settled == ["job 1"], "job 2's pieces reused job 1's buffers: job 1 settled then, not before"
    receiver.idle()
    assert settled == ["job 1", "job 2"] and np.array_equal(dst, src)
    with reader.table.pool.lease(time.monotonic() + 0.5):  # the ring came back
        pass
    a.close()
    b.close()


def test_staged_tcp_over_a_slow_fake_device_reads_every_byte_across_many_jobs_on_one_connection():
    cfg = KVTransferConfig.from_dict({"kv_role": "kv_consumer", "tcp": {"streams": 1}, "staging": {"piece_bytes": 65536},
                                      "transfer_timeout_s": 30})
    src = np.random.default_rng(6).integers(0, 256, 3 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    with create_backend("tcp", cfg, key="slow-a") as a, create_backend("tcp", cfg, key="slow-b") as b:
        for be in (a, b):
            be.stage_host_memory = True
            be.staging_copier = FakeDeviceCopier(0.002)
        (ra,) = a.register_memory(src.ctypes.data, src.nbytes, align=4096)
        (rb,) = b.register_memory(dst.ctypes.data, dst.nbytes, align=4096)
        peer = b.add_peer(a.export_descriptor())
        n = src.nbytes // 4096
        perm = np.random.default_rng(7).permutation(n)
        ops = np.zeros((n, 5), dtype=np.int64)
        ops[:, 0], ops[:, 1], ops[:, 2], ops[:, 3], ops[:, 4] = rb, np.arange(n) * 4096, ra, perm * 4096, 4096
        for _ in range(2):
            dst[:] = 0
            h = b.read(peer, ops, timeout_s=30)  # 12 jobs of 256 KiB on the one connection
            assert h.wait(60) and h.error is None and h.wait_settled(5), h.error
            assert np.array_equal(dst.reshape(n, 4096), src.reshape(n, 4096)[perm])
