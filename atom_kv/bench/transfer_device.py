"""The device suite of ``python -m atom_kv.bench transfer``: latency apart from
bandwidth, per read pattern, each next to a ceiling timed the same way.

Runs for ``--backend gpu_ipc`` and ``--backend tcp`` (staged) with
``--device cuda`` (GPU 0), or with ``--seam host`` over the CPU stand-ins
of the device: ``gpu_ipc`` over its host seam (memfd buffers, copies by
address run when a fence is looked at), staged ``tcp`` through a FAKE
device copier whose fences complete ``--fence-delay-us`` after they are
recorded (:mod:`atom_kv.testing.fake_copier`). Two processes on 127.0.0.1
(this one reads, a spawned one serves); every timed read is verified.

``gpu_ipc`` rows:

- ``submit``: host time of ``read()`` for 2048 ranges scattered on both
  sides (target on the host seam: <= 50 µs, the p50);
- ``latency``: per read of 64 KiB..1 MiB in all (``--latency-kb``, 16 KiB
  blocks), submit and completion apart, p50 and p99 (target on a GPU:
  the 1 MiB read <= 50 µs);
- ``bandwidth``: per ``--pattern`` and ``--pattern-block-kb``, reads of
  ``--read-mb`` (16 MiB) at each ``--queue-depth`` (reads in flight at
  once), and one of ``--big-mb`` (1 GiB on a GPU; 64 MiB on the host seam
  by default, to fit a small machine), each next to the ceiling of the same
  pattern: the same batched copy by address between two buffers of this
  process, timed the same way (host clock; on a GPU also CUDA events).
  Target on a GPU: queue depth 4 and the big read >= 0.8 x the ceiling.

Staged ``tcp`` rows, per block size: staged next to plain host ``tcp`` in
the same processes (target on a GPU: >= 0.8 x host tcp at 1 MiB blocks;
also a GPU reader against a host-memory peer); on the host seam, staged
with fences delayed by ``--fence-delay-us`` next to no delay (target >=
0.9 x).

Each figure is the median of ``--iterations`` (>= 20 by default). Every
target is printed with its base, measured in this run, and met or MISSED;
a target that only means something on the other kind of run is printed as
not held. Exit status 1 when a held target is missed or bytes differ.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from atom_kv.bench.read_patterns import PATTERNS, block_pairs, ops_for, source_blocks

__all__ = ["add_arguments", "run", "wanted"]

#: the targets (issue 34): host submit per 2048-range read on the host seam, per-read latency at 1 MiB on a
#: GPU, bandwidth against the pattern's ceiling on a GPU, staged tcp against host tcp on a GPU, and staged
#: tcp with delayed fences against no delay on the host seam
SUBMIT_TARGET_US = 50.0
LATENCY_TARGET_US = 50.0
CEILING_FRACTION = 0.8
STAGED_FRACTION = 0.8
DELAYED_FRACTION = 0.9
SUBMIT_RANGES = 2048
SUBMIT_BLOCK = 64
LATENCY_BLOCK = 16 << 10
SEED = 20260101


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("device suite (--device cuda, or --seam host; backends gpu_ipc and tcp)")
    g.add_argument("--seam", choices=("none", "host"), default="none",
                   help="host: run gpu_ipc over its host seam and staged tcp through a fake device copier, on the CPU")
    g.add_argument("--pattern", default=",".join(PATTERNS),
                   help=f"comma-separated read patterns: {', '.join(PATTERNS)} (subset: scattered on both sides)")
    g.add_argument("--pattern-block-kb", default="64,256,1024", help="block sizes of the bandwidth rows, KiB")
    g.add_argument("--queue-depth", default="1,4", help="reads of --read-mb in flight at once (comma-separated)")
    g.add_argument("--read-mb", type=int, default=16, help="bytes per bandwidth read, MiB")
    g.add_argument("--big-mb", type=int, default=None, help="the big read, MiB (default: 1024 on a GPU, 64 on --seam host)")
    g.add_argument("--latency-kb", default="64,256,1024", help="per-read totals of the latency rows, KiB")
    g.add_argument("--iterations", type=int, default=20, help="timed repeats per row (medians; >= 20 for the targets)")
    g.add_argument("--fence-delay-us", type=float, default=300.0,
                   help="--seam host, tcp: the fake device's fences complete this long after they are recorded")


def wanted(args: argparse.Namespace) -> bool:
    """Whether this run is the device suite's (else the transfer bench's own rows)."""
    return args.seam == "host" or (args.device == "cuda" and args.backend in ("gpu_ipc", "tcp"))


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"transfer bench: {what} must be comma-separated integers, got {text!r}") from None
    if not out or min(out) <= 0:
        raise SystemExit(f"transfer bench: {what} must be positive integers, got {text!r}")
    return out


@dataclass
class Plan:
    """What one run measures (from the arguments)."""

    backend: str
    host: bool
    patterns: list[str]
    blocks: list[int]
    depths: list[int]
    read: int
    big: int
    latency: list[int]
    iterations: int
    fence_delay_s: float
    timeout_s: float
    config: dict[str, Any]
    as_json: bool
    explore: bool = False  # a missed target is printed, exit status 0

    @property
    def where(self) -> str:
        return "host seam" if self.host else "cuda"

    def source_bytes(self) -> int:
        biggest = max(self.big, self.read * max(self.depths))
        return source_blocks(1) * biggest

    def dest_bytes(self) -> int:
        return max(self.big, self.read * max(self.depths))

    def align(self) -> int:
        return max(self.blocks + [LATENCY_BLOCK])


def _plan(args: argparse.Namespace) -> Plan:
    from atom_kv.bench.transfer_common import bench_config

    patterns = [p.strip() for p in str(args.pattern).split(",") if p.strip()]
    bad = [p for p in patterns if p not in PATTERNS]
    if bad or not patterns:
        raise SystemExit(f"transfer bench: --pattern {args.pattern!r}: allowed: {', '.join(PATTERNS)}")
    host = args.seam == "host"
    big_mb = args.big_mb if args.big_mb is not None else (64 if host else 1024)
    blocks = [k << 10 for k in _ints(args.pattern_block_kb, "--pattern-block-kb")]
    read, big = args.read_mb << 20, big_mb << 20
    if read <= 0 or big <= 0 or any(read % b or big % b for b in blocks):
        raise SystemExit("transfer bench: --read-mb and --big-mb must be positive and multiples of every "
                         "--pattern-block-kb")
    if args.iterations < 1:
        raise SystemExit("transfer bench: --iterations must be >= 1")
    return Plan(args.backend, host, patterns, blocks, _ints(args.queue_depth, "--queue-depth"), read, big,
                [k << 10 for k in _ints(args.latency_kb, "--latency-kb")], args.iterations,
                args.fence_delay_us * 1e-6, args.timeout_s, bench_config(args), args.json,
                args.explore)


# --------------------------------------------------------------------------
# buffers on either side
# --------------------------------------------------------------------------
class Buffer:
    """Owns one bench buffer: host memory (a memfd for the gpu_ipc host seam) or GPU 0's."""

    def __init__(self, nbytes: int, *, cuda: bool, memfd: bool, fill: Optional[np.ndarray] = None) -> None:
        self.nbytes = nbytes
        self._owner: Any = None
        self.tensor: Any = None
        if cuda:
            import torch

            self.tensor = (torch.from_numpy(fill).to("cuda") if fill is not None
                           else torch.zeros(nbytes, dtype=torch.uint8, device="cuda"))
            self.ptr = int(self.tensor.data_ptr())
            self.array: Optional[np.ndarray] = None
        else:
            if memfd:
                from atom_kv.transfer.gpu_ipc.host_seam import shared_buffer

                self._owner = shared_buffer(nbytes)
                self.array = self._owner.array
            else:
                self.array = np.zeros(nbytes, dtype=np.uint8)
            if fill is not None:
                self.array[:] = fill
            self.ptr = int(self.array.ctypes.data)

    @property
    def memory(self) -> Any:
        from atom_kv.transfer.memory import memory_of

        return memory_of(self.tensor if self.tensor is not None else self.array)

    def register(self, backend: Any, align: int) -> list[int]:
        return backend.register_memory(self.ptr, self.nbytes, align=align, memory=self.memory)

    def clear(self) -> None:
        if self.tensor is not None:
            self.tensor.zero_()
        else:
            assert self.array is not None
            self.array[:] = 0

    def blocks(self, block: int, which: np.ndarray, offset: int = 0) -> Any:
        """The bytes of blocks ``which`` (host: numpy; GPU: a tensor), ``offset`` bytes in."""
        if self.tensor is not None:
            import torch

            view = self.tensor[offset: offset + (self.nbytes - offset) // block * block].view(-1, block)
            return view[torch.from_numpy(which).to(view.device)]
        assert self.array is not None
        return self.array[offset: offset + (self.nbytes - offset) // block * block].reshape(-1, block)[which]

    def close(self) -> None:
        if self._owner is not None:
            self._owner.close_fd()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    import torch

    return bool(torch.equal(a, b))


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


# --------------------------------------------------------------------------
# the serving process
# --------------------------------------------------------------------------
def _make_backend(backend: str, cfg: Any, host: bool, key: str, delay_s: Optional[float]) -> Any:
    from atom_kv.transfer.tcp import TcpBackend

    if backend == "gpu_ipc":
        from atom_kv.transfer.gpu_ipc import GpuIpcBackend

        seam = None
        if host:
            from atom_kv.transfer.gpu_ipc.host_seam import HostSeam

            seam = HostSeam()
        return GpuIpcBackend(cfg, host="127.0.0.1", key=key, _seam=seam)
    be = TcpBackend(cfg, host="127.0.0.1", key=key)
    if delay_s is not None:  # staged host memory through a fake device
        from atom_kv.testing.fake_copier import FakeDeviceCopier

        be.stage_host_memory = True
        be.staging_copier = FakeDeviceCopier(delay_s)
    return be


def _variants(plan: Plan) -> list[tuple[str, Optional[float], bool]]:
    """(name, fake fence delay or None, GPU memory) of each backend both processes build."""
    if plan.backend == "gpu_ipc":
        return [("gpu_ipc", None, not plan.host)]
    if plan.host:
        return [("host tcp", None, False), ("staged", 0.0, False), ("staged, delayed fences", plan.fence_delay_s, False)]
    return [("host tcp", None, False), ("staged", None, True)]


def _serve(plan: Plan, conn: Any) -> None:
    from atom_kv.bench.transfer_common import pattern
    from atom_kv.config import KVTransferConfig

    backends: list[Any] = []
    buffers: list[Buffer] = []
    try:
        cfg = KVTransferConfig.from_dict({"kv_role": "kv_producer", **plan.config})
        data = pattern(plan.source_bytes(), SEED)
        host_buf: Optional[Buffer] = None  # one host buffer, registered with every backend that serves host memory

        def host_memory() -> Buffer:
            nonlocal host_buf
            if host_buf is None:
                host_buf = Buffer(len(data), cuda=False, memfd=plan.backend == "gpu_ipc", fill=data)
                buffers.append(host_buf)
            return host_buf

        out = []
        for _name, delay, gpu in _variants(plan):
            be = _make_backend(plan.backend, cfg, plan.host, f"bench-serve-{len(backends)}-{os.getpid()}", delay)
            backends.append(be)
            if gpu:
                buf = Buffer(len(data), cuda=True, memfd=False, fill=data)
                buffers.append(buf)
            else:
                buf = host_memory()
            ids = buf.register(be, plan.align())
            host_ids: list[int] = []
            if gpu and plan.backend == "tcp":  # the same bytes in host memory: a host-memory peer
                host_ids = host_memory().register(be, plan.align())
            out.append((be.export_descriptor(), ids, host_ids))
        conn.send(("ready", out))
    except Exception as exc:  # reported to the parent as one line
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    try:
        while not conn.poll(1.0) or conn.recv() != "stop":
            pass
    except EOFError:
        pass
    for be in backends:
        be.close()
    for buf in buffers:
        buf.close()


# --------------------------------------------------------------------------
# rows
# --------------------------------------------------------------------------
@dataclass
class Report:
    """The rows printed so far, whether bytes differed (``failed``: always exit status 1) and whether a
    held target was missed (``missed``: exit status 1 unless ``--explore``)."""

    plan: Plan
    failed: bool = False
    missed: bool = False
    rows: list[dict[str, Any]] = field(default_factory=list)

    def emit(self, row: dict[str, Any], text: str) -> None:
        row.update(backend=self.plan.backend, where=self.plan.where)
        if row.get("verified") is False:
            self.failed = True
        if row.get("held") and row.get("meets_target") is False:
            self.missed = True
        self.rows.append(row)
        print(json.dumps(row) if self.plan.as_json else text, flush=True)


def _target(row: dict[str, Any], text: str, met: bool, held: bool) -> str:
    row.update(target=text, meets_target=met, held=held)
    return f"target {text}: {'met' if met else 'MISSED'}" if held else f"target {text} ({_not_held(text)})"


def _not_held(text: str) -> str:
    return "a GPU target: not held on the host seam" if "GPU" in text else "a host-seam target: not held on a GPU"


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def _us(x: float) -> float:
    return round(x * 1e6, 2)


class Reader:
    """This process's side of one variant: its backend, its peer, the destination buffer."""

    def __init__(self, plan: Plan, name: str, backend: Any, peer: str, dst: Buffer, dst_ids: list[int],
                 src_ids: list[int], dst_chunk: int, src_chunk: int) -> None:
        self.plan, self.name, self.backend, self.peer, self.dst = plan, name, backend, peer, dst
        self.dst_ids, self.src_ids, self.dst_chunk, self.src_chunk = dst_ids, src_ids, dst_chunk, src_chunk

    def ops(self, local: np.ndarray, remote: np.ndarray, block: int, local_offset: int = 0) -> np.ndarray:
        return ops_for(local, remote, block, self.dst_ids, self.dst_chunk, self.src_ids, self.src_chunk, local_offset)

    def timed(self, ops: list[np.ndarray]) -> tuple[float, float, Optional[str]]:
        """Submit ``ops`` (reads in flight at once), wait for all: (submit s, total s, error)."""
        timeout = self.plan.timeout_s
        t0 = time.perf_counter()
        handles = [self.backend.read(self.peer, o, timeout_s=timeout) for o in ops]
        t1 = time.perf_counter()
        for h in handles:
            if not h.wait(timeout + 5):
                return t1 - t0, time.perf_counter() - t0, "read did not finish"
        t2 = time.perf_counter()
        err = next((h.error for h in handles if h.error), None)
        return t1 - t0, t2 - t0, err


def _verify(reader: Reader, source: Buffer, local: np.ndarray, remote: np.ndarray, block: int,
            offset: int = 0) -> bool:
    return _same(reader.dst.blocks(block, local, offset), source.blocks(block, remote))


def _submit_rows(report: Report, reader: Reader, source: Buffer) -> None:
    plan = report.plan
    local, remote = block_pairs("subset", SUBMIT_RANGES, SEED)
    ops = reader.ops(local, remote, SUBMIT_BLOCK)
    submits, totals = [], []
    error = None
    for _ in range(plan.iterations + 2):  # the first two warm the pools
        s, t, error = reader.timed([ops])
        if error:
            break
        submits.append(s)
        totals.append(t)
    submits, totals = submits[2:], totals[2:]
    ok = error is None and _verify(reader, source, local, remote, SUBMIT_BLOCK)
    p50 = _pct(submits, 50) * 1e6
    row = {"case": "submit", "ranges": SUBMIT_RANGES, "block_bytes": SUBMIT_BLOCK, "pattern": "subset",
           "submit_p50_us": round(p50, 2), "submit_p99_us": _us(_pct(submits, 99)),
           "total_p50_us": _us(_pct(totals, 50)), "iterations": len(submits), "verified": ok}
    if error:
        row["error"] = error
    tgt = _target(row, f"<= {SUBMIT_TARGET_US:g} us of host time per read (p50, host seam)",
                  bool(submits) and p50 <= SUBMIT_TARGET_US, held=plan.host)
    report.emit(row, f"gpu_ipc submit, {SUBMIT_RANGES} ranges of {SUBMIT_BLOCK} B scattered on both sides: "
                     f"p50 {row['submit_p50_us']:.1f} us, p99 {row['submit_p99_us']:.1f} us of host time "
                     f"(whole read p50 {row['total_p50_us']:.1f} us); {tgt}; verified={ok}")


def _latency_rows(report: Report, reader: Reader, source: Buffer) -> None:
    plan = report.plan
    for total in plan.latency:
        n = max(1, total // LATENCY_BLOCK)
        for pattern_name in plan.patterns:
            local, remote = block_pairs(pattern_name, n, SEED + n)
            ops = reader.ops(local, remote, LATENCY_BLOCK)
            submits, completions, totals = [], [], []
            error = None
            for _ in range(plan.iterations + 2):
                s, t, error = reader.timed([ops])
                if error:
                    break
                submits.append(s)
                completions.append(t - s)
                totals.append(t)
            submits, completions, totals = submits[2:], completions[2:], totals[2:]
            ok = error is None and _verify(reader, source, local, remote, LATENCY_BLOCK)
            row: dict[str, Any] = {"case": "latency", "total_kb": total >> 10, "block_kb": LATENCY_BLOCK >> 10,
                   "pattern": pattern_name, "submit_p50_us": _us(_pct(submits, 50)),
                   "submit_p99_us": _us(_pct(submits, 99)), "completion_p50_us": _us(_pct(completions, 50)),
                   "completion_p99_us": _us(_pct(completions, 99)), "p50_us": _us(_pct(totals, 50)),
                   "p99_us": _us(_pct(totals, 99)), "iterations": len(totals), "verified": ok}
            if error:
                row["error"] = error
            tgt = ""
            if total == 1 << 20:
                tgt = "; " + _target(row, f"<= {LATENCY_TARGET_US:g} us per read (p50, GPU)",
                                     bool(totals) and row["p50_us"] <= LATENCY_TARGET_US, held=not plan.host)
            report.emit(row, f"gpu_ipc latency, {total >> 10:>5} KiB in {LATENCY_BLOCK >> 10} KiB blocks, "
                             f"{pattern_name:>10}: p50 {row['p50_us']:.1f} us (submit {row['submit_p50_us']:.1f} + "
                             f"completion {row['completion_p50_us']:.1f}), p99 {row['p99_us']:.1f} us{tgt}; "
                             f"verified={ok}")


class Ceiling:
    """The same batched copies by address between two buffers of this process:
    the host seam's numpy copy, or the CUDA seam's driver copy on a stream
    (timed by the host clock around submit and synchronize, and by CUDA events)."""

    def __init__(self, plan: Plan, src: Buffer, dst: Buffer) -> None:
        self.plan, self.src, self.dst = plan, src, dst
        self._seam: Any = None
        self._stream: Any = None
        if not plan.host:
            import torch

            from atom_kv.transfer.gpu_ipc.cuda_seam import CudaSeam

            self._seam, self._stream, self._torch = CudaSeam(), torch.cuda.Stream(), torch

    def gbps(self, batches: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[float, Optional[float]]:
        """(GB/s by the host clock, GB/s by CUDA events or None) of one pass over ``batches``."""
        from atom_kv.transfer._device_copy import copy_by_address
        from atom_kv.transfer.gpu_ipc.plan import Batch

        nbytes = sum(int(s.sum()) for _, _, s in batches)
        if self._seam is None:
            t0 = time.perf_counter()
            for d, s, n in batches:
                copy_by_address(d, s, n)
            return nbytes / (time.perf_counter() - t0) / 1e9, None
        torch = self._torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record(self._stream)
        for d, s, n in batches:
            self._seam.copy(self._stream, Batch(0, 0, d, s, n))
        end.record(self._stream)
        end.synchronize()
        host = nbytes / (time.perf_counter() - t0) / 1e9
        return host, nbytes / (start.elapsed_time(end) * 1e-3) / 1e9

    def batches(self, local: np.ndarray, remote: np.ndarray, block: int, depth: int, step: int) -> list[Any]:
        from atom_kv.transfer._device_copy import coalesce

        out = []
        for k in range(depth):
            d = self.dst.ptr + k * step + local * block
            s = self.src.ptr + remote * block
            out.append(coalesce(d, s, np.full(len(local), block, dtype=np.int64)))
        return out


def _bandwidth_rows(report: Report, reader: Reader, source: Buffer, ceiling: Ceiling) -> None:
    plan = report.plan
    cases = [(plan.read, d) for d in plan.depths] + [(plan.big, 1)]
    for pattern_name in plan.patterns:
        for block in plan.blocks:
            for size, depth in cases:
                n = size // block
                local, remote = block_pairs(pattern_name, n, SEED + block + n)
                ops = [reader.ops(local, remote, block, local_offset=k * size) for k in range(depth)]
                rates, ceil_host, ceil_events = [], [], []
                error = None
                batches = ceiling.batches(local, remote, block, depth, size)
                for i in range(plan.iterations + 1):
                    _sync(not plan.host)
                    _, t, error = reader.timed(ops)
                    if error:
                        break
                    host_rate, event_rate = ceiling.gbps(batches)
                    if i:  # the first pass of each warms
                        rates.append(size * depth / t / 1e9)
                        ceil_host.append(host_rate)
                        if event_rate is not None:
                            ceil_events.append(event_rate)
                reader.dst.clear()
                _sync(not plan.host)
                if error is None:
                    reader.timed(ops)
                ok = error is None and all(_verify(reader, source, local, remote, block, k * size)
                                           for k in range(depth))
                gbps = statistics.median(rates) if rates else 0.0
                base = statistics.median(ceil_host) if ceil_host else 0.0
                row = {"case": "bandwidth", "pattern": pattern_name, "block_kb": block >> 10,
                       "total_mb": size >> 20, "queue_depth": depth, "gbps": round(gbps, 3),
                       "base": f"{pattern_name} ceiling", "base_gbps": round(base, 3),
                       "ratio": round(gbps / base, 3) if base else 0.0, "iterations": len(rates), "verified": ok}
                if ceil_events:
                    row["ceiling_events_gbps"] = round(statistics.median(ceil_events), 3)
                if error:
                    row["error"] = error
                tgt = ""
                if depth >= 4 or size == plan.big:
                    tgt = "; " + _target(row, f">= {CEILING_FRACTION} x {pattern_name} ceiling (GPU)",
                                         bool(rates) and gbps >= CEILING_FRACTION * base, held=not plan.host)
                events = (f", CUDA events {row['ceiling_events_gbps']:.2f}" if "ceiling_events_gbps" in row else "")
                report.emit(row, f"gpu_ipc {pattern_name:>10} {block >> 10:>5} KiB blocks, {size >> 20:>5} MiB x "
                                 f"qd {depth}: {gbps:8.2f} GB/s = {row['ratio']:.2f} x ceiling {base:.2f} GB/s "
                                 f"(host clock{events}){tgt}; verified={ok}")


def _tcp_rows(report: Report, readers: dict[str, Reader], source: Buffer, host_source: Optional[Buffer]) -> None:
    """Staged against host tcp (and, over the host seam, delayed fences against none), per block size."""
    plan = report.plan
    size = plan.big
    for pattern_name in plan.patterns:
        for block in plan.blocks:
            n = size // block
            local, remote = block_pairs(pattern_name, n, SEED + block)
            rates: dict[str, list[float]] = {name: [] for name in readers}
            ok = True
            error = None
            for i in range(plan.iterations + 1):
                for name, reader in readers.items():  # interleaved: none always runs in another's wake
                    _, t, error = reader.timed([reader.ops(local, remote, block)])
                    if error:
                        break
                    if i:
                        rates[name].append(size / t / 1e9)
                if error:
                    break
            for reader in readers.values():
                src = source if reader.dst.tensor is not None or host_source is None else host_source
                ok = ok and error is None and _verify(reader, src, local, remote, block)
            med = {name: statistics.median(v) if v else 0.0 for name, v in rates.items()}
            row: dict[str, Any] = {"case": "staged", "pattern": pattern_name, "block_kb": block >> 10,
                                   "total_mb": size >> 20, "iterations": plan.iterations, "verified": ok,
                                   **{f"{k.replace(' ', '_').replace(',', '')}_gbps": round(v, 3)
                                      for k, v in med.items()}}
            if error:
                row["error"] = error
            if plan.host:
                delayed, base = med.get("staged, delayed fences", 0.0), med.get("staged", 0.0)
                row.update(gbps=round(delayed, 3), base="staged without delay", base_gbps=round(base, 3),
                           ratio=round(delayed / base, 3) if base else 0.0)
                tgt = _target(row, f">= {DELAYED_FRACTION} x staged without delay, fences "
                                   f"{plan.fence_delay_s * 1e6:g} us late (host seam)",
                              bool(base) and delayed >= DELAYED_FRACTION * base, held=True)
                text = (f"tcp staged {pattern_name:>10} {block >> 10:>5} KiB blocks, {size >> 20} MiB reads: fences "
                        f"{plan.fence_delay_s * 1e6:g} us late {delayed:.2f} GB/s = {row['ratio']:.2f} x no delay "
                        f"{base:.2f} GB/s (host tcp {med.get('host tcp', 0.0):.2f}); {tgt}; verified={ok}")
            else:
                staged, base = med.get("staged", 0.0), med.get("host tcp", 0.0)
                row.update(gbps=round(staged, 3), base="host tcp", base_gbps=round(base, 3),
                           ratio=round(staged / base, 3) if base else 0.0)
                tgt = _target(row, f">= {STAGED_FRACTION} x host tcp (GPU, 1 MiB blocks)",
                              bool(base) and staged >= STAGED_FRACTION * base, held=block == 1 << 20)
                peer_row = med.get("staged from host peer")
                text = (f"tcp staged {pattern_name:>10} {block >> 10:>5} KiB blocks, {size >> 20} MiB reads: GPU from "
                        f"GPU {staged:.2f} GB/s = {row['ratio']:.2f} x host tcp {base:.2f} GB/s"
                        + (f", GPU from a host-memory peer {peer_row:.2f} GB/s" if peer_row is not None else "")
                        + f"; {tgt}; verified={ok}")
            report.emit(row, text)


# --------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from atom_kv.config import ConfigError

    if args.backend not in ("gpu_ipc", "tcp"):
        print(f"transfer bench: the device suite runs backends gpu_ipc and tcp, not {args.backend!r}",
              file=sys.stderr)
        return 2
    try:
        plan = _plan(args)
    except ConfigError as exc:
        print(f"transfer bench: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    if plan.host:
        if plan.backend == "gpu_ipc":
            from atom_kv.transfer.gpu_ipc.host_seam import HostSeam

            if (why := HostSeam.unavailable_reason()) is not None:
                print(f"transfer bench: --seam host: {why}", file=sys.stderr)
                return 2
    else:
        from atom_kv.transfer.memory import gpu_unavailable_reason

        if (why := gpu_unavailable_reason()) is not None:
            print(f"transfer bench: --device cuda: {why}; use --device cpu, or --seam host", file=sys.stderr)
            return 2
    return _run(plan)


def _run(plan: Plan) -> int:
    from atom_kv.bench.transfer_common import pattern
    from atom_kv.config import KVTransferConfig
    from atom_kv.transfer import TransferError, chunk_sizes

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(plan, child), name="bench-serve", daemon=True)
    proc.start()
    child.close()
    owned: list[Any] = []
    report = Report(plan)
    try:
        if not parent.poll(180):
            print("transfer bench: serving process did not start", file=sys.stderr)
            return 1
        msg = parent.recv()
        if msg[0] != "ready":
            print(f"transfer bench: serving process failed: {msg[1]}", file=sys.stderr)
            return 1
        cfg = KVTransferConfig.from_dict({"kv_role": "kv_consumer", **plan.config})
        data = pattern(plan.source_bytes(), SEED)
        gpu = not plan.host
        source = Buffer(len(data), cuda=gpu, memfd=False, fill=data)  # the reader's copy: verification, ceiling
        host_source = Buffer(len(data), cuda=False, memfd=False, fill=data) if gpu and plan.backend == "tcp" else None
        owned += [source] + ([host_source] if host_source else [])
        readers: dict[str, Reader] = {}
        align = plan.align()
        src_chunk = chunk_sizes(len(data), align)[0]
        for (name, delay, on_gpu), (desc, ids, host_ids) in zip(_variants(plan), msg[1]):
            be = _make_backend(plan.backend, cfg, plan.host, f"bench-read-{len(owned)}-{os.getpid()}", delay)
            owned.append(be)
            dst = Buffer(plan.dest_bytes(), cuda=on_gpu, memfd=plan.backend == "gpu_ipc" and plan.host)
            owned.append(dst)
            dst_ids = dst.register(be, align)
            dst_chunk = chunk_sizes(dst.nbytes, align, be.max_region_bytes)[0]
            try:
                peer = be.add_peer(desc)
            except TransferError as exc:
                print(f"transfer bench: cannot add peer: {exc}", file=sys.stderr)
                return 1
            readers[name] = Reader(plan, name, be, peer, dst, dst_ids, ids, dst_chunk, src_chunk)
            if host_ids:  # a GPU reader against the peer's host memory
                readers["staged from host peer"] = Reader(plan, "staged from host peer", be, peer, dst, dst_ids,
                                                          host_ids, dst_chunk, src_chunk)
        print(f"# transfer bench, device suite: {plan.backend} on {plan.where}; medians of {plan.iterations} "
              f"iterations; big read {plan.big >> 20} MiB" + (" (the host seam's default: 1 GiB on a GPU)"
                                                              if plan.host and plan.big == 64 << 20 else ""),
              file=sys.stderr if plan.as_json else sys.stdout, flush=True)
        if plan.backend == "gpu_ipc":
            reader = readers["gpu_ipc"]
            _submit_rows(report, reader, source)
            _latency_rows(report, reader, source)
            _bandwidth_rows(report, reader, source, Ceiling(plan, source, reader.dst))
        else:
            _tcp_rows(report, readers, source, host_source)
    finally:
        for thing in reversed(owned):
            thing.close()
        try:
            parent.send("stop")
        except OSError:
            pass
        proc.join(15)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return 1 if report.failed or (report.missed and not plan.explore) else 0
