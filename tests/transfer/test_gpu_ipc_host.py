"""gpu_ipc's logic between real processes, over the host stand-in of its
device seam (``atom_kv.transfer.gpu_ipc.host_seam``): the findings of the GPU review
that can be tested without a GPU. The contract suite (test_contract.py, spec
``gpu_ipc-hostseam-standin``) covers the rest of the backend the same way."""

from __future__ import annotations

import os
import resource
import threading
from typing import Any, Iterator, Optional

import numpy as np
import pytest

from atom_kv.config import KVTransferConfig
from atom_kv.transfer import ReadOp, TransferError
from atom_kv.transfer import _grant
from atom_kv.transfer.gpu_ipc import host_seam as _host_seam
from atom_kv.transfer.gpu_ipc.host_seam import HostSeam, shared_buffer
from atom_kv.transfer.gpu_ipc import GpuIpcBackend, pid_exited
from tests.transfer._serve import ServerProc, pattern

_NO_SEAM = HostSeam.unavailable_reason()
pytestmark = pytest.mark.skipif(_NO_SEAM is not None, reason=_NO_SEAM or "")

BLOCK = 4096
SIZE = 1 << 18  # 64 blocks
REGION = 1 << 16  # 4 regions of 16 blocks on both sides
TIMEOUT = 5.0


class _Written:
    """The stand-in's written event, with a handle as CUDA's has (the host one has none)."""

    def __init__(self, device: int, log: list) -> None:
        self.handle = f"written-{os.getpid()}-{device}".encode()
        self._log = log

    def record(self) -> None:
        self._log.append(("written", self.handle))


class _CountingExport:
    def __init__(self, inner: Any, log: list) -> None:
        self._inner, self._log = inner, log

    def share(self, region: int, written: Optional[bytes]) -> Any:
        self._log.append(("share", region))
        return self._inner.share(region, written)

    def close(self) -> None:
        self._inner.close()


class _RecordingPeerMap:
    def __init__(self, inner: Any, seam: "RecordingSeam") -> None:
        self._inner, self._seam = inner, seam

    def region(self, r: Any) -> Any:
        t = self._inner.region(r)
        self._seam.remote.add(id(t))
        return t

    def written(self, r: Any) -> Any:
        return ("event", r.event_handle) if r.event_sync_required else None

    def close(self) -> None:
        self._seam.log.append(("peer closed", self._inner.pid))
        self._inner.close()


