"""``python -m atom_kv.bench connector --peers [N ...]``: one decode rank reading from N producer ranks.

For each backend (``tcp`` and ``cma`` unless ``--backend`` names one) and each N (1, 8 and 64 by
default), a fresh decode engine (scheduler, aggregator and one :class:`ConsumerWorker`, in a process
of its own so no earlier round's freed memory is reused) loads one request from each of N producer
engines at once. Each producer is a TP-1 :class:`ProducerWorker` with its own handshake port and
small host KV cache; ``--peer-procs`` processes host all of them (torch imported once, in a
forkserver). The figures:

- **memory per peer**: the decode process's resident set (``/proc/self/statm``) after first contact
  with the N peers, minus before it, over N. RSS rather than tracemalloc, because most of a peer's
  state is native: the tcp backend's reader threads (stacks) and sockets, ZeroMQ's sockets and
  their buffers. Threads and file descriptors added per peer are shown too. A warm-up load from one
  extra producer runs first, so the pools' threads and the first connections are not charged to
  the peers.
- **first contact p50/p99**: per peer, from the moment the N loads start (one engine step) to its
  handshake's completion (:meth:`ConsumerWorker.peer_handshakes`): queueing for a read thread and
  a handshake thread included, as a request sees it. p99 is the nearest rank (the slowest peer
  below 100 peers).
- **read throughput**: total GB/s with all N peers read at once, against one peer alone (the same
  request size), best of ``--repeats``.

Targets (met or MISSED): decode memory per producer peer <= 1 MiB (host-memory backends), first
contact p99 <= 200 ms with 64 peers at once (checked for the largest N when it is at least 64).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import secrets
import sys
import threading
import time
from typing import Any

import msgspec
import torch

from atom_kv.bench import targets as bench_targets
from atom_kv.bench.targets import Target
from atom_kv.config import KVTransferConfig
from atom_kv.connector.aggregator import KVOutputAggregator
from atom_kv.connector.consumer import ConsumerWorker
from atom_kv.connector.producer import ProducerWorker
from atom_kv.connector.scheduler import ConnectorScheduler
from atom_kv.connector.types import ConnectorMetadata, SendSpec
from atom_kv.gc_heap import freeze_startup_heap
from atom_kv.testing.ports import free_plan_base
from atom_kv.wire import CompatInfo

__all__ = ["DEFAULT_PEERS", "run"]

DEFAULT_PEERS = [1, 8, 64]
TARGET_PEER_BYTES = 1 << 20
TARGET_CONTACT_P99_MS = 200.0
TARGET_CONTACT_PEERS = 64
#: a child's answer to one command (a round at 64 peers, on a loaded 2-core host, takes seconds)
REPLY_TIMEOUT_S = 300.0
PRELOAD = ["torch", "atom_kv.connector", "atom_kv.transfer.tcp", "atom_kv.transfer.cma",
           "atom_kv.bench.connector_peers"]


def _caches(compat: CompatInfo, num_blocks: int, fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, compat.num_kv_heads, compat.block_size, compat.head_dim)
    return [(torch.full(shape, fill, dtype=torch.float16), torch.full(shape, fill, dtype=torch.float16))
            for _ in range(compat.num_layers)]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _reply(conn: Any) -> Any:
    if not conn.poll(REPLY_TIMEOUT_S):
        raise RuntimeError(f"no answer from a bench process within {REPLY_TIMEOUT_S:g} s")
    answer = conn.recv()
    if isinstance(answer, str) and answer.startswith("error:"):
        raise RuntimeError(answer)
    return answer


# -- producer processes ----------------------------------------------------------------------------
def _producers_main(conn: Any, cfg_dict: dict, compat_dict: dict, ranks: list[tuple[str, int]],
                    num_blocks: int) -> None:
    """Host ``ranks`` (engine id, handshake port) as TP-1 producer engines; obey the parent's pipe."""
    workers: dict[str, ProducerWorker] = {}
    try:
        compat = CompatInfo(**compat_dict)
        for engine_id, port in ranks:
            cfg = KVTransferConfig.from_resolved(dict(cfg_dict, handshake_port=port))
            w = ProducerWorker(cfg, engine_id=engine_id, host="127.0.0.1", tp_rank=0, tp_size=1, compat=compat,
                               bind_host="127.0.0.1")
            workers[engine_id] = w
            w.register_kv_caches(_caches(compat, num_blocks, 1.0))
    except Exception as exc:
        conn.send(f"error: {type(exc).__name__}: {exc}")
        for w in workers.values():
            w.close()
        return
    freeze_startup_heap()
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        by_engine: dict[str, list[SendSpec]] = {}
        for engine_id, transfer_id, blocks in msg:  # the transfers each producer's scheduler would issue
            by_engine.setdefault(engine_id, []).append(SendSpec(transfer_id=transfer_id, block_ids=blocks))
        for engine_id, sends in by_engine.items():
            workers[engine_id].start_load_kv(ConnectorMetadata(sends=sends))
            workers[engine_id].get_finished()
        conn.send("ok")
    for w in workers.values():
        w.close()
    conn.send("stopped")


