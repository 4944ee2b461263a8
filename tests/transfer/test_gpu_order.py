"""The order between an engine's KV writes and our copies, on a real GPU
(marked ``gpu``; skipped without one): a deliberately slow kernel is queued
on the producer's stream before the KV write, the producer marks the KV
written (``kv_written``) and at once lets the reader read, without waiting
for the GPU. A copy that did not wait for the written event would read the
old bytes. Also a staged request mixing host and GPU regions."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import numpy as np
import pytest

from atom_kv.config import KVTransferConfig
from atom_kv.transfer import ReadOp, create_backend
from atom_kv.transfer.memory import gpu_unavailable_reason, memory_of

_NO_GPU = gpu_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_NO_GPU is not None, reason=_NO_GPU or "")]

BLOCK = 64 * 1024
SIZE = 64 * BLOCK
VALUE = 0xAB
SLEEP_CYCLES = 2_000_000_000  # about a second of GPU time at 1.5-2 GHz
TIMEOUT = 30.0


def _config(role: str) -> KVTransferConfig:
    return KVTransferConfig.from_dict({"kv_role": role, "transfer_timeout_s": TIMEOUT})


def _slow_write(t: Any, backend: Any) -> None:
    """On a side stream: a slow kernel, then the KV write, then ``kv_written``;
    returns at once (the host does not wait for the GPU)."""
    import torch

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        t.fill_(VALUE)
        backend.kv_written()


def _producer(conn: Any) -> None:
    import torch

    backend = create_backend("gpu_ipc", _config("kv_producer"), key="slow-producer")
    t = torch.zeros(SIZE, dtype=torch.uint8, device="cuda")
    backend.register_memory(t.data_ptr(), SIZE, align=BLOCK, memory=memory_of(t))
    torch.cuda.synchronize()
    conn.send(backend.export_descriptor())
    conn.recv()
    _slow_write(t, backend)
    conn.send("written")
    conn.recv()
    torch.cuda.synchronize()
    backend.close()


def _reader_buffer(backend: Any) -> Any:
    import torch

    dst = torch.full((SIZE,), 7, dtype=torch.uint8, device="cuda")
    ids = backend.register_memory(dst.data_ptr(), SIZE, align=BLOCK, memory=memory_of(dst))
    assert ids == [0]
    return dst


def test_gpu_ipc_read_waits_for_a_slow_producer_kernel_queued_before_the_kv_write() -> None:
    import torch

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child,), name="slow-producer", daemon=True)
    proc.start()
    reader = create_backend("gpu_ipc", _config("kv_consumer"), key="slow-reader")
    try:
        assert conn.poll(120), "the producer did not start"
        dst = _reader_buffer(reader)
        peer = reader.add_peer(conn.recv())
        conn.send("write")
        assert conn.poll(60) and conn.recv() == "written"
        h = reader.read(peer, [ReadOp(0, 0, 0, 0, SIZE)], timeout_s=TIMEOUT)
        assert h.wait(TIMEOUT + 5) and h.error is None, h.error
        # the handle finished: the copies are complete, the consumer's next step may use the blocks
        assert bool((dst == VALUE).all()), "the read copied the KV before the producer's write completed"
        torch.cuda.synchronize()
    finally:
        reader.close()
        if proc.is_alive():
            conn.send("stop")
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def test_staged_tcp_gather_waits_for_a_slow_producer_kernel_queued_before_the_kv_write() -> None:
    import torch

    server = create_backend("tcp", _config("kv_producer"), key="slow-tcp-server")
    reader = create_backend("tcp", _config("kv_consumer"), key="slow-tcp-reader")
    try:
        src = torch.zeros(SIZE, dtype=torch.uint8, device="cuda")
        server.register_memory(src.data_ptr(), SIZE, align=BLOCK, memory=memory_of(src))
        dst = _reader_buffer(reader)
        peer = reader.add_peer(server.export_descriptor())
        torch.cuda.synchronize()
        _slow_write(src, server)
        h = reader.read(peer, [ReadOp(0, 0, 0, 0, SIZE)], timeout_s=TIMEOUT)
        assert h.wait(TIMEOUT + 5) and h.error is None, h.error
        assert bool((dst == VALUE).all()), "the staging gather read the KV before the producer's write completed"
    finally:
        reader.close()
        server.close()


def test_a_staged_request_mixing_host_and_gpu_regions_moves_the_right_bytes() -> None:
    import torch

    server = create_backend("tcp", _config("kv_producer"), key="mixed-server")
    reader = create_backend("tcp", _config("kv_consumer"), key="mixed-reader")
    try:
        rng = np.random.default_rng(5)
        host_src = rng.integers(0, 256, SIZE, dtype=np.uint8)
        gpu_src = torch.from_numpy(rng.integers(0, 256, SIZE, dtype=np.uint8)).cuda()
        server.stage_host_memory = True  # the host region goes through the host copier, the GPU one its own
        reader.stage_host_memory = True
        (s_host,) = server.register_memory(host_src.ctypes.data, SIZE, align=BLOCK)
        (s_gpu,) = server.register_memory(gpu_src.data_ptr(), SIZE, align=BLOCK, memory=memory_of(gpu_src))
        host_dst = np.zeros(SIZE, dtype=np.uint8)
        gpu_dst = torch.zeros(SIZE, dtype=torch.uint8, device="cuda")
        (d_host,) = reader.register_memory(host_dst.ctypes.data, SIZE, align=BLOCK)
        (d_gpu,) = reader.register_memory(gpu_dst.data_ptr(), SIZE, align=BLOCK, memory=memory_of(gpu_dst))
        torch.cuda.synchronize()
        peer = reader.add_peer(server.export_descriptor())
        # 2 MiB in all, under one staging piece (4 MiB): the piece mixes both kinds on both
        # sides, GPU blocks into host ones and host blocks into GPU ones
        n, k = SIZE // BLOCK, 16
        ops = []
        for i in range(k):
            ops.append(ReadOp(d_host, i * BLOCK, s_gpu, (n - 1 - i) * BLOCK, BLOCK))
            ops.append(ReadOp(d_gpu, i * BLOCK, s_host, (n - 1 - i) * BLOCK, BLOCK))
        h = reader.read(peer, ops, timeout_s=TIMEOUT)
        assert h.wait(TIMEOUT + 5) and h.error is None, h.error
        want_host = gpu_src.cpu().numpy().reshape(n, BLOCK)[::-1][:k].ravel()
        want_gpu = host_src.reshape(n, BLOCK)[::-1][:k].ravel()
        assert np.array_equal(host_dst[: k * BLOCK], want_host)
        assert np.array_equal(gpu_dst.cpu().numpy()[: k * BLOCK], want_gpu)
    finally:
        reader.close()
        server.close()
