"""``python -m atom_kv.bench connector``: the connector's transfer rate against
the bare backend for the same block ranges, first-contact handshake latency,
and the connector's CPU time per request with many requests in flight.

Producer TP ranks run as separate processes holding a realistic KV cache
(32 layers, K+V, 8 KV heads x 128, float16, block 16 by default); the
consumer's TP ranks run in this process, driven exactly as an engine does.

Targets, each printed with met or MISSED (exit status 1 on a miss, unless
``--explore``): the connector at >= 0.8 x the bare backend's GB/s at every
prompt length, first contact < 15 ms, < 200 us of CPU per request.

``--peers [N ...]`` runs the fan-in bench instead: one decode rank reading
from N producer ranks at once (memory per peer, first-contact p50/p99, GB/s
against one peer; :mod:`atom_kv.bench.connector_peers`).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import secrets
import statistics
import time
from typing import Any

import msgspec
import torch
import zmq

from atom_kv._cli import OneLineParser
from atom_kv.bench import connector_peers, targets as bench_targets
from atom_kv.bench.connector_peers import DEFAULT_PEERS
from atom_kv.bench.targets import Target
from atom_kv.config import KVTransferConfig
from atom_kv.connector.aggregator import KVOutputAggregator
from atom_kv.connector.handshake import handshake_port, request_handshake
from atom_kv.connector.layout import TensorLayout, block_runs, head_overlaps, plan_reads
from atom_kv.connector.scheduler import ConnectorScheduler
from atom_kv.connector.consumer import ConsumerWorker
from atom_kv.connector.producer import ProducerWorker
from atom_kv.connector.types import ConnectorMetadata, SendSpec
from atom_kv.gc_heap import FullCollections, freeze_startup_heap
from atom_kv.testing.ports import free_plan_base
from atom_kv.transfer import ChunkedRegion, chunk_sizes, create_backend
from atom_kv.wire import CompatInfo, HandshakeRequest

logger = logging.getLogger(__name__)

TARGET_RATIO = 0.80
#: first contact with a producer rank (handshake request, proof, reply, the
#: backend's add_peer) at every TP size; a full garbage collection of the
#: bench's start-up heap once landed in it (73-80 ms at TP 1)
TARGET_HANDSHAKE_MS = 15.0
TARGET_OVERHEAD_US = 200.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default=None, choices=["auto", "tcp", "cma"],
                        help="default: auto (with --peers: tcp, then cma)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes (same on both sides)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192], help="prompt lengths")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="timed loads per prompt length (best is reported)")
    parser.add_argument("--inflight", type=int, default=256, help="requests in flight for the CPU overhead figure")
    parser.add_argument("--overhead-tokens", type=int, default=16,
                        help="prompt length for the CPU overhead figure (short: on a CPU-only host the data "
                             "copy shares the cores and caches with the hooks and inflates their CPU time)")
    parser.add_argument("--no-auth", dest="auth", action="store_false",
                        help="run without an auth_token (by default both sides share a random one, so the "
                             "handshake is the challenge-response of a secured cluster)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    fan_in = parser.add_argument_group("fan-in (--peers)")
    fan_in.add_argument("--peers", type=int, nargs="*", default=None, metavar="N",
                        help="run the fan-in bench instead: one decode rank (TP 1) loading one request from each "
                             "of N producer ranks (TP-1 engines, each with its own handshake port) at once; "
                             "memory per peer, first-contact p50/p99, GB/s against one peer. "
                             f"Without values: {' '.join(map(str, DEFAULT_PEERS))}")
    fan_in.add_argument("--peer-tokens", type=int, default=64,
                        help="prompt length read from each producer rank (with the default shape: 8 MiB)")
    fan_in.add_argument("--peer-procs", type=int, default=8,
                        help="processes hosting the producer ranks (the ranks are spread evenly over them)")
    bench_targets.add_arguments(parser)


def _caches(compat: CompatInfo, tp: int, num_blocks: int, fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, compat.num_kv_heads // tp, compat.block_size, compat.head_dim)
    return [(torch.full(shape, fill, dtype=torch.float16), torch.full(shape, fill, dtype=torch.float16))
            for _ in range(compat.num_layers)]


def _producer_main(conn: Any, cfg_dict: dict, compat_dict: dict, tp_rank: int, tp: int, num_blocks: int) -> None:
    try:
        cfg = KVTransferConfig.from_resolved(cfg_dict)
        compat = CompatInfo(**compat_dict)
        worker = ProducerWorker(cfg, engine_id="bench-P", host="127.0.0.1", tp_rank=tp_rank, tp_size=tp,
                                compat=compat, bind_host="127.0.0.1")
        worker.register_kv_caches(_caches(compat, tp, num_blocks, 1.0))
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    freeze_startup_heap()  # as an engine does once it has started
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        # the transfers a producer engine's scheduler would have issued (only those are confirmed)
        worker.start_load_kv(ConnectorMetadata(sends=[SendSpec(transfer_id=t, block_ids=b) for t, b in msg]))
        conn.send(worker.get_finished())  # and drain its done-reading bookkeeping
    worker.close()
    conn.send("stopped")


class _Consumer:
    """The consumer engine: scheduler + TP workers in this process, hook CPU time accounted."""

    def __init__(self, cfg: KVTransferConfig, compat: CompatInfo, tp: int, num_blocks: int,
                 producers: list[Any]) -> None:
        self.tp = tp
        self._producers = producers  # pipes to the producer ranks' processes
        self.workers = [ConsumerWorker(cfg, engine_id="bench-D", host="127.0.0.1", tp_rank=r, tp_size=tp,
                                       compat=compat) for r in range(tp)]
        self.caches = [_caches(compat, tp, num_blocks, 0.0) for _ in range(tp)]
        for w, c in zip(self.workers, self.caches):
            w.register_kv_caches(c)
        self.sched = ConnectorScheduler(cfg, engine_id="bench-D", host="127.0.0.1", tp_size=tp,
                                        block_size=compat.block_size)
        self.agg = KVOutputAggregator(tp)
        self.cpu = 0.0
        self.parts: dict[str, float] = {}
        self.idle_cpu = 0.0
        self.idle_steps = 0
        self._seq = 0

    def _add(self, part: str, seconds: float) -> None:
        self.cpu += seconds
        self.parts[part] = self.parts.get(part, 0.0) + seconds

    def run(self, requests: list[tuple[int, list[int], list[int]]], port: int, step_s: float = 0.0005) -> float:
        """Load ``(tokens, local_blocks, remote_blocks)`` requests concurrently; returns wall seconds."""
        rids, all_params = [], []
        for _tokens, _local, remote in requests:
            self._seq += 1
            rid = f"b{self._seq}"
            rids.append(rid)
            all_params.append({"do_remote_prefill": True, "remote_block_ids": remote, "remote_engine_id": "bench-P",
                               "remote_host": "127.0.0.1", "remote_port": port, "remote_handshake_port": port,
                               "remote_tp_size": self.tp, "remote_dp_rank": 0, "transfer_id": f"bench-P-{rid}"})
        sends = [(p["transfer_id"], remote) for p, (_, _, remote) in zip(all_params, requests)]
        for conn in self._producers:
            conn.send(sends)
        for conn in self._producers:
            conn.recv()
        c0 = time.thread_time()
        for rid, params, (tokens, local, _) in zip(rids, all_params, requests):
            self.sched.get_num_new_matched_tokens(rid, tokens, params)
            self.sched.update_state_after_alloc(rid, local, tokens)
        c1 = time.thread_time()
        meta = self.sched.build_connector_meta()
        t0 = time.perf_counter()
        for w in self.workers:
            w.start_load_kv(meta)
        c2 = time.thread_time()
        self._add("admit", c1 - c0)
        self._add("start", c2 - c1)
        pending = set(rids)
        while pending:
            c0 = time.thread_time()
            out = self.agg.aggregate([w.get_finished() for w in self.workers])
            ev = self.sched.update_connector_output(out)
            if ev.failed or ev.recompute:
                raise RuntimeError(f"bench load failed: {ev.failed or ev.recompute}")
            pending -= set(ev.ready)
            # steps that completed requests are per-request work; empty polls are the engine's
            # per-step cost, reported separately (an engine pays it once per step, not per request)
            if ev.ready:
                self._add("step", time.thread_time() - c0)
            else:
                self.idle_cpu += time.thread_time() - c0
                self.idle_steps += 1
            if pending:
                time.sleep(step_s)
        elapsed = time.perf_counter() - t0
        c0 = time.thread_time()
        for rid in rids:
            self.sched.request_finished(rid, [])
        self._add("finish", time.thread_time() - c0)
        return elapsed

    def stats(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for w in self.workers:
            for k, v in w.stats().items():
                total[k] = total.get(k, 0.0) + v
        return total

    def close(self) -> None:
        self.sched.close()
        for w in self.workers:
            w.close()


class _BareReader:
    """The same block ranges read straight through fresh backend instances
    (one per consumer rank), with the reads planned up front."""

    def __init__(self, cfg: KVTransferConfig, compat: CompatInfo, consumer: _Consumer, port: int) -> None:
        self.cfg = cfg
        self.compat = compat
        self.tp = consumer.tp
        self._ctx = zmq.Context()
        self._backends: list[Any] = []
        self._peers: list[tuple[Any, str, Any, list[TensorLayout], list[TensorLayout]]] = []
        try:
            for r in range(consumer.tp):
                be = create_backend(cfg.backend, cfg, host="127.0.0.1", key=f"bench-bare-{r}")
                self._backends.append(be)
                local = []
                for layer, pair in enumerate(consumer.caches[r]):
                    for kind, t in zip(("k", "v"), pair):
                        n = t.numel() * t.element_size()
                        bb = n // t.shape[0]
                        ids = be.register_memory(t.data_ptr(), n, align=bb)
                        local.append(TensorLayout(layer, kind, ChunkedRegion(tuple(ids), chunk_sizes(n, bb)[0], n),
                                                  bb, t.shape[0]))
                for ov in head_overlaps(compat.num_kv_heads, consumer.tp, r, consumer.tp):
                    req = HandshakeRequest(engine_id=f"bench-bare-{r}", tp_rank=r, tp_size=consumer.tp,
                                           compat=compat, backend=be.name, host="127.0.0.1")
                    reply = request_handshake(self._ctx, "127.0.0.1",
                                              handshake_port(port, 0, consumer.tp, ov.remote_rank), req, 10.0,
                                              auth_token=cfg.auth_token)
                    if not reply.ok:
                        raise RuntimeError(reply.error)
                    peer = be.add_peer(reply.descriptor)
                    remote = [TensorLayout(x.layer, x.kind, ChunkedRegion(tuple(x.region_ids), x.chunk_bytes,
                                                                          x.num_blocks * x.block_bytes),
                                           x.block_bytes, x.num_blocks) for x in reply.regions]
                    self._peers.append((be, peer, ov, local, remote))
        except BaseException:
            self.close()
            raise

    def time_once(self, nblocks: int) -> float:
        """Seconds to read ``nblocks`` blocks on every rank concurrently."""
        heads = self.compat.num_kv_heads // self.tp
        runs = block_runs(list(range(nblocks)), list(range(nblocks)))
        jobs = [(be, peer, plan_reads(local, remote, ov, runs, local_heads=heads, remote_heads=heads))
                for be, peer, ov, local, remote in self._peers]
        t0 = time.perf_counter()
        handles = [be.read(peer, ops, timeout_s=self.cfg.transfer_timeout_s) for be, peer, ops in jobs]
        for h in handles:
            h.wait(self.cfg.transfer_timeout_s)
            if h.error:
                raise RuntimeError(h.error)
        return time.perf_counter() - t0

    def close(self) -> None:
        for be in self._backends:
            be.close()
        self._backends = []
        self._ctx.destroy(linger=0)


def _run_tp(args: argparse.Namespace, tp: int) -> dict[str, Any]:
    compat = CompatInfo(model_id="bench", dtype="float16", num_layers=args.layers, num_kv_heads=args.kv_heads,
                        head_dim=args.head_dim, block_size=args.block_size)
    max_blocks = -(-max(args.tokens) // args.block_size)
    num_blocks = max(max_blocks, 2 * -(-args.overhead_tokens // args.block_size))
    port = free_plan_base(tp)
    common = dict(backend=args.backend, handshake_port=port, transfer_timeout_s=120.0, handshake_timeout_s=10.0,
                  auth_token=secrets.token_hex(16) if getattr(args, "auth", True) else None)
    pcfg = KVTransferConfig.from_resolved(dict(common, kv_role="kv_producer"))  # a token made here: no warning
    ccfg = KVTransferConfig.from_resolved(dict(common, kv_role="kv_consumer"))
    ctx = mp.get_context("spawn")
    procs = []
    for r in range(tp):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_producer_main, args=(child, pcfg.to_dict(), msgspec.structs.asdict(compat),
                                                     r, tp, num_blocks), name=f"bench-P-tp{r}", daemon=True)
        p.start()
        procs.append((p, parent))
    consumer = None
    try:
        for p, conn in procs:
            status = conn.recv() if conn.poll(120) else "no answer within 120 s"
            if status != "ready":
                raise RuntimeError(f"{p.name} did not start: {status}")
        consumer = _Consumer(ccfg, compat, tp, num_blocks, [conn for _, conn in procs])
        block_bytes = 2 * args.layers * args.kv_heads * args.block_size * args.head_dim * 2  # all ranks
        result: dict[str, Any] = {"tp": tp, "rows": []}
        freeze_startup_heap()  # as an engine does once it has started
        # first contact
        with FullCollections() as full_gc:
            consumer.run([(args.block_size, [0], [0])], port)
        st = consumer.stats()
        result["handshake_ms"] = 1e3 * st["handshake_seconds"] / max(1.0, st["handshakes"])
        result["handshake_met"] = handshake_met(result["handshake_ms"])
        result["first_contact_full_gc_ms"] = 1e3 * full_gc.seconds
        bare = _BareReader(ccfg, compat, consumer, port)
        try:
            bare.time_once(1)  # warm the bare path's connections up
            rows = []
            for tokens in args.tokens:
                nb = -(-tokens // args.block_size)
                blocks = list(range(nb))
                times, bare_times = [], []
                for _ in range(args.repeats):  # interleaved, so load drift hits both alike
                    times.append(consumer.run([(tokens, blocks, blocks)], port))
                    bare_times.append(bare.time_once(nb))
                rows.append((tokens, nb, times, bare_times))
        finally:
            bare.close()
        for tokens, nb, times, bare_times in rows:
            conn_rate = nb * block_bytes / min(times)
            bare_rate = nb * block_bytes / min(bare_times)
            result["rows"].append({
                "tokens": tokens, "mib": nb * block_bytes / 2**20,
                "connector_gbps": conn_rate / 1e9, "bare_gbps": bare_rate / 1e9,
                "median_s": statistics.median(times), "ratio": conn_rate / bare_rate,
            })
        # CPU overhead per request with many in flight (destinations may overlap: bench only)
        nb = -(-args.overhead_tokens // args.block_size)
        reqs = []
        for i in range(args.inflight):
            start = (i * nb) % max(1, num_blocks - nb)
            reqs.append((args.overhead_tokens, list(range(start, start + nb)), list(range(start, start + nb))))
        consumer.run(reqs, port, step_s=0.005)  # warm-up round: steady state is what is reported
        consumer.cpu = 0.0
        consumer.parts = {}
        consumer.idle_cpu, consumer.idle_steps = 0.0, 0
        plan0 = consumer.stats()["plan_cpu_seconds"]
        wall = consumer.run(reqs, port, step_s=0.005)  # an engine steps every few ms
        plan = consumer.stats()["plan_cpu_seconds"] - plan0
        result["overhead_us"] = 1e6 * (consumer.cpu + plan) / args.inflight
        result["overhead_hooks_us"] = 1e6 * consumer.cpu / args.inflight
        result["overhead_plan_us"] = 1e6 * plan / args.inflight
        result["overhead_parts_us"] = {k: 1e6 * v / args.inflight for k, v in consumer.parts.items()}
        result["idle_step_us"] = 1e6 * consumer.idle_cpu / max(1, consumer.idle_steps)
        result["overhead_wall_s"] = wall
        return result
    finally:
        if consumer is not None:
            consumer.close()
        for _p, conn in procs:
            try:
                conn.send("stop")
            except OSError:
                pass
        for p, _ in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def run(args: argparse.Namespace) -> int:
    if args.peers is not None:
        if not args.peers:
            args.peers = list(DEFAULT_PEERS)
        return connector_peers.run(args)
    if args.backend is None:
        args.backend = "auto"
    results = [_run_tp(args, tp) for tp in args.tp]
    targets = connector_targets(results, args.inflight)
    ok = all(t.met for t in targets)
    doc = {"backend": args.backend, "shape": {"layers": args.layers, "kv_heads": args.kv_heads,
                                              "head_dim": args.head_dim, "block_size": args.block_size,
                                              "dtype": "float16"},
           "targets": {"ratio": TARGET_RATIO, "handshake_ms": TARGET_HANDSHAKE_MS, "overhead_us": TARGET_OVERHEAD_US},
           "results": results, "meets_targets": ok}
    if args.json:
        print(json.dumps(doc, indent=2))
        return bench_targets.report(targets, explore=args.explore, json_output=True)
    print(f"connector bench, backend={args.backend}, {args.layers} layers x K+V x {args.kv_heads} heads x "
          f"{args.head_dim} dim, float16, block {args.block_size}")
    print(f"{'TP':>3} {'tokens':>7} {'MiB':>7} {'connector GB/s':>15} {'bare GB/s':>10} {'ratio':>6}")
    for r in results:
        for row in r["rows"]:
            print(f"{r['tp']:>3} {row['tokens']:>7} {row['mib']:>7.0f} {row['connector_gbps']:>15.2f} "
                  f"{row['bare_gbps']:>10.2f} {row['ratio']:>6.2f}")
    for r in results:
        print(f"TP {r['tp']}: connector CPU {r['overhead_us']:.0f} us/request at {args.inflight} in flight "
              f"(hooks {r['overhead_hooks_us']:.0f} + read planning {r['overhead_plan_us']:.0f}); "
              f"an empty engine step costs {r['idle_step_us']:.0f} us")
    return bench_targets.report(targets, explore=args.explore)


def connector_targets(results: list[dict[str, Any]], inflight: int) -> list[Target]:
    """Every TP size's targets: the connector's rate against the bare backend at each prompt length, the
    first-contact handshake and the CPU per request with ``inflight`` requests in flight."""
    out = []
    for r in results:
        for row in r["rows"]:
            out.append(Target(f"TP {r['tp']} {row['tokens']} tokens",
                              f"connector / bare backend {row['ratio']:.2f} >= {TARGET_RATIO:g} (connector "
                              f"{row['connector_gbps']:.2f} GB/s, bare {row['bare_gbps']:.2f} GB/s)",
                              row["ratio"] >= TARGET_RATIO))
        out.append(handshake_target(r))
        out.append(Target(f"TP {r['tp']} CPU per request",
                          f"{r['overhead_us']:.0f} us at {inflight} in flight < {TARGET_OVERHEAD_US:g} us",
                          r["overhead_us"] < TARGET_OVERHEAD_US))
    return out


def handshake_met(ms: float) -> bool:
    return ms < TARGET_HANDSHAKE_MS


def handshake_target(r: dict[str, Any]) -> Target:
    """One TP size's first-contact handshake against its target, and the
    full garbage collections that ran meanwhile (they are not the handshake's)."""
    gc_ms = r.get("first_contact_full_gc_ms", 0.0)
    gc_note = f" (a full garbage collection took {gc_ms:.1f} ms of the first load)" if gc_ms > 0 else ""
    return Target(f"TP {r['tp']} first-contact handshake",
                  f"{r['handshake_ms']:.2f} ms < {TARGET_HANDSHAKE_MS:g} ms{gc_note}", handshake_met(r["handshake_ms"]))


def main(argv: list[str] | None = None) -> int:
    """Run this suite alone: ``python -m atom_kv.bench.connector``."""
    parser = OneLineParser(prog="python -m atom_kv.bench.connector", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