class RecordingSeam(HostSeam):
    """The host stand-in, logging the calls that order, copy and fence, and
    the events and streams it makes (a recording double of the CUDA seam),
    with a written event that has a handle, and the peer's regions on
    "device 1", ours on "device 0" (two devices, as a read between two GPUs
    has)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list = []
        self.remote: set[int] = set()
        self.events_made = 0
        self.streams_made = 0

    def written(self, device: int) -> _Written:
        return _Written(device, self.log)

    def export(self, ptr: int, size: int, device: int) -> _CountingExport:
        return _CountingExport(super().export(ptr, size, device), self.log)

    def open_peer(self, pid: int, pidfd: Optional[int]) -> _RecordingPeerMap:
        return _RecordingPeerMap(super().open_peer(pid, pidfd), self)

    def device_of(self, t: Any) -> int:
        return 1 if id(t) in self.remote else 0

    def event(self, device: int) -> Any:
        self.events_made += 1
        return super().event(device)

    def stream(self, device: int) -> Any:
        self.streams_made += 1
        return super().stream(device)

    def order(self, stream: Any, device: int, written: Any, ordering: Any) -> None:
        self.log.append(("order", stream.device, tuple(written)))

    def copy(self, stream: Any, batch: Any) -> None:
        self.log.append(("copy", stream.device, len(batch.size)))
        super().copy(stream, batch)

    def record(self, event: Any, stream: Any) -> None:
        self.log.append(("record", stream.device))
        super().record(event, stream)

    def query(self, event: Any) -> bool:
        self.log.append(("query", event.device))
        return super().query(event)

    def synchronize(self, event: Any) -> None:
        self.log.append(("sync", event.device))
        super().synchronize(event)


def recording_backend(config: Any, host: str, key: Optional[str]) -> GpuIpcBackend:
    return GpuIpcBackend(config, host=host, key=key, _seam=RecordingSeam())


def _config(**extra: Any) -> KVTransferConfig:
    return KVTransferConfig.from_dict({"kv_role": "kv_consumer", "transfer_timeout_s": TIMEOUT, **extra})


class _Reader:
    """A gpu_ipc reader in this process, on a memfd buffer of 4 regions."""

    def __init__(self, seam: Optional[HostSeam] = None) -> None:
        self.seam = seam or HostSeam()
        self.backend = GpuIpcBackend(_config(), key="reader", _seam=self.seam)
        self.backend.max_region_bytes = REGION
        self.buf = shared_buffer(SIZE)
        self.ids = self.backend.register_memory(self.buf.array.ctypes.data, SIZE, align=BLOCK)

    @property
    def dst(self) -> np.ndarray:
        return self.buf.array

    def read(self, peer: str, ops: list[ReadOp]) -> Any:
        h = self.backend.read(peer, ops, timeout_s=TIMEOUT)
        assert h.wait(TIMEOUT + 3), "read never finished"
        assert h.wait_settled(TIMEOUT + 3), "read never settled"
        return h

    def close(self) -> None:
        self.backend.close()
        self.buf.close_fd()


def _serve(name: str = "gpu_ipc-hostseam-standin", **config: Any) -> ServerProc:
    return ServerProc(name, size=SIZE, align=BLOCK, region_limit=REGION, config=config)


@pytest.fixture
def server() -> Iterator[ServerProc]:
    srv = _serve()
    yield srv
    srv.stop()


@pytest.fixture
def reader() -> Iterator[_Reader]:
    r = _Reader()
    yield r
    r.close()


def _ops(pairs: list[tuple[int, int]]) -> list[ReadOp]:
    """One block each: (local block, remote block), across region boundaries."""
    per = REGION // BLOCK
    return [ReadOp(lb // per, lb % per * BLOCK, rb // per, rb % per * BLOCK, BLOCK) for lb, rb in pairs]


def _memfds() -> int:
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:")
        except OSError:
            pass
    return n


def test_a_peer_is_watched_through_its_pidfd_above_fd_1024(server: ServerProc, reader: _Reader) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1200
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    filler = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]  # a real engine has this many open
    try:
        peer = reader.backend.add_peer(server.descriptor)
        pidfd = reader.backend._peers[peer].pidfd
        assert pidfd is not None and pidfd >= 1024, pidfd
        assert reader.read(peer, _ops([(0, 5), (20, 63)])).error is None  # select() would raise ValueError here
        src = pattern(SIZE).reshape(-1, BLOCK)
        assert np.array_equal(reader.dst.reshape(-1, BLOCK)[[0, 20]], src[[5, 63]])
        server.kill()
        assert pid_exited(pidfd)
        h = reader.read(peer, _ops([(1, 1)]))
        assert h.error is not None and "has exited" in h.error, h.error
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class TwoGpuSeam(RecordingSeam):
    """The recording double with our regions 2 and 3 on "device 2" (the rest on
    device 0), and a copy that fails on the lane of ``fail_on``."""

    def __init__(self, fail_on: Optional[int] = None) -> None:
        super().__init__()
        self.fail_on = fail_on
        self.local_on_2: set[int] = set()

    def alias(self, ptr: int, size: int, device: int) -> Any:
        t = super().alias(ptr, size, device)
        if ptr >= self.second_half:
            self.local_on_2.add(id(t))
        return t

    def device_of(self, t: Any) -> int:
        return 2 if id(t) in self.local_on_2 else super().device_of(t)

    def copy(self, stream: Any, batch: Any) -> None:
        if stream.device == self.fail_on:
            raise MemoryError("out of memory for a copy batch")
        super().copy(stream, batch)


def _two_gpu_reader(seam: TwoGpuSeam) -> _Reader:
    buf = shared_buffer(SIZE)
    seam.second_half = buf.array.ctypes.data + SIZE // 2  # regions 2 and 3
    r = _Reader.__new__(_Reader)
    r.seam, r.buf = seam, buf
    r.backend = GpuIpcBackend(_config(), key="reader-2gpu", _seam=seam)
    r.backend.max_region_bytes = REGION
    r.ids = r.backend.register_memory(buf.array.ctypes.data, SIZE, align=BLOCK)
    return r


def test_a_copy_failing_midway_fences_every_lane_used_and_the_handle_settles_after() -> None:
    srv = _serve("gpu_ipc-hostseam-recording")
    r = _two_gpu_reader(TwoGpuSeam(fail_on=2))
    try:
        peer = r.backend.add_peer(srv.descriptor)
        r.seam.log.clear()
        # local blocks 0 and 20 on device 0, 40 on device 2: two batches, two lanes; the second copy fails
        h = r.read(peer, _ops([(0, 0), (20, 20), (40, 40)]))
        assert h.error is not None and "device copy failed" in h.error and "out of memory" in h.error, h.error
        log = [e for e in r.seam.log if e[0] in ("copy", "record", "sync", "query")]
        # the first lane copied its batch (two ranges) and was fenced; the second was fenced though its copy failed
        assert [e for e in log if e[0] in ("copy", "record")] == [("copy", 0, 2), ("record", 0), ("record", 2)]
        # the handle settled only after both fences were waited on (the settling thread, for a failed read)
        # or found complete (the caller's own poll, when it came first)
        assert {e[1] for e in log[3:] if e[0] in ("sync", "query")} == {0, 2}, log
        assert h.settled()
        src = pattern(SIZE).reshape(-1, BLOCK)
        assert np.array_equal(r.dst.reshape(-1, BLOCK)[[0, 20]], src[[0, 20]])  # what was queued still ran
    finally:
        r.close()
        srv.stop()


def test_copies_start_after_the_producer_written_event_and_the_consumer_stream() -> None:
    srv = _serve("gpu_ipc-hostseam-recording")
    r = _Reader(RecordingSeam())
    try:
        peer = r.backend.add_peer(srv.descriptor)
        written = ("event", f"written-{srv.pid}--1".encode())  # the serving process's, from the grant
        r.seam.log.clear()
        assert r.read(peer, _ops([(0, 3), (30, 50)])).error is None
        log = r.seam.log
        orders = [e for e in log if e[0] == "order"]
        # the copy lane of our device waits on the producer's written event (the peer's regions are on device 1)
        assert orders == [("order", 0, (written,))], orders
        kinds = [e[0] for e in log if e[0] in ("order", "copy", "record")]
        assert kinds == ["order", "copy", "record"], log
        # finished only once its fence was looked at (a query, or a wait on it)
        first_record = kinds.index("record")
        assert any(e[0] in ("query", "sync") for e in log[first_record:]), log
        src = pattern(SIZE).reshape(-1, BLOCK)
        assert np.array_equal(r.dst.reshape(-1, BLOCK)[[0, 30]], src[[3, 50]])
    finally:
        r.close()
        srv.stop()


def test_a_read_makes_no_cuda_event_and_no_stream_in_steady_state() -> None:
    srv = _serve("gpu_ipc-hostseam-recording")
    r = _Reader(RecordingSeam())
    try:
        peer = r.backend.add_peer(srv.descriptor)
        streams = r.seam.streams_made
        assert streams == 1, "one copy stream per (peer, local device), made at add_peer"
        assert r.read(peer, _ops([(0, 0)])).error is None  # the pool's first fence event
        events = r.seam.events_made
        assert events == 2, "the lane's ordering event (add_peer) and one fence"
        r.seam.log.clear()
        rng = np.random.default_rng(3)
        for _ in range(20):
            pairs = list(zip(rng.permutation(64)[:16].tolist(), rng.permutation(64)[:16].tolist()))
            assert r.read(peer, _ops(pairs)).error is None
        assert r.seam.events_made == events and r.seam.streams_made == streams
        assert r.backend.fence_events() == 1
        # one order, one batched copy of all 16 ranges and one fence per read
        assert [e for e in r.seam.log if e[0] == "copy"] == [("copy", 0, 16)] * 20
        assert sum(e[0] == "record" for e in r.seam.log) == 20
    finally:
        r.close()
        srv.stop()


def test_done_polls_the_fence_and_completes_the_read_in_the_caller_thread() -> None:
    srv = _serve("gpu_ipc-hostseam-recording")
    r = _Reader(RecordingSeam())
    try:
        peer = r.backend.add_peer(srv.descriptor)
        r.seam.log.clear()
        h = r.backend.read(peer, _ops([(5, 9)]), timeout_s=TIMEOUT)
        assert not r.dst[5 * BLOCK : 6 * BLOCK].any(), "the host 'device' ran the copy before anybody looked"
        assert h.done() and h.settled() and h.error is None
        assert [e[0] for e in r.seam.log if e[0] in ("query", "sync")] == ["query"], "no wait: one poll did it"
        assert np.array_equal(r.dst[5 * BLOCK : 6 * BLOCK], pattern(SIZE)[9 * BLOCK : 10 * BLOCK])
    finally:
        r.close()
        srv.stop()


class StuckSeam(RecordingSeam):
    """The recording double with a 'device' whose fences complete only once ``release`` is set
    (a synchronize blocks on it, bounded, as a blocking-sync CUDA event wait sleeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.synced_by: list[str] = []

    def query(self, event: Any) -> bool:
        return self.release.is_set() and super().query(event)

    def synchronize(self, event: Any) -> None:
        self.synced_by.append(threading.current_thread().name)
        assert self.release.wait(30), "the test never released the device"
        super().synchronize(event)


def test_a_read_past_its_deadline_fails_at_once_and_is_settled_by_the_reaper_once_its_copies_are() -> None:
    srv = _serve("gpu_ipc-hostseam-recording")
    r = _Reader(StuckSeam())
    try:
        peer = r.backend.add_peer(srv.descriptor)
        h = r.backend.read(peer, _ops([(1, 2)]), timeout_s=0.2)
        assert h.wait(5) and h.error is not None and "timed out" in h.error, h.error
        assert not h.wait_settled(0.3), "settled while its copies were still queued on the device"
        r.seam.release.set()
        assert h.wait_settled(5)
        assert r.seam.synced_by and all(n.startswith("atomkv-gpu_ipc-settle-") for n in r.seam.synced_by)
        assert r.backend._completions.in_flight() == 0
    finally:
        r.seam.release.set()
        r.close()
        srv.stop()


def test_wait_without_spin_blocks_on_the_settling_thread() -> None:
    srv = _serve("gpu_ipc-hostseam-recording")
    seam = StuckSeam()
    be = GpuIpcBackend(_config(gpu_ipc={"wait_spin_us": 0}), key="nospin", _seam=seam)
    be.max_region_bytes = REGION
    buf = shared_buffer(SIZE)
    try:
        be.register_memory(buf.array.ctypes.data, SIZE, align=BLOCK)
        peer = be.add_peer(srv.descriptor)
        h = be.read(peer, _ops([(3, 4)]), timeout_s=TIMEOUT)
        threading.Timer(0.2, seam.release.set).start()
        assert h.wait(5) and h.error is None and h.settled()
        assert seam.synced_by and seam.synced_by[0].startswith("atomkv-gpu_ipc-settle-")
        assert np.array_equal(buf.array[3 * BLOCK : 4 * BLOCK], pattern(SIZE)[4 * BLOCK : 5 * BLOCK])
    finally:
        seam.release.set()
        be.close()
        buf.close_fd()
        srv.stop()


def test_close_settles_every_read_in_flight() -> None:
    srv = _serve("gpu_ipc-hostseam-recording")
    r = _Reader(StuckSeam())
    try:
        peer = r.backend.add_peer(srv.descriptor)
        handles = [r.backend.read(peer, _ops([(i, i)]), timeout_s=TIMEOUT) for i in range(4)]
        assert not any(h.done() for h in handles)
        threading.Timer(0.2, r.seam.release.set).start()
        r.backend.close()
        assert all(h.settled() for h in handles)
    finally:
        r.seam.release.set()
        r.close()
        srv.stop()


def test_kv_written_records_each_registered_device_written_event() -> None:
    seam = RecordingSeam()
    be = GpuIpcBackend(_config(), key="written", _seam=seam)
    buf = shared_buffer(SIZE)
    try:
        be.register_memory(buf.array.ctypes.data, SIZE, align=BLOCK)
        assert not [e for e in seam.log if e[0] == "written"]
        be.kv_written()
        be.kv_written()
        assert [e for e in seam.log if e[0] == "written"] == [("written", f"written-{os.getpid()}--1".encode())] * 2
    finally:
        be.close()
        buf.close_fd()


def test_every_grant_is_its_own_send_of_every_region() -> None:
    seam = RecordingSeam()
    be = GpuIpcBackend(_config(), key="sends", _seam=seam)
    be.max_region_bytes = REGION
    buf = shared_buffer(SIZE)
    readers = [_Reader(), _Reader()]
    try:
        ids = be.register_memory(buf.array.ctypes.data, SIZE, align=BLOCK)
        assert not [e for e in seam.log if e[0] == "share"], "nothing is shared before a reader asks"
        for rd in readers:
            rd.backend.add_peer(be.export_descriptor())
        # torch's protocol: one ref counter per send, so one send per reader, never one handed to two
        assert sorted(e[1] for e in seam.log if e[0] == "share") == sorted(ids * len(readers))
    finally:
        for rd in readers:
            rd.close()
        be.close()
        buf.close_fd()


def test_each_peer_allocation_is_mapped_once_and_let_go_at_remove_peer_and_close(server: ServerProc) -> None:
    gets: list[int] = []
    real = _host_seam.pidfd_getfd
    r = _Reader(RecordingSeam())
    before = _memfds()
    try:
        _host_seam.pidfd_getfd = lambda pidfd, fd: gets.append(fd) or real(pidfd, fd)
        first = r.backend.add_peer(server.descriptor)
        second = r.backend.add_peer(server.descriptor)
        assert len(gets) == 2, "the peer's 4 regions live in one memfd: one open per peer"
        assert _memfds() == before + 2
        assert r.read(first, _ops([(0, 0)])).error is None
        r.backend.remove_peer(first)
        assert ("peer closed", server.pid) in r.seam.log and _memfds() == before + 1
        h = r.backend.read(first, _ops([(0, 0)]), timeout_s=TIMEOUT)
        assert h.wait(1) and h.error is not None and "unknown peer" in h.error
        assert r.read(second, _ops([(1, 1)])).error is None
        r.backend.close()
        assert r.seam.log.count(("peer closed", server.pid)) == 2
        assert _memfds() == before - 1  # both peers' mappings, and the duplicate behind our own regions
    finally:
        _host_seam.pidfd_getfd = real
        r.close()


def test_memory_that_cannot_be_shared_refuses_the_grant_with_a_transfer_error() -> None:
    serving = GpuIpcBackend(_config(), key="unshareable", _seam=HostSeam())
    plain = np.zeros(SIZE, dtype=np.uint8)  # not in a memfd: the stand-in's "cudaMallocAsync memory"
    r = _Reader()
    try:
        serving.register_memory(plain.ctypes.data, SIZE, align=BLOCK)  # no exception: auto must still start
        with pytest.raises(TransferError, match="not in a memfd"):
            r.backend.add_peer(serving.export_descriptor())
        assert serving.stats().get("export") == 1
    finally:
        r.close()
        serving.close()


def test_a_peer_gone_between_its_grant_and_pidfd_open_is_a_transfer_error(monkeypatch, reader: _Reader) -> None:
    srv = _serve()
    real = _grant.request_grant

    def grant_then_die(*args: Any, **kwargs: Any) -> Any:
        grant = real(*args, **kwargs)
        srv.kill()  # SIGKILL and reaped: its pid names nobody now
        return grant

    monkeypatch.setattr(_grant, "request_grant", grant_then_die)
    try:
        with pytest.raises(TransferError, match="gone since its grant|exited"):
            reader.backend.add_peer(srv.descriptor)
        assert reader.backend._peers == {}
    finally:
        srv.stop()
