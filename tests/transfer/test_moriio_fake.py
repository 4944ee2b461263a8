"""MoriIOBackend against the FAKE mori.io (host-memory stand-in, no RDMA):
registration, descriptors, lazily cached sessions, completion, injected
failures, timeouts, peer removal, close, and a read from another process."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from atom_kv.config import KVTransferConfig
from atom_kv.transfer.memory import gpu
from atom_kv.transfer import ChunkedRegion, ReadOp, TransferError, create_backend, split_pair
from tests.transfer.fake_mori import FAKE_ROOT, use_fake

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def fake_mori():
    use_fake()
    import mori.io  # noqa: F401  (the fake)

    yield


def cfg(**kw) -> KVTransferConfig:
    return KVTransferConfig.from_dict({"kv_role": "kv_consumer", "backend": "moriio", **kw})


def pattern(n: int, seed: int = 7) -> ctypes.Array:
    return (ctypes.c_ubyte * n)(*[(i * 31 + seed) % 251 for i in range(n)])


class Pair:
    """A reader and a serving backend in this process, each with one buffer."""

    def __init__(self, size: int = 8192, reader_size: int | None = None, **config) -> None:
        self.src = pattern(size)
        self.dst = (ctypes.c_ubyte * (reader_size or size))()
        self.server = create_backend("moriio", cfg(**config), key="server-dp0-tp0")
        self.reader = create_backend("moriio", cfg(**config), key="reader-dp0-tp0")
        self.server_regions = self.server.register_memory(ctypes.addressof(self.src), size)
        self.reader_regions = self.reader.register_memory(ctypes.addressof(self.dst), len(self.dst))
        self.peer = self.reader.add_peer(self.server.export_descriptor())

    def close(self) -> None:
        self.reader.close()
        self.server.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def completion_threads(key: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"atomkv-moriio-completion-{key}" and t.is_alive()]


def test_read_copies_bytes_and_merges_ranges(pair):
    ops = [ReadOp(0, 100 + i * 64, 0, 1000 + i * 64, 64) for i in range(8)] + [ReadOp(0, 5000, 0, 0, 10)]
    h = pair.reader.read(pair.peer, ops, timeout_s=3)
    assert h.wait(3) and h.error is None
    assert h.num_ranges == 2 and h.nbytes == 8 * 64 + 10
    assert bytes(pair.dst[100:612]) == bytes(pair.src[1000:1512])
    assert bytes(pair.dst[5000:5010]) == bytes(pair.src[0:10])
    assert pair.reader._engine.fake_batch_reads == 1  # one session, one batch_read


def test_engine_key_config_and_rdma_backend(pair):
    engine = pair.reader._engine
    assert engine.key == "reader-dp0-tp0"
    assert (engine.config.host, engine.config.port) == ("127.0.0.1", 0)
    mori_io = sys.modules["mori.io"]
    (rdma,) = engine.fake_backends.values()
    assert list(engine.fake_backends) == [mori_io.BackendType.RDMA]
    assert rdma.poll_cq_mode == mori_io.PollCqMode.POLLING and rdma.enable_notification is False


def test_config_keys_reach_rdma_backend_config():
    be = create_backend(
        "moriio",
        cfg(qp_per_transfer=4, post_batch_size=16, num_worker_threads=2, moriio={"poll_cq_mode": "event"},
            enable_notification=True, max_send_wr=256, max_cqe_num=1024),
        key="cfg",
    )
    try:
        mori_io = sys.modules["mori.io"]
        rdma = be._engine.fake_backends[mori_io.BackendType.RDMA]
        assert (rdma.qp_per_transfer, rdma.post_batch_size, rdma.num_worker_threads) == (4, 16, 2)
        assert rdma.poll_cq_mode == mori_io.PollCqMode.EVENT and rdma.enable_notification is True
        assert (rdma.max_send_wr, rdma.max_cqe_num, rdma.max_msg_sge) == (256, 1024, 0)
    finally:
        be.close()


def test_xgmi_transport_needs_no_rdma_device(tmp_path):
    from atom_kv.transfer.moriio import MoriIOBackend

    be = MoriIOBackend(cfg(moriio={"transport": "xgmi"}), key="x", sysfs_dir=str(tmp_path))
    try:
        assert list(be._engine.fake_backends) == [sys.modules["mori.io"].BackendType.XGMI]
    finally:
        be.close()


def test_engine_start_failure_is_one_line_unavailable(monkeypatch):
    from atom_kv.transfer import BackendUnavailable

    def refuse(key, config):
        raise RuntimeError("hipErrorNoDevice:\n no ROCm-capable device is detected")

    monkeypatch.setattr(sys.modules["mori.io"], "IOEngine", refuse)
    with pytest.raises(BackendUnavailable) as info:
        create_backend("moriio", cfg(), key="nogpu")
    assert str(info.value) == (
        "MORI-IO unavailable: could not start the rdma IOEngine on 127.0.0.1: "
        "RuntimeError: hipErrorNoDevice: no ROCm-capable device is detected"
    )


def test_generated_keys_are_unique():
    a, b = create_backend("moriio", cfg()), create_backend("moriio", cfg())
    try:
        assert a.key != b.key and a.key.startswith("atom_kv-127.0.0.1-")
    finally:
        a.close()
        b.close()


def test_chunked_registration_and_reads_across_chunks():
    size, block = 10 * 512, 512
    src, dst = pattern(size, 3), (ctypes.c_ubyte * size)()
    server = create_backend("moriio", cfg(), key="s")
    reader = create_backend("moriio", cfg(), key="r")
    server.max_region_bytes = 3 * block + 100  # -> chunks of 3 blocks
    reader.max_region_bytes = 4 * block
    try:
        sids = server.register_memory(ctypes.addressof(src), size, align=block)
        rids = reader.register_memory(ctypes.addressof(dst), size, align=block)
        assert server.region_sizes == [1536, 1536, 1536, 512]
        assert reader.region_sizes == [2048, 2048, 1024]
        mems = sorted(server._engine._mems.values(), key=lambda m: m.addr)
        assert [m.addr - ctypes.addressof(src) for m in mems] == [0, 1536, 3072, 4608]
        peer = reader.add_peer(server.export_descriptor())
        remote = ChunkedRegion(tuple(sids), 1536, size)
        local = ChunkedRegion(tuple(rids), 2048, size)
        ops = split_pair(local, 0, remote, 0, size)
        h = reader.read(peer, ops, timeout_s=3)
        assert h.wait(3) and h.error is None, h.error
        assert bytes(dst) == bytes(src)
        # sessions exist only for the pairs actually used, not 3 x 4
        assert sorted(k[1:] for k in reader.session_keys) == sorted({(o.local_region, o.remote_region) for o in ops})
        assert len(reader.session_keys) < len(rids) * len(sids)
    finally:
        reader.close()
        server.close()


def test_sessions_are_lazy_cached_and_dropped_on_remove_peer():
    p = Pair(size=4096)
    try:
        engine = p.reader._engine
        assert p.reader.session_keys == [] and engine.fake_sessions_created == 0
        for _ in range(3):
            h = p.reader.read(p.peer, [ReadOp(0, 0, 0, 0, 128)], timeout_s=3)
            assert h.wait(3) and h.ok
        assert engine.fake_sessions_created == 1
        assert p.reader.session_keys == [("server-dp0-tp0", 0, 0)]
        p.reader.remove_peer(p.peer)
        assert p.reader.session_keys == []
        assert engine.fake_deregistered_engines == ["server-dp0-tp0"]
        h = p.reader.read(p.peer, [ReadOp(0, 0, 0, 0, 128)], timeout_s=3)
        assert h.done() and "unknown MORI-IO peer" in h.error
        p.peer = p.reader.add_peer(p.server.export_descriptor())
        h = p.reader.read(p.peer, [ReadOp(0, 0, 0, 0, 128)], timeout_s=3)
        assert h.wait(3) and h.ok
        assert engine.fake_sessions_created == 2
    finally:
        p.close()


def test_add_peer_is_idempotent_and_refreshes_regions(pair):
    engine = pair.reader._engine
    assert pair.reader.add_peer(pair.server.export_descriptor()) == pair.peer
    assert len(engine._remotes) == 1
    extra = pattern(256, 99)
    (rid,) = pair.server.register_memory(ctypes.addressof(extra), 256)
    h = pair.reader.read(pair.peer, [ReadOp(0, 0, rid, 0, 256)], timeout_s=3)
    assert h.done() and "remote region 1 is outside the 1 regions peer server-dp0-tp0 registered" in h.error
    pair.reader.add_peer(pair.server.export_descriptor())
    h = pair.reader.read(pair.peer, [ReadOp(0, 0, rid, 0, 256)], timeout_s=3)
    assert h.wait(3) and h.ok and bytes(pair.dst[:256]) == bytes(extra)


def test_bad_descriptors_are_one_line_errors(pair):
    with pytest.raises(TransferError, match="not a MORI-IO peer descriptor"):
        pair.reader.add_peer(b"\x93garbage")
    other = create_backend("moriio", cfg(moriio={"transport": "xgmi"}), key="xg")
    try:
        with pytest.raises(TransferError, match="set the same `moriio.transport` on both sides"):
            pair.reader.add_peer(other.export_descriptor())
    finally:
        other.close()


def test_out_of_bounds_read_is_rejected_before_issuing(pair):
    engine = pair.reader._engine
    h = pair.reader.read(pair.peer, [ReadOp(0, 0, 0, 8000, 500)], timeout_s=3)
    assert h.done() and "remote range [8000, 8500) is outside remote region 0 of peer server-dp0-tp0 (8192 bytes)" in h.error
    h = pair.reader.read(pair.peer, [ReadOp(0, 8100, 0, 0, 200)], timeout_s=3)
    assert h.done() and "local range [8100, 8300) is outside local region 0 (8192 bytes)" in h.error
    assert engine.fake_batch_reads == 0 and pair.reader.session_keys == []


def test_in_progress_is_observable_and_completes(pair):
    pair.reader._engine.fake_set_delay(0.3)
    h = pair.reader.read(pair.peer, [ReadOp(0, 0, 0, 0, 1024)], timeout_s=3)
    assert not h.done()
    assert h.wait(3) and h.ok
    assert bytes(pair.dst[:1024]) == bytes(pair.src[:1024])


def test_failed_status_carries_mori_code_and_message(pair):
    pair.reader._engine.fake_fail_next(1)
    h = pair.reader.read(pair.peer, [ReadOp(0, 0, 0, 0, 64)], timeout_s=3)
    assert h.wait(3)
    assert h.error.startswith("MORI-IO transfer failed: ERR_RDMA_OP (5): fake injected failure")
    assert "peer server-dp0-tp0" in h.error
    h = pair.reader.read(pair.peer, [ReadOp(0, 0, 0, 0, 64)], timeout_s=3)
    assert h.wait(3) and h.ok  # only the next one failed


def test_failure_injected_by_environment(monkeypatch):
    monkeypatch.setenv("FAKE_MORI_IO_FAIL_NEXT", "2")
    p = Pair(size=1024)
    try:
        results = []
        for _ in range(3):
            h = p.reader.read(p.peer, [ReadOp(0, 0, 0, 0, 64)], timeout_s=3)
            assert h.wait(3)
            results.append(h.error is None)
        assert results == [False, False, True]
    finally:
        p.close()


def test_one_failed_batch_fails_the_whole_read():
    p = Pair(size=4096)
    extra = pattern(512)
    try:
        (rid,) = p.server.register_memory(ctypes.addressof(extra), 512)
        p.reader.add_peer(p.server.export_descriptor())
        p.reader._engine.fake_fail_next(1, message="first batch broke")
        h = p.reader.read(p.peer, [ReadOp(0, 0, 0, 0, 64), ReadOp(0, 1024, rid, 0, 64)], timeout_s=3)
        assert h.wait(3) and "first batch broke" in h.error
    finally:
        p.close()


def test_hung_transfer_times_out_without_spinning(pair):
    pair.reader._engine.fake_hang_next(1)
    cpu0, t0 = time.process_time(), time.monotonic()
    h = pair.reader.read(pair.peer, [ReadOp(0, 0, 0, 0, 64)], timeout_s=0.6)
    assert not h.wait(0.3)
    assert h.wait(3)
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    assert "timed out after 0.6s" in h.error and "1 of 1 batches still in progress" in h.error
    assert 0.55 <= h.duration < 2.0
    assert cpu < 0.5 * wall, f"completion tracking used {cpu:.2f}s CPU in {wall:.2f}s"
    # timed out, but MORI still owns the destination: not settled
    assert not h.settled()
    # the tracker survives and keeps the hung status referenced
    h2 = pair.reader.read(pair.peer, [ReadOp(0, 0, 0, 0, 64)], timeout_s=3)
    assert h2.wait(3) and h2.ok and h2.settled()
    assert pair.reader._tracker.abandoned() == 1
    assert not h.settled()
    pair.reader.close()  # memory deregistered: nothing can write any more
    assert h.settled()


def test_remove_peer_fails_in_flight_reads(pair):
    pair.reader._engine.fake_hang_next(1)
    h = pair.reader.read(pair.peer, [ReadOp(0, 0, 0, 0, 64)], timeout_s=30)
    assert not h.done()
    pair.reader.remove_peer(pair.peer)
    assert h.wait(1) and "aborted: peer removed" in h.error
    pair.reader.remove_peer(pair.peer)  # unknown now: no-op


def test_close_is_idempotent_deregisters_and_stops_threads():
    p = Pair(size=2048)
    reader = p.reader
    reader._engine.fake_hang_next(1)
    h = reader.read(p.peer, [ReadOp(0, 0, 0, 0, 64)], timeout_s=30)
    assert completion_threads(reader.key)
    reader.close()
    assert h.wait(1) and "closed" in h.error
    assert completion_threads(reader.key) == []
    assert reader._engine.fake_deregistered_memory == 1
    assert reader._engine.fake_deregistered_engines == ["server-dp0-tp0"]
    reader.close()
    h = reader.read(p.peer, [ReadOp(0, 0, 0, 0, 64)], timeout_s=3)
    assert h.done() and "closed" in h.error
    with pytest.raises(TransferError, match="closed"):
        reader.export_descriptor()
    p.server.close()


def test_gpu_and_host_memory_locations():
    """Each region is registered on the memory it names (the tensor's own
    device), never on torch's current device."""
    be = create_backend("moriio", cfg(), key="loc")
    buf = (ctypes.c_ubyte * 256)()
    try:
        mori_io = sys.modules["mori.io"]
        (host_id,) = be.register_memory(ctypes.addressof(buf), 128)
        (gpu_id,) = be.register_memory(ctypes.addressof(buf) + 128, 128, memory=gpu(3))
        host, on_gpu = be._regions[host_id].desc, be._regions[gpu_id].desc
        assert (host.loc, host.device_id) == (mori_io.MemoryLocationType.CPU, -1)
        assert (on_gpu.loc, on_gpu.device_id) == (mori_io.MemoryLocationType.GPU, 3)
    finally:
        be.close()


