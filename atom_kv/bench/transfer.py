"""Raw backend read throughput: ``python -m atom_kv.bench transfer``.

Two processes on 127.0.0.1: this one reads ``--total-mb`` of a buffer the
spawned serving process registered, in ``--block-kb`` blocks (contiguous, or
with ``--scattered`` a random permutation on both sides so nothing merges),
verifies every byte, and prints GB/s (10^9 bytes/s) next to two ceilings
measured in the same run: numpy memcpy of the same size and one plain
loopback TCP stream (``sendall`` into ``recv_into``) between two processes.
With ``--backend nixl`` it also times NIXL's own transfer loop on the same
buffers in the same run (the same blocks as descriptor lists straight into
``initialize_xfer`` / ``transfer`` / ``check_xfer_state``) and prints our
backend's ratio to it (target: >= 0.9).

With ``--device cuda`` both buffers live on GPU 0 (``gpu_ipc``, staged
``tcp``, ``auto``, ``nixl`` on ``VRAM``): the ceiling is then a same-process
device-to-device torch copy of the same bytes, and each row says whether it
meets its target, printing the base it is held to as measured in the same
run: ``gpu_ipc`` >= 0.7 x that ceiling, staged ``tcp`` >= 0.8 x ``tcp`` on
host memory (same processes), ``nixl`` >= 0.9 x raw NIXL on the same GPU
buffers, from 64 KiB blocks.

On host memory (``--device cpu``), from 64 KiB blocks: ``tcp`` >= 0.8 x the
plain socket stream, ``cma`` and ``auto`` (``cma`` between two processes of
one host) >= 0.5 x memcpy, ``moriio`` >= 20 GB/s from 1 MiB blocks
(docs/moriio.md), ``nixl`` >= 0.9 x raw NIXL at every block size. Every row
held to a target says met or MISSED, a summary line counts them, and a missed
target is exit status 1 unless ``--explore`` (``atom_kv.bench.targets``).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any, Optional

import numpy as np

from atom_kv.bench import targets as bench_targets
from atom_kv.bench.transfer_common import bench_config, pattern  # shared with the device suite
from atom_kv.bench.targets import Target

log = logging.getLogger(__name__)

BACKEND_CHOICES = ("tcp", "cma", "auto", "moriio", "gpu_ipc", "nixl")
#: from this block size on, the GPU rows are held to their targets
TARGET_FROM_KB = 64
#: backend -> (what the GPU rate is compared with, the fraction it must reach)
GPU_TARGETS = {"gpu_ipc": ("ceiling_gbps", 0.7), "tcp": ("host_gbps", 0.8), "auto": ("ceiling_gbps", 0.7),
               "nixl": ("raw_nixl_gbps", 0.9)}
#: how each base is named where a row prints it
BASE_NAMES = {"ceiling_gbps": "device ceiling", "host_gbps": "host tcp", "raw_nixl_gbps": "raw NIXL",
              "memcpy_gbps": "memcpy", "socket_gbps": "socket"}
#: host memory: backend -> (what the rate is compared with, or None for a rate in GB/s; the fraction or
#: rate; the smallest block held to it, KiB)
HOST_TARGETS: dict[str, tuple[Optional[str], float, int]] = {
    "tcp": ("socket_gbps", 0.8, TARGET_FROM_KB), "cma": ("memcpy_gbps", 0.5, TARGET_FROM_KB),
    "auto": ("memcpy_gbps", 0.5, TARGET_FROM_KB), "moriio": (None, 20.0, 1024)}

#: ``--backend nixl``: our backend must reach this fraction of raw NIXL's GB/s
NIXL_TARGET_RATIO = 0.9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench_targets.add_arguments(parser)
    parser.add_argument("--backend", choices=BACKEND_CHOICES, default="tcp")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both processes keep the buffers: host memory, or GPU 0 (CUDA or ROCm torch)")
    parser.add_argument("--total-mb", type=int, default=256, help="bytes read per measurement, in MiB")
    parser.add_argument("--block-kb", default="4,16,64,256,1024", help="comma-separated block sizes in KiB")
    parser.add_argument("--scattered", action="store_true", help="read blocks in a random permutation (no merging)")
    parser.add_argument("--repeat", type=int, default=3, help="measurements per block size (best and median reported)")
    parser.add_argument("--streams", type=int, default=None, help="tcp.streams for the tcp backend (default: config default)")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per-read timeout")
    parser.add_argument(
        "--kv-transfer-config", default=None, metavar="JSON",
        help="extra --kv-transfer-config keys for both processes, e.g. MORI-IO tuning "
        "'{\"qp_per_transfer\": 4, \"moriio\": {\"transport\": \"xgmi\"}}' (kv_role is set by the bench, "
        "--backend picks the backend, --streams and --timeout-s override their keys)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    from atom_kv.bench import transfer_device

    transfer_device.add_arguments(parser)


# --------------------------------------------------------------------------
# serving process
# --------------------------------------------------------------------------
def _socket_pusher(lsock: socket.socket, buf: np.ndarray, stop: threading.Event, timeout_s: float) -> None:
    """Send the whole buffer once per accepted connection (the socket ceiling)."""
    view = buf.data
    lsock.settimeout(1.0)
    while not stop.is_set():
        try:
            conn, _ = lsock.accept()
        except (TimeoutError, OSError):
            continue
        with conn:
            conn.settimeout(timeout_s)
            try:
                conn.sendall(view)
            except OSError as exc:
                log.warning("socket ceiling: send failed: %s", exc)


def _register(backend: Any, buf: Any, nbytes: int, align: int) -> list[int]:
    """Register ``buf`` (numpy, or a torch tensor on a GPU) as the memory it is."""
    from atom_kv.transfer import memory_of

    ptr = buf.ctypes.data if isinstance(buf, np.ndarray) else buf.data_ptr()
    return backend.register_memory(ptr, nbytes, align=align, memory=memory_of(buf))


def _on_device(data: np.ndarray, device: str) -> Any:
    if device == "cpu":
        return data
    import torch

    return torch.from_numpy(data).to(device)


def _serve(backend_name: str, config: dict[str, Any], nbytes: int, align: int, seed: int, conn: Any,
           device: str = "cpu") -> None:
    from atom_kv.config import KVTransferConfig
    from atom_kv.transfer import create_backend

    try:
        cfg = KVTransferConfig.from_dict({"kv_role": "kv_producer", **config})
        backend = create_backend(backend_name, cfg, host="127.0.0.1", key=f"bench-serve-{os.getpid()}")
        buf = pattern(nbytes, seed)
        keep = _on_device(buf, device)
        ids = _register(backend, keep, nbytes, align)
        if device != "cpu" and backend_name == "tcp":  # the same bytes in host memory: the staged target's base
            ids = ids + _register(backend, buf, nbytes, align)
        desc = backend.export_descriptor()
    except Exception as exc:  # reported to the parent as one line
        conn.send(("error", f"{type(exc).__name__}: {exc}", [], 0))
        return
    lsock = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    pusher = threading.Thread(
        target=_socket_pusher, args=(lsock, buf, stop, cfg.transfer_timeout_s), name="bench-socket-pusher", daemon=True
    )
    pusher.start()
    conn.send(("ready", desc, ids, lsock.getsockname()[1]))
    while True:
        if conn.poll(1.0):
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg == "stop":
                break
    stop.set()
    pusher.join(5)
    lsock.close()
    backend.close()


# --------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------
def memcpy_gbps(dst: np.ndarray, src: np.ndarray) -> float:
    t = time.perf_counter()
    np.copyto(dst, src)
    return dst.nbytes / (time.perf_counter() - t) / 1e9


def socket_gbps(port: int, dst: np.ndarray, timeout_s: float) -> float:
    view = dst.data
    n = dst.nbytes
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        got = 0
        while got < n:
            k = s.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("socket ceiling: sender closed early")
            got += k
    return n / (time.perf_counter() - t) / 1e9


def build_ops(nblocks: int, block: int, chunk: int, ids: list[int], local_ids: list[int],
              scattered: bool, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ops array, local block order, remote block order): local block
    ``lperm[i]`` receives remote block ``rperm[i]``."""
    if scattered:
        rng = np.random.default_rng(seed)
        lperm, rperm = rng.permutation(nblocks), rng.permutation(nblocks)
    else:
        lperm = rperm = np.arange(nblocks)
    loff = lperm.astype(np.int64) * block
    roff = rperm.astype(np.int64) * block
    ops = np.empty((nblocks, 5), dtype=np.int64)
    ops[:, 0] = np.asarray(local_ids, dtype=np.int64)[loff // chunk]
    ops[:, 1] = loff % chunk
    ops[:, 2] = np.asarray(ids, dtype=np.int64)[roff // chunk]
    ops[:, 3] = roff % chunk
    ops[:, 4] = block
    return ops, lperm, rperm


def run(args: argparse.Namespace) -> int:
    from atom_kv.bench import transfer_device
    from atom_kv.config import ConfigError, KVTransferConfig
    from atom_kv.transfer import BackendUnavailable, TransferError, chunk_sizes, create_backend

    if transfer_device.wanted(args):  # gpu_ipc and staged tcp on a GPU or over the host seam: latency apart
        return transfer_device.run(args)

    try:
        blocks_kb = [int(x) for x in str(args.block_kb).split(",") if x.strip()]
    except ValueError:
        print(f"transfer bench: --block-kb must be comma-separated integers, got {args.block_kb!r}", file=sys.stderr)
        return 2
    nbytes = args.total_mb << 20
    if not blocks_kb or any(b <= 0 or nbytes % (b << 10) for b in blocks_kb):
        print("transfer bench: every --block-kb must be positive and divide --total-mb", file=sys.stderr)
        return 2
    try:
        config = bench_config(args)
    except ConfigError as exc:
        print(f"transfer bench: {exc}", file=sys.stderr)
        return 2
    cfg = KVTransferConfig.from_dict({"kv_role": "kv_consumer", **config})
    if args.device != "cpu":
        from atom_kv.transfer.memory import gpu_unavailable_reason

        if (why := gpu_unavailable_reason()) is not None:
            print(f"transfer bench: --device {args.device}: {why}; use --device cpu", file=sys.stderr)
            return 2
    elif args.backend == "gpu_ipc":
        print("transfer bench: backend 'gpu_ipc' moves GPU memory only; add --device cuda (or --seam host for its "
              "host stand-in)", file=sys.stderr)
        return 2
    try:
        backend = create_backend(args.backend, cfg, host="127.0.0.1", key=f"bench-read-{os.getpid()}")
        if args.backend == "cma":
            from atom_kv.transfer.cma import cma_unavailable_reason

            reason = cma_unavailable_reason()
            if reason:
                raise BackendUnavailable(reason)
    except (BackendUnavailable, ImportError) as exc:
        print(f"transfer bench: backend {args.backend!r} unavailable: {exc}", file=sys.stderr)
        return 2

    align = max(blocks_kb) << 10
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    seed = 20260101
    proc = ctx.Process(target=_serve, args=(args.backend, config, nbytes, align, seed, child, args.device),
                       name="bench-serve", daemon=True)
    proc.start()
    child.close()
    failures = 0
    rows: list[dict[str, Any]] = []
    try:
        if not parent.poll(120):
            print("transfer bench: serving process did not start", file=sys.stderr)
            return 1
        status, desc, ids, sock_port = parent.recv()
        if status != "ready":
            print(f"transfer bench: serving process failed: {desc}", file=sys.stderr)
            return 2 if "Unavailable" in desc else 1
        src = pattern(nbytes, seed)
        dst = np.zeros(nbytes, dtype=np.uint8)
        gpu = _GpuSide(src, args.device) if args.device != "cpu" else None
        local_ids = _register(backend, gpu.dst if gpu else dst, nbytes, align)
        host_pair = None
        if gpu is not None and args.backend == "tcp":
            host_pair = (ids[len(ids) // 2 :], _register(backend, dst, nbytes, align))
            ids = ids[: len(ids) // 2]
        chunk = chunk_sizes(nbytes, align, backend.max_region_bytes)[0]
        try:
            peer = backend.add_peer(desc)
        except TransferError as exc:
            print(f"transfer bench: cannot add peer: {exc}", file=sys.stderr)
            return 1
        for block_kb in blocks_kb:
            failures += _measure(args, backend, peer, src, dst, ids, local_ids, chunk, block_kb, sock_port, seed,
                                 gpu=gpu, host_pair=host_pair, desc=desc, rows=rows)
    finally:
        backend.close()
        try:
            parent.send("stop")
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    missed = bench_targets.report(transfer_targets(rows), explore=args.explore, json_output=args.json, lines=False,
                                  none_reason="tcp, cma and auto are held to one from 64 KiB blocks, moriio from "
                                              "1 MiB, nixl at every size")
    return 1 if failures else missed


def transfer_targets(rows: list[dict[str, Any]]) -> list[Target]:
    """The rows held to a target (``_hold_to``), as targets; each row's own line already says met or MISSED."""
    out = []
    for row in rows:
        if "meets_target" not in row:
            continue
        vs = (f" = {row['ratio']:.2f} x {row['base']} {row['base_gbps']:.3f} GB/s measured in this run"
              if "base" in row else "")
        out.append(Target(f"{row['backend']} {row['block_kb']} KiB {'scattered' if row['scattered'] else 'contiguous'}",
                          f"{row['gbps']:.3f} GB/s {row['target']}{vs}", row["meets_target"]))
    return out


class _GpuSide:
    """The reader's GPU buffers: the destination, the source bytes (to verify
    on the device and for the ceiling: a same-process device-to-device copy)."""

    def __init__(self, src: np.ndarray, device: str) -> None:
        import torch

        self.torch = torch
        self.src = torch.from_numpy(src).to(device)
        self.dst = torch.zeros_like(self.src)

    def ceiling_gbps(self) -> float:
        self.torch.cuda.synchronize()
        t = time.perf_counter()
        self.dst.copy_(self.src)
        self.torch.cuda.synchronize()
        return self.src.numel() / (time.perf_counter() - t) / 1e9

    def clear(self) -> None:
        self.dst.zero_()
        self.torch.cuda.synchronize()

    def equal(self, nblocks: int, block: int, lperm: np.ndarray, rperm: np.ndarray) -> bool:
        torch = self.torch
        got = self.dst.view(nblocks, block)[torch.from_numpy(lperm).to(self.dst.device)]
        want = self.src.view(nblocks, block)[torch.from_numpy(rperm).to(self.src.device)]
        return bool(torch.equal(got, want))


def _timed_read(backend: Any, peer: str, ops: np.ndarray, nbytes: int, timeout_s: float) -> tuple[float, Optional[str]]:
    t = time.perf_counter()
    h = backend.read(peer, ops, timeout_s=timeout_s)
    finished = h.wait(timeout_s + 5)
    elapsed = time.perf_counter() - t
    if not finished or h.error:
        return 0.0, h.error or "read did not finish"
    return nbytes / elapsed / 1e9, None


def _measure(args: argparse.Namespace, backend: Any, peer: str, src: np.ndarray, dst: np.ndarray,
             ids: list[int], local_ids: list[int], chunk: int, block_kb: int, sock_port: int, seed: int,
             gpu: Optional[_GpuSide] = None, host_pair: Optional[tuple[list[int], list[int]]] = None,
             desc: bytes = b"", rows: Optional[list[dict[str, Any]]] = None) -> int:
    block = block_kb << 10
    nblocks = src.nbytes // block
    ops, lperm, rperm = build_ops(nblocks, block, chunk, ids, local_ids, args.scattered, seed + block_kb)
    host_ops = None
    if host_pair is not None:  # the same reads between host buffers, for the staged target
        host_ops = build_ops(nblocks, block, chunk, host_pair[0], host_pair[1], args.scattered, seed + block_kb)[0]
    rates, mem, sock, ceiling, host_rates = [], [], [], [], []
    raw: list[float] = []  # raw NIXL's GB/s, filled by _raw_once
    verified = True
    error: Optional[str] = None
    raw_loop = None
    if args.backend == "nixl":
        local_ptr, local_dev = ((gpu.dst.data_ptr(), gpu.dst.device.index or 0) if gpu is not None
                                else (dst.ctypes.data, -1))
        raw_loop = RawNixl(backend, desc, local_ptr, local_dev, lperm * block, rperm * block, block)
    if raw_loop is not None:
        # untimed: the first read prepares the peer's NIXL descriptor lists and
        # UCX's connection (once per peer); raw NIXL gets its warm-up too
        backend.read(peer, ops, timeout_s=args.timeout_s).wait(args.timeout_s + 5)
        raw_loop.gbps(args.timeout_s)
    for i in range(max(1, args.repeat)):
        mem.append(memcpy_gbps(dst, src))
        sock.append(socket_gbps(sock_port, dst, args.timeout_s))
        # raw NIXL before our read on even repeats, after it on odd ones, so
        # neither always runs in the other's wake
        if raw_loop is not None and i % 2 == 0 and (
                error := _raw_once(raw_loop, raw, dst, src, lperm, rperm, args, gpu)):
            verified = False
            break
        if gpu is not None:
            ceiling.append(gpu.ceiling_gbps())
            gpu.clear()
        if host_ops is not None:
            dst.fill(0)
            rate, error = _timed_read(backend, peer, host_ops, src.nbytes, args.timeout_s)
            if error is None and not np.array_equal(dst.reshape(nblocks, block)[lperm], src.reshape(nblocks, block)[rperm]):
                error = "bytes read into host memory differ from the source"
            if error is not None:
                verified = False
                break
            host_rates.append(rate)
        dst.fill(0)
        if gpu is not None:
            gpu.clear()
        rate, error = _timed_read(backend, peer, ops, src.nbytes, args.timeout_s)
        if error is not None:
            verified = False
            break
        rates.append(rate)
        if gpu is not None:
            same = gpu.equal(nblocks, block, lperm, rperm)
        else:
            same = np.array_equal(dst.reshape(nblocks, block)[lperm], src.reshape(nblocks, block)[rperm])
        if not same:
            verified = False
            error = "bytes read differ from the source"
            break
        if raw_loop is not None and i % 2 == 1 and (
                error := _raw_once(raw_loop, raw, dst, src, lperm, rperm, args, gpu)):
            verified = False
            break
    row = {
        "backend": args.backend,
        "block_kb": block_kb,
        "scattered": bool(args.scattered),
        "total_mb": args.total_mb,
        "gbps": round(max(rates), 3) if rates else 0.0,
        "gbps_median": round(statistics.median(rates), 3) if rates else 0.0,
        "verified": verified,
        "memcpy_gbps": round(max(mem), 3),
        "socket_gbps": round(max(sock), 3),
        "repeats": len(rates),
    }
    if raw:
        row["raw_nixl_gbps"] = round(max(raw), 3)
        row["raw_ratio"] = round(row["gbps"] / row["raw_nixl_gbps"], 3) if row["raw_nixl_gbps"] else 0.0
    if gpu is not None:
        row["device"] = args.device
        row["ceiling_gbps"] = round(max(ceiling), 3) if ceiling else 0.0
        if host_rates:
            row["host_gbps"] = round(max(host_rates), 3)
        base, fraction = GPU_TARGETS.get(args.backend, ("ceiling_gbps", 0.7))
        if block_kb >= TARGET_FROM_KB and row.get(base):
            _hold_to(row, base, fraction)
    elif "raw_nixl_gbps" in row and row["raw_nixl_gbps"]:
        _hold_to(row, "raw_nixl_gbps", NIXL_TARGET_RATIO)
    elif args.backend in HOST_TARGETS and rates:
        host_base, fraction, from_kb = HOST_TARGETS[args.backend]
        if block_kb >= from_kb and (host_base is None or row.get(host_base)):
            _hold_to(row, host_base, fraction)
    if error:
        row["error"] = error
    if rows is not None:
        rows.append(row)
    if args.json:
        print(json.dumps(row), flush=True)
    else:
        pct_mem = 100 * row["gbps"] / row["memcpy_gbps"] if row["memcpy_gbps"] else 0
        pct_sock = 100 * row["gbps"] / row["socket_gbps"] if row["socket_gbps"] else 0
        print(
            f"{row['backend']:>6} block {block_kb:>5} KiB {'scattered' if args.scattered else 'contiguous':>10}: "
            f"{row['gbps']:7.3f} GB/s (median {row['gbps_median']:.3f})  memcpy {row['memcpy_gbps']:.3f} "
            f"({pct_mem:.0f}%)  socket {row['socket_gbps']:.3f} ({pct_sock:.0f}%)"
            + (f"  raw NIXL {row['raw_nixl_gbps']:.3f} (ratio {row['raw_ratio']:.2f})"
               if "raw_nixl_gbps" in row else "")
            + f"  verified={verified}"
            + (f"  device ceiling {row['ceiling_gbps']:.3f}" if "ceiling_gbps" in row else "")
            + (f"  host tcp {row['host_gbps']:.3f}" if "host_gbps" in row else "")
            + (f"  target {row['target']}"
               + (f" = {row['ratio']:.2f} x {row['base']} {row['base_gbps']:.3f} GB/s measured in this run"
                  if "base" in row else "")
               + f": {'met' if row['meets_target'] else 'MISSED'}" if "target" in row else "")
            + (f"  error: {error}" if error else ""),
            flush=True,
        )
    return 0 if verified else 1


def _hold_to(row: dict[str, Any], base: Optional[str], fraction: float) -> None:
    """Mark ``row`` with its target: ``gbps >= fraction x row[base]``, the base printed with its value
    (``base`` None: ``gbps >= fraction``, a rate in GB/s)."""
    if base is None:
        row["target"] = f">= {fraction:g} GB/s"
        row["meets_target"] = bool(row["gbps"] >= fraction)
        return
    row["target"] = f">= {fraction} x {BASE_NAMES[base]}"
    row["base"] = BASE_NAMES[base]
    row["base_gbps"] = row[base]
    row["ratio"] = round(row["gbps"] / row[base], 3)
    row["meets_target"] = bool(row["gbps"] >= fraction * row[base])


def _raw_once(raw_loop: "RawNixl", raw: list[float], dst: np.ndarray, src: np.ndarray, lperm: np.ndarray,
              rperm: np.ndarray, args: argparse.Namespace, gpu: Optional[_GpuSide] = None) -> Optional[str]:
    """One raw NIXL measurement appended to ``raw``, verified; the error, or None."""
    dst.fill(0)
    if gpu is not None:
        gpu.clear()
    try:
        raw.append(raw_loop.gbps(args.timeout_s))
    except RuntimeError as exc:
        return str(exc)
    block = raw_loop.block
    nblocks = src.nbytes // block
    if gpu is not None:
        same = gpu.equal(nblocks, block, lperm, rperm)
    else:
        same = np.array_equal(dst.reshape(nblocks, block)[lperm], src.reshape(nblocks, block)[rperm])
    return None if same else "raw NIXL read bytes that differ from the source"


class RawNixl:
    """NIXL's own transfer loop on our backend's agent and buffers: one
    descriptor per block, local and remote lists straight into
    ``initialize_xfer``, ``transfer``, then ``check_xfer_state`` until done
    (the loop a NIXL user writes, polling without sleeping)."""

    def __init__(self, backend: Any, desc: bytes, local_ptr: int, local_device: int, local_offsets: np.ndarray,
                 remote_offsets: np.ndarray, block: int) -> None:
        from atom_kv import wire
        from atom_kv.transfer.nixl.plan import DRAM, VRAM

        remote = wire.decode(desc, wire.NixlDescriptor)
        self.agent, self.lock = backend.native_agent()
        self.remote_name = remote.agent
        n = len(local_offsets)
        # rows of (address, length, device id); host memory is DRAM on device 0, GPU memory VRAM on its GPU
        self.local_rows = np.zeros((n, 3), dtype=np.uint64)
        self.local_rows[:, 0] = local_ptr + local_offsets.astype(np.uint64)
        self.local_rows[:, 1] = block
        self.local_rows[:, 2] = max(local_device, 0)
        self.local_seg = VRAM if local_device >= 0 else DRAM
        remote_device = remote.devices[0] if remote.devices else -1
        self.remote_rows = self.local_rows.copy()
        self.remote_rows[:, 0] = remote.addrs[0] + remote_offsets.astype(np.uint64)  # one contiguous buffer
        self.remote_rows[:, 2] = max(remote_device, 0)
        self.remote_seg = VRAM if remote_device >= 0 else DRAM
        self.nbytes = n * block
        self.block = block

    def gbps(self, timeout_s: float) -> float:
        with self.lock:
            t = time.perf_counter()
            local = self.agent.get_xfer_descs(self.local_rows, self.local_seg)
            remote = self.agent.get_xfer_descs(self.remote_rows, self.remote_seg)
            xfer = self.agent.initialize_xfer("READ", local, remote, self.remote_name)
            state = self.agent.transfer(xfer)
            deadline = time.monotonic() + timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(xfer)
            elapsed = time.perf_counter() - t
            xfer.release()
        if state != "DONE":
            raise RuntimeError(f"raw NIXL transfer ended in state {state}")
        return self.nbytes / elapsed / 1e9
