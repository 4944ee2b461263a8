"""gpu_ipc's logic between real processes, over the host stand-in of its
device seam (``atom_kv.transfer.gpu_ipc.host_seam``): the findings of the GPU review
that can be tested without a GPU. The contract suite (test_contract.py, spec
``gpu_ipc-hostseam-standin``) covers the rest of the backend the same way."""

from __future__ import annotations

import os
import resource
from typing import Any, Iterator, Optional

import numpy as np
import pytest

from atom_kv.config import KVTransferConfig
from atom_kv.transfer import ReadOp, TransferError
from atom_kv.transfer import _batched_copy, _grant
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
    """The host stand-in, logging the calls that order copies, with a written
    event that has a handle, and the peer's regions on "device 1", ours on
    "device 0" (two devices, as a read between two GPUs has)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list = []
        self.remote: set[int] = set()

    def written(self, device: int) -> _Written:
        return _Written(device, self.log)

    def export(self, ptr: int, size: int, device: int) -> _CountingExport:
        return _CountingExport(super().export(ptr, size, device), self.log)

    def open_peer(self, pid: int, pidfd: Optional[int]) -> _RecordingPeerMap:
        return _RecordingPeerMap(super().open_peer(pid, pidfd), self)

    def device_of(self, t: Any) -> int:
        return 1 if id(t) in self.remote else 0

    def order(self, stream: Any, device: int, events: list) -> None:
        self.log.append(("order", stream.device, tuple(events)))

    def record(self, stream: Any) -> Any:
        self.log.append(("record", stream.device))
        return ("fence", stream.device)

    def synchronize(self, event: Any) -> None:
        self.log.append(("sync", event))


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


def test_a_copy_failing_midway_fences_every_stream_and_the_handle_settles_after(monkeypatch) -> None:
    srv = _serve("gpu_ipc-hostseam-recording")
    r = _Reader(RecordingSeam())
    try:
        peer = r.backend.add_peer(srv.descriptor)
        real = _batched_copy.copy_ranges
        calls: list[int] = []

        def failing(*args: Any, **kwargs: Any) -> None:
            calls.append(1)
            if len(calls) == 2:
                raise MemoryError("out of memory for an index tensor")
            real(*args, **kwargs)
            r.seam.log.append(("copy",))

        monkeypatch.setattr(_batched_copy, "copy_ranges", failing)
        r.seam.log.clear()
        # three (remote region, local region) pairs: the second one fails
        h = r.read(peer, _ops([(0, 0), (20, 20), (40, 40)]))
        assert h.error is not None and "device copy failed" in h.error and "out of memory" in h.error, h.error
        log = r.seam.log
        assert len(calls) == 2, "the copies after the failure were still queued"
        # a fence on both devices' streams (the destination's and the source's), then waited on
        assert sorted(e for e in log if e[0] == "record") == [("record", 0), ("record", 1)]
        assert sorted(e for e in log if e[0] == "sync") == [("sync", ("fence", 0)), ("sync", ("fence", 1))]
        assert max(i for i, e in enumerate(log) if e[0] == "copy") < min(i for i, e in enumerate(log)
                                                                        if e[0] == "record")
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
        # both streams of each copy (ours on device 0, the peer's on device 1) wait on the producer's event
        assert orders and all(e[2] == (written,) for e in orders), orders
        assert {e[1] for e in orders} == {0, 1}
        first_record = min(i for i, e in enumerate(log) if e[0] == "record")
        assert max(i for i, e in enumerate(log) if e[0] == "order") < first_record
        # the handle finished only after every fence was waited on
        assert sorted(e for e in log if e[0] == "sync") == [("sync", ("fence", 0)), ("sync", ("fence", 1))]
        src = pattern(SIZE).reshape(-1, BLOCK)
        assert np.array_equal(r.dst.reshape(-1, BLOCK)[[0, 30]], src[[3, 50]])
    finally:
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