SERVER = textwrap.dedent(
    """
    import ctypes, sys
    sys.path.insert(0, {repo!r})
    from tests.transfer.fake_mori import use_fake
    use_fake()
    from atom_kv.config import KVTransferConfig
    from atom_kv.transfer import create_backend
    n = 1 << 16
    buf = (ctypes.c_ubyte * n)(*[(i * 13 + 5) % 256 for i in range(n)])
    be = create_backend("moriio", KVTransferConfig(kv_role="kv_producer"), key="proc-server")
    be.register_memory(ctypes.addressof(buf), n, align=4096)
    print(be.export_descriptor().hex(), flush=True)
    sys.stdin.readline()
    be.close()
    """
)


def test_read_from_another_process_and_survive_its_death():
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER.format(repo=REPO)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
    )
    reader = create_backend("moriio", cfg(), key="proc-reader")
    try:
        line = proc.stdout.readline()
        assert line, "server process did not start"
        n = 1 << 16
        dst = (ctypes.c_ubyte * n)()
        reader.register_memory(ctypes.addressof(dst), n)
        peer = reader.add_peer(bytes.fromhex(line.strip()))
        h = reader.read(peer, [ReadOp(0, 0, 0, 4096, 8192), ReadOp(0, 8192, 0, 0, 100)], timeout_s=3)
        assert h.wait(3) and h.ok, h.error
        expected = bytes((i * 13 + 5) % 256 for i in range(n))
        assert bytes(dst[:8192]) == expected[4096:12288]
        assert bytes(dst[8192:8292]) == expected[:100]
        proc.kill()
        proc.wait(5)
        h = reader.read(peer, [ReadOp(0, 0, 0, 0, 64)], timeout_s=3)
        assert h.wait(3) and h.error.startswith("MORI-IO transfer failed: ERR_RDMA_OP (5): remote read failed")
    finally:
        reader.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        proc.stdin.close()
        proc.stdout.close()


def test_importing_atom_kv_never_imports_mori():
    code = (
        f"import sys; sys.path.insert(0, {FAKE_ROOT!r}); "
        "import atom_kv, atom_kv.transfer, atom_kv.transfer.moriio; "
        "assert 'mori' not in sys.modules, sorted(m for m in sys.modules if m.startswith('mori'))"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=30)
