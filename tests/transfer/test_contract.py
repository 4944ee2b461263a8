"""The contract every transfer backend must meet, run against a real serving
process per backend listed in ``tests/transfer/backends.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import numpy as np
import pytest

from atom_kv.config import KVTransferConfig
from atom_kv.transfer import ChunkedRegion, ReadFailure, ReadOp, TransferBackend, TransferError, split_pair
from tests.transfer._serve import ServerProc, pattern, place_owned
from tests.transfer.backends import SPECS, BackendSpec

BLOCK = 4096
SIZE = 1 << 20  # 256 blocks
REMOTE_LIMIT = 64 * 1024  # remote chunks of 16 blocks
LOCAL_LIMIT = 48 * 1024  # local chunks of 12 blocks: boundaries differ on both sides
TIMEOUT = 2.0


def _params(specs: list[BackendSpec]) -> list[Any]:
    return [pytest.param(s, id=s.name, marks=[pytest.mark.gpu] if s.device != "cpu" else []) for s in specs]


@pytest.fixture(params=_params(SPECS), scope="module")
def spec(request: pytest.FixtureRequest) -> BackendSpec:
    spec: BackendSpec = request.param
    reason = spec.reason_to_skip()
    if reason:
        pytest.skip(reason)
    spec.run_setup()
    return spec


def _config(spec: BackendSpec, **extra: Any) -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_role": "kv_consumer",
            "handshake_timeout_s": TIMEOUT,
            "transfer_timeout_s": TIMEOUT,
            **spec.config,
            **extra,
        }
    )


def _start(spec: BackendSpec, **config: Any) -> ServerProc:
    return ServerProc(
        spec.name, size=SIZE, align=BLOCK, region_limit=REMOTE_LIMIT,
        config={"transfer_timeout_s": TIMEOUT, "handshake_timeout_s": TIMEOUT, **config},
    )


@pytest.fixture(scope="module")
def server(spec: BackendSpec) -> Iterator[ServerProc]:
    srv = _start(spec)
    yield srv
    srv.stop()


class Reader:
    """The reading side in this process: backend, destination buffer, chunk maps."""

    def __init__(self, spec: BackendSpec, srv: ServerProc, **config: Any) -> None:
        self.backend: TransferBackend = spec.create(_config(spec, **config), key=f"reader-{spec.name}")
        self.backend.max_region_bytes = LOCAL_LIMIT
        spec.prepare(self.backend)
        self._dst, ptr, memory, self._owner = place_owned(np.zeros(SIZE, dtype=np.uint8), spec.device)
        ids = self.backend.register_memory(ptr, SIZE, align=BLOCK, memory=memory)
        self.local = ChunkedRegion(tuple(ids), LOCAL_LIMIT, SIZE)
        self.remote = ChunkedRegion(tuple(srv.region_ids), REMOTE_LIMIT, srv.size)
        self.src = pattern(SIZE)
        self.peer = ""

    @property
    def dst(self) -> np.ndarray:
        """The destination's bytes (a host copy when it lives on a GPU)."""
        return self._dst if isinstance(self._dst, np.ndarray) else self._dst.cpu().numpy()

    def fill(self, value: int, end: int = SIZE) -> None:
        self._dst[:end] = value

    def connect(self, srv: ServerProc) -> str:
        self.peer = self.backend.add_peer(srv.descriptor)
        return self.peer

    def block_ops(self, pairs: list[tuple[int, int]], nblocks: int = 1) -> list[ReadOp]:
        """Ops copying remote block run ``rb`` to local block ``lb`` for each pair."""
        ops: list[ReadOp] = []
        for lb, rb in pairs:
            ops += split_pair(self.local, lb * BLOCK, self.remote, rb * BLOCK, nblocks * BLOCK)
        return ops

    def read_ok(self, ops: list[ReadOp]) -> None:
        h = self.backend.read(self.peer, ops, timeout_s=TIMEOUT)
        assert h.wait(TIMEOUT + 3), "read handle never finished"
        assert h.error is None and h.reason is None, h.error

    def close(self) -> None:
        self.backend.close()
        if self._owner is not None:
            self._owner.close_fd()


#: set in a test's own process (see :func:`_in_own_process`)
_ISOLATED = "ATOMKV_TEST_IN_OWN_PROCESS"


def _in_own_process(spec: BackendSpec, request: pytest.FixtureRequest) -> bool:
    """For a GPU spec, run this test alone in a fresh pytest process and say
    so (the caller then returns): a test that kills an exporter under copies
    in flight, or unmaps exports, can poison the CUDA context of the process
    it runs in, and with it every later GPU test of the run."""
    if spec.device != "cuda" or os.environ.get(_ISOLATED):
        return False
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", request.node.nodeid],
        env={**os.environ, _ISOLATED: "1"}, cwd=str(request.config.rootpath), capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{request.node.nodeid} in its own process:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
    return True