# -- the decode process ----------------------------------------------------------------------------
class _Decode:
    """One decode engine (TP 1): scheduler, aggregator, one consumer worker, driven as an engine steps."""

    def __init__(self, cfg: KVTransferConfig, compat: CompatInfo, num_blocks: int, engine_id: str) -> None:
        self.worker = ConsumerWorker(cfg, engine_id=engine_id, host="127.0.0.1", tp_rank=0, tp_size=1,
                                     compat=compat)
        self.caches = _caches(compat, num_blocks, 0.0)
        self.worker.register_kv_caches(self.caches)
        self.sched = ConnectorScheduler(cfg, engine_id=engine_id, host="127.0.0.1", tp_size=1,
                                        block_size=compat.block_size)
        self.agg = KVOutputAggregator(1)
        self.block_size = compat.block_size

    def load(self, loads: list[tuple[str, str, int, list[int], list[int]]]) -> tuple[float, float]:
        """Load ``(request id, producer engine id, its port, local blocks, remote blocks)`` all at once;
        returns (monotonic time the loads started, wall seconds until every one was ready)."""
        for rid, engine_id, port, local, remote in loads:
            params = {"do_remote_prefill": True, "remote_block_ids": remote, "remote_engine_id": engine_id,
                      "remote_host": "127.0.0.1", "remote_port": port, "remote_handshake_port": port,
                      "remote_tp_size": 1, "remote_dp_rank": 0, "transfer_id": f"{engine_id}-{rid}"}
            tokens = len(local) * self.block_size
            self.sched.get_num_new_matched_tokens(rid, tokens, params)
            self.sched.update_state_after_alloc(rid, local, tokens)
        meta = self.sched.build_connector_meta()
        t0 = time.monotonic()
        self.worker.start_load_kv(meta)
        pending = {rid for rid, *_ in loads}
        while pending:
            ev = self.sched.update_connector_output(self.agg.aggregate([self.worker.get_finished()]))
            if ev.failed or ev.recompute:
                raise RuntimeError(f"bench load failed: {ev.failed or ev.recompute}")
            pending -= set(ev.ready)
            if pending:
                time.sleep(0.0005)
        wall = time.monotonic() - t0
        for rid, *_ in loads:
            self.sched.request_finished(rid, [])
        return t0, wall

    def close(self) -> None:
        self.sched.close()
        self.worker.close()


def _decode_main(conn: Any, cfg_dict: dict, compat_dict: dict, num_blocks: int, engine_id: str) -> None:
    """A decode engine in its own process; each command is a list of loads, answered with figures."""
    try:
        decode = _Decode(KVTransferConfig.from_resolved(cfg_dict), CompatInfo(**compat_dict), num_blocks, engine_id)
    except Exception as exc:
        conn.send(f"error: {type(exc).__name__}: {exc}")
        return
    freeze_startup_heap()
    conn.send("ready")
    try:
        while True:
            cmd, loads = conn.recv()
            if cmd == "stop":
                break
            try:
                before = (_rss(), threading.active_count(), _fds())
                t0, wall = decode.load(loads)
                after = (_rss(), threading.active_count(), _fds())
                ready = decode.worker.peer_handshakes()
                contact = [ready[k] - t0 for k in ready if ready[k] >= t0]
                conn.send({"wall_s": wall, "contact_s": contact, "rss": (before[0], after[0]),
                           "threads": (before[1], after[1]), "fds": (before[2], after[2]),
                           "peers_held": len(ready), "stats": decode.worker.stats()})
            except Exception as exc:
                conn.send(f"error: {type(exc).__name__}: {exc}")
    finally:
        decode.close()
    conn.send("stopped")


# -- the parent --------------------------------------------------------------------------------------
def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _stop(conn: Any, proc: Any, message: Any) -> None:
    """Ask a bench process to stop (``message``), wait for it, kill it if it does not end."""
    try:
        conn.send(message)
        _reply(conn)
    except (OSError, EOFError, RuntimeError):
        pass
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def _run_backend(args: argparse.Namespace, backend: str, ctx: Any) -> list[dict[str, Any]]:
    compat = CompatInfo(model_id="bench", dtype="float16", num_layers=args.layers, num_kv_heads=args.kv_heads,
                        head_dim=args.head_dim, block_size=args.block_size)
    nb = -(-args.peer_tokens // args.block_size)  # blocks per request
    total = max(args.peers) + 1  # the last one is the warm-up producer
    base = free_plan_base(total)
    ranks = [(f"bench-P{i}", base + i) for i in range(total)]
    common = dict(backend=backend, transfer_timeout_s=120.0, handshake_timeout_s=10.0,
                  auth_token=secrets.token_hex(16) if args.auth else None)
    pcfg = KVTransferConfig.from_resolved(dict(common, kv_role="kv_producer", handshake_port=base)).to_dict()
    ccfg = KVTransferConfig.from_resolved(dict(common, kv_role="kv_consumer", handshake_port=base)).to_dict()
    compat_dict = msgspec.structs.asdict(compat)
    nprocs = max(1, min(args.peer_procs, total))
    producers = []
    results = []
    try:
        for i in range(nprocs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_producers_main, args=(child, pcfg, compat_dict, ranks[i::nprocs], nb),
                            name=f"bench-peers-P{i}", daemon=True)
            p.start()
            child.close()
            producers.append((parent, p))
        for conn, _p in producers:
            _reply(conn)
        seq = 0

        def round_loads(picked: list[int]) -> list[tuple[str, str, int, list[int], list[int]]]:
            nonlocal seq
            loads = []
            for slot, i in enumerate(picked):
                seq += 1
                engine_id, port = ranks[i]
                loads.append((f"r{seq}", engine_id, port, list(range(slot * nb, (slot + 1) * nb)), list(range(nb))))
            sends: list[list[tuple[str, str, list[int]]]] = [[] for _ in producers]
            for slot, (rid, engine_id, _port, _local, remote) in enumerate(loads):
                sends[picked[slot] % nprocs].append((engine_id, f"{engine_id}-{rid}", remote))
            for (conn, _p), mine in zip(producers, sends):
                conn.send(mine)
            for conn, _p in producers:
                _reply(conn)
            return loads

        for n in args.peers:
            parent, child = ctx.Pipe()
            dp = ctx.Process(target=_decode_main, args=(child, ccfg, compat_dict, n * nb, f"bench-D-{backend}-{n}"),
                             name=f"bench-peers-D{n}", daemon=True)
            dp.start()
            child.close()
            try:
                _reply(parent)

                def decode(loads: list, conn: Any = parent) -> dict[str, Any]:
                    conn.send(("load", loads))
                    return _reply(conn)

                decode(round_loads([total - 1]))  # warm-up: the pools' threads, the first sockets
                first = decode(round_loads(list(range(n))))
                block_bytes = 2 * args.layers * args.kv_heads * args.block_size * args.head_dim * 2
                one, many = [], []
                for _ in range(args.repeats):  # interleaved, so load drift hits both alike
                    one.append(decode(round_loads([0]))["wall_s"])
                    many.append(decode(round_loads(list(range(n))))["wall_s"])
                rss0, rss1 = first["rss"]
                contact_ms = [1e3 * s for s in first["contact_s"]]
                rate_one = nb * block_bytes / min(one)
                rate_many = n * nb * block_bytes / min(many)
                results.append({
                    "backend": backend, "peers": n, "peers_held": first["peers_held"],
                    "request_mib": nb * block_bytes / 2**20,
                    "memory_per_peer_bytes": (rss1 - rss0) / n,
                    "threads_per_peer": (first["threads"][1] - first["threads"][0]) / n,
                    "fds_per_peer": (first["fds"][1] - first["fds"][0]) / n,
                    "contact_p50_ms": _percentile(contact_ms, 50) if contact_ms else None,
                    "contact_p99_ms": _percentile(contact_ms, 99) if contact_ms else None,
                    "contact_max_ms": max(contact_ms) if contact_ms else None,
                    "handshake_mean_ms": 1e3 * first["stats"]["handshake_seconds"] / max(1.0, first["stats"]["handshakes"]),
                    "first_round_s": first["wall_s"],
                    "gbps_all_peers": rate_many / 1e9, "gbps_one_peer": rate_one / 1e9,
                    "ratio_to_one_peer": rate_many / rate_one,
                })
            finally:
                _stop(parent, dp, ("stop", None))
    finally:
        for conn, p in producers:
            _stop(conn, p, "stop")
    return results


def peer_targets(results: list[dict[str, Any]]) -> list[Target]:
    """Memory per peer at every (backend, N); first contact p99 at the largest N when it is >= 64."""
    out = []
    for r in results:
        mem = r["memory_per_peer_bytes"]
        out.append(Target(f"{r['backend']} {r['peers']} peers memory per peer",
                          f"{mem / 1024:.0f} KiB <= {TARGET_PEER_BYTES / 1024:.0f} KiB", mem <= TARGET_PEER_BYTES))
    for backend in sorted({r["backend"] for r in results}):
        largest = max((r for r in results if r["backend"] == backend), key=lambda r: r["peers"])
        name = f"{backend} first contact with {TARGET_CONTACT_PEERS} peers at once, p99"
        if largest["peers"] < TARGET_CONTACT_PEERS:
            out.append(Target(name, f"not measured (largest N here is {largest['peers']})", None))
            continue
        p99 = largest["contact_p99_ms"]
        out.append(Target(name, f"{p99:.1f} ms with {largest['peers']} peers <= {TARGET_CONTACT_P99_MS:g} ms",
                          p99 <= TARGET_CONTACT_P99_MS))
    return out


def run(args: argparse.Namespace) -> int:
    backends = [args.backend] if args.backend else ["tcp", "cma"]
    if any(n < 1 for n in args.peers):
        print(f"error: --peers takes counts >= 1, got {' '.join(map(str, args.peers))}", file=sys.stderr)
        return 2
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results = [row for backend in backends for row in _run_backend(args, backend, ctx)]
    targets = peer_targets(results)
    if args.json:
        doc = {"mode": "peers", "shape": {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                                          "block_size": args.block_size, "dtype": "float16",
                                          "tokens_per_peer": args.peer_tokens},
               "targets": {"memory_per_peer_bytes": TARGET_PEER_BYTES, "contact_p99_ms": TARGET_CONTACT_P99_MS,
                           "contact_peers": TARGET_CONTACT_PEERS},
               "results": results, "meets_targets": all(t.met is not False for t in targets)}
        print(json.dumps(doc, indent=2))
        return bench_targets.report(targets, explore=args.explore, json_output=True)
    print(f"connector fan-in bench: one decode rank, N producer ranks, {args.peer_tokens} tokens from each "
          f"({results[0]['request_mib']:.1f} MiB), {args.layers} layers x K+V x {args.kv_heads} heads x "
          f"{args.head_dim} dim, float16, block {args.block_size}")
    print(f"{'backend':>7} {'N':>4} {'KiB/peer':>9} {'thr/peer':>8} {'fd/peer':>7} {'contact p50':>11} "
          f"{'p99 ms':>7} {'GB/s N':>7} {'GB/s 1':>7} {'ratio':>6}")
    for r in results:
        print(f"{r['backend']:>7} {r['peers']:>4} {r['memory_per_peer_bytes'] / 1024:>9.0f} "
              f"{r['threads_per_peer']:>8.1f} {r['fds_per_peer']:>7.1f} {r['contact_p50_ms']:>11.1f} "
              f"{r['contact_p99_ms']:>7.1f} {r['gbps_all_peers']:>7.2f} {r['gbps_one_peer']:>7.2f} "
              f"{r['ratio_to_one_peer']:>6.2f}")
    return bench_targets.report(targets, explore=args.explore)