@pytest.fixture
def reader(spec: BackendSpec, server: ServerProc) -> Iterator[Reader]:
    r = Reader(spec, server)
    r.connect(server)
    yield r
    r.close()


def test_registration_chunks_and_descriptor(server: ServerProc, reader: Reader) -> None:
    # the serving process chunked 1 MiB at a 64 KiB limit, we at 48 KiB
    assert server.region_ids == list(range(SIZE // REMOTE_LIMIT))
    assert list(reader.local.region_ids) == list(range(-(-SIZE // LOCAL_LIMIT)))
    assert isinstance(server.descriptor, bytes) and server.descriptor
    assert reader.peer


def test_contiguous_read_spans_chunks(reader: Reader) -> None:
    reader.read_ok(reader.block_ops([(0, 0)], nblocks=SIZE // BLOCK))
    assert np.array_equal(reader.dst, reader.src)


def test_unaligned_range_across_chunk_boundaries(reader: Reader) -> None:
    # 100 KiB starting 1 KiB before a remote chunk boundary, to a local offset
    # that crosses two local boundaries
    ops = split_pair(reader.local, 40 * 1024 + 17, reader.remote, REMOTE_LIMIT - 1024, 100 * 1024)
    assert len({op.remote_region for op in ops}) >= 2 and len({op.local_region for op in ops}) >= 2
    reader.read_ok(ops)
    lo, ro = 40 * 1024 + 17, REMOTE_LIMIT - 1024
    assert np.array_equal(reader.dst[lo : lo + 100 * 1024], reader.src[ro : ro + 100 * 1024])


def test_scattered_blocks(reader: Reader) -> None:
    n = SIZE // BLOCK
    perm = np.random.default_rng(7).permutation(n)
    reader.read_ok(reader.block_ops([(lb, int(rb)) for lb, rb in enumerate(perm)]))
    got = reader.dst.reshape(n, BLOCK)
    want = reader.src.reshape(n, BLOCK)[perm]
    assert np.array_equal(got, want)


def test_many_reads_in_flight(reader: Reader) -> None:
    n = SIZE // BLOCK
    perm = np.random.default_rng(11).permutation(n)
    handles = [
        reader.backend.read(reader.peer, reader.block_ops([(lb, int(perm[lb]))]), timeout_s=TIMEOUT) for lb in range(n)
    ]
    for h in handles:
        assert h.wait(TIMEOUT + 3)
        assert h.error is None, h.error
    assert np.array_equal(reader.dst.reshape(n, BLOCK), reader.src.reshape(n, BLOCK)[perm])


def test_array_ops_fast_path(reader: Reader) -> None:
    ops = np.array(reader.block_ops([(i, i) for i in range(0, 64, 2)]), dtype=np.int64)
    reader.read_ok(ops)  # type: ignore[arg-type]
    for i in range(0, 64, 2):
        assert np.array_equal(reader.dst[i * BLOCK : (i + 1) * BLOCK], reader.src[i * BLOCK : (i + 1) * BLOCK])


def test_out_of_range_rejected_then_server_keeps_serving(reader: Reader) -> None:
    last = reader.remote.region_ids[-1]
    bad = [
        ReadOp(0, 0, last, REMOTE_LIMIT - BLOCK, 2 * BLOCK),  # runs past the region end
        ReadOp(0, 0, last + 5, 0, BLOCK),  # region that does not exist
        ReadOp(0, 0, 0, 1 << 40, BLOCK),  # far outside
    ]
    for op in bad:
        reader.fill(0, BLOCK)
        h = reader.backend.read(reader.peer, [op], timeout_s=TIMEOUT)
        assert h.wait(TIMEOUT + 3)
        assert h.error is not None and "outside" in h.error, h.error
        assert not reader.dst[:BLOCK].any(), "rejected read wrote into the destination"
    # a good read right after, on the same peer
    reader.read_ok(reader.block_ops([(3, 9)]))
    assert np.array_equal(reader.dst[3 * BLOCK : 4 * BLOCK], reader.src[9 * BLOCK : 10 * BLOCK])
    # and a bad read mixed into a batch fails the batch as a whole
    h = reader.backend.read(reader.peer, reader.block_ops([(0, 0)]) + [bad[0]], timeout_s=TIMEOUT)
    assert h.wait(TIMEOUT + 3) and h.error is not None


def test_local_out_of_range_fails_handle(reader: Reader) -> None:
    h = reader.backend.read(reader.peer, [ReadOp(99, 0, 0, 0, BLOCK)], timeout_s=TIMEOUT)
    assert h.wait(TIMEOUT) and h.error is not None and "local" in h.error
    assert h.reason is ReadFailure.OUT_OF_BOUNDS, (h.reason, h.error)  # typed, next to the words


_AUTH_SPECS = [s for s in SPECS if s.supports_auth]


# MORI-IO reads are one-sided RDMA: no serving code runs to check a token (the
# connector's handshake does), so such backends are not parametrised here
@pytest.mark.parametrize("spec", _params(_AUTH_SPECS), indirect=True)
def test_auth_token(spec: BackendSpec) -> None:
    srv = _start(spec, auth_token="s3cret")
    try:
        for token in ("wrong", None):
            r = Reader(spec, srv, auth_token=token)
            try:
                with pytest.raises(TransferError, match="auth_token"):
                    r.connect(srv)
            finally:
                r.close()
        good = Reader(spec, srv, auth_token="s3cret")
        try:
            good.connect(srv)
            good.read_ok(good.block_ops([(0, 5)]))
            assert np.array_equal(good.dst[:BLOCK], good.src[5 * BLOCK : 6 * BLOCK])
        finally:
            good.close()
    finally:
        srv.stop()


def test_peer_killed_and_stalled(spec: BackendSpec, request: pytest.FixtureRequest) -> None:
    if _in_own_process(spec, request):
        return
    srv = _start(spec)
    r = Reader(spec, srv)
    try:
        r.connect(srv)
        r.read_ok(r.block_ops([(0, 0)], nblocks=16))
        # a stalled peer: whatever the backend does, the handle finishes in time
        srv.pause()
        t0 = time.monotonic()
        h = r.backend.read(r.peer, r.block_ops([(0, 0)], nblocks=SIZE // BLOCK), timeout_s=TIMEOUT)
        assert h.wait(TIMEOUT + 3), "read from a stopped peer hung"
        assert time.monotonic() - t0 < TIMEOUT + 3
        srv.resume()
        # finished is not enough to reuse the blocks: the backend must also
        # let go of the destination (no late writes into reused blocks)
        assert h.wait_settled(TIMEOUT + 5), f"handle never settled after its deadline: {h}"
        # killed mid-transfer: a stream of reads, the peer dies under them
        n = SIZE // BLOCK
        handles = [r.backend.read(r.peer, r.block_ops([(0, 0)], nblocks=n), timeout_s=TIMEOUT) for _ in range(8)]
        srv.kill()
        handles += [r.backend.read(r.peer, r.block_ops([(0, 0)], nblocks=n), timeout_s=TIMEOUT) for _ in range(3)]
        t0 = time.monotonic()
        for h in handles:
            assert h.wait(TIMEOUT + 3), f"handle hung after the peer died: {h}"
        assert time.monotonic() - t0 < TIMEOUT + 3
        for h in handles[-3:]:
            assert h.error is not None, "a read issued after the peer died succeeded"
        for h in handles:
            assert h.wait_settled(TIMEOUT + 3), f"handle never settled after the peer died: {h}"
    finally:
        r.close()
        srv.kill()


def _atomkv_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("atomkv-")}


def _open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _fd_targets(fds: set[int]) -> list[str]:
    """Each descriptor with what it is (``/dev/nvidia0``, ``socket:[…]``, ``anon_inode:[pidfd]``)."""
    out = []
    for fd in sorted(fds):
        try:
            out.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            out.append(f"{fd} (closed since)")
    return out


def _warm_device(spec: BackendSpec, server: Any) -> None:
    """For GPU memory: one whole reader round before the counts are taken, so
    what CUDA opens once per process (its context's device files) is not
    counted as a backend's leak; a leak per round still shows."""
    if spec.device != "cuda":
        return
    r = Reader(spec, server)
    r.connect(server)
    r.read_ok(r.block_ops([(0, 0)], nblocks=64))
    r.close()


def test_close_releases_sockets_and_threads(spec: BackendSpec, request: pytest.FixtureRequest) -> None:
    if _in_own_process(spec, request):
        return
    server = request.getfixturevalue("server")
    _warm_device(spec, server)
    threads_before = _atomkv_threads()
    fds_before = _open_fds()
    r = Reader(spec, server)
    r.connect(server)
    r.read_ok(r.block_ops([(0, 0)], nblocks=64))
    # a second reader in this process reads from the first one, so the first
    # also serves a live connection when it closes
    other = Reader(spec, server)
    other.connect(server)
    other.peer = other.backend.add_peer(r.backend.export_descriptor())
    r.fill(7)
    other.read_ok([ReadOp(other.local.region_ids[0], 0, r.local.region_ids[0], 0, BLOCK)])
    assert (other.dst[:BLOCK] == 7).all()
    assert _atomkv_threads() - threads_before, "backend runs no named threads"
    r.close()
    r.close()  # idempotent
    other.close()
    assert _atomkv_threads() - threads_before == set()
    leaked = _open_fds() - fds_before
    assert not leaked, f"file descriptors left open: {_fd_targets(leaked)}"
    h = r.backend.read(r.peer, r.block_ops([(0, 0)]), timeout_s=TIMEOUT)
    assert h.wait(1) and h.error is not None
    assert h.reason is ReadFailure.CLOSED, (h.reason, h.error)
