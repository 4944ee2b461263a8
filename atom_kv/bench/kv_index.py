"""The proxy's KV event index: ``python -m atom_kv.bench kv-index``.

Two figures, each printed with its target and met or missed:

- **blocks/s, decoded and applied on one core**: vLLM-wire messages (``[topic, seq, payload]``, positional
  batches, or maps with ``--map``) made up front, then decoded and applied to a :class:`KvIndex` on this
  thread, timed in this thread's CPU time (``time.thread_time``: other processes on a busy machine do not
  count, a slower core does). The stream is a steady state: each batch stores ``--run`` blocks in each of
  ``--events`` runs (16 tokens a block, unsigned 64-bit hashes past 2^63, each run continuing a chain) and
  removes as many older blocks, so the index stays at ``--blocks`` entries; the fastest of ``--rounds``
  rounds counts (the median is printed too). Target: >= 300,000 blocks/s.
- **bytes per (block, instance) entry**: ``tracemalloc`` over an index filled with ``--workers`` x
  ``--blocks-per-worker`` entries, every block held by one worker only (an entry shares nothing with
  another worker's, so this is also what a shared prefix costs per worker), after a quarter of them were
  removed and as many stored again (what a running index looks like). Target: <= 160 B.

- **event lag p99**: the same kind of batches published over a real ZeroMQ PUB socket on 127.0.0.1 at
  ``--lag-rate`` batches a second, each stamped as it is sent, to the proxy's own subscriber thread
  (:class:`KvEventSubscriber`), which records each live batch's lag from its stamp to its events applied
  (``atom_kv_proxy_kv_event_lag_seconds``); the p99 is the upper bound of the histogram bucket that holds it.
  Target: <= 50 ms.

It also prints one query's cost (``longest_prefix`` of a ``--prompt-tokens`` prompt that every worker
holds), for the routing step that will call it.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import tracemalloc
from typing import Any, Optional

import msgspec

from atom_kv.bench import targets as bench_targets
from atom_kv.proxy.kv_events.index import KvIndex
from atom_kv.proxy.kv_events.stats import KvEventStats
from atom_kv.proxy.kv_events.subscriber import FeedSpec, KvEventSubscriber, SubscriberLimits
from atom_kv.proxy.kv_events.wire import (
    BlockRemoved, BlockStored, EngineHash, EventBatch, EventDecoder, MapBlockRemoved, MapBlockStored, MapEventBatch,
    encode_seq,
)

TARGET_BYTES = 160
TARGET_BLOCKS_PER_S = 300_000
TARGET_LAG_P99_S = 0.05
BLOCK = 16
HASH_BASE = (1 << 63) + 12345  # vLLM's hashes run past 2^63: unsigned on the wire


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    bench_targets.add_arguments(parser)
    parser.add_argument("--messages", type=int, default=2000, help="batches in the throughput stream")
    parser.add_argument("--events", type=int, default=8, help="BlockStored runs per batch (one per request)")
    parser.add_argument("--run", type=int, default=16, help="blocks per run")
    parser.add_argument("--blocks", type=int, default=100_000, help="entries the throughput stream keeps")
    parser.add_argument("--map", action="store_true", help="map-shaped events (vLLM since PR #42892)")
    parser.add_argument("--rounds", type=int, default=5, help="throughput rounds; the fastest counts")
    parser.add_argument("--workers", type=int, default=2, help="memory: (instance, DP rank) workers")
    parser.add_argument("--blocks-per-worker", type=int, default=100_000,
                        help="memory: entries per worker (the target's row; a quarter and twice as many are "
                             "printed too)")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="query: prompt length")
    parser.add_argument("--lag-messages", type=int, default=2000, help="lag: batches published")
    parser.add_argument("--lag-rate", type=float, default=500.0,
                        help="lag: batches a second (8 runs x 16 blocks each by default: 64,000 blocks/s)")


class _Stream:
    """Runs of blocks, each new or continuing one of the last few chains (as a request's prefill and then
    its decode fill blocks), every chain's content its own."""

    def __init__(self) -> None:
        self.next_hash = HASH_BASE
        self.chains: list[tuple[int, EngineHash]] = []  # (chain id, its last block's hash)
        self.next_chain = 0

    def run(self, blocks: int, continue_chain: bool) -> tuple[list[EngineHash], Optional[EngineHash], list[int]]:
        parent: Optional[EngineHash]
        if continue_chain and self.chains:
            chain, parent = self.chains.pop(0)
        else:
            chain, parent = self.next_chain, None
            self.next_chain += 1
        hashes: list[EngineHash] = list(range(self.next_hash, self.next_hash + blocks))
        self.next_hash += blocks
        base = (chain * 7919) % 100_000
        tokens = [(base + i * 31) % 150_000 for i in range(blocks * BLOCK)]
        tokens[0] = chain % 150_000  # a chain of its own
        self.chains.append((chain, hashes[-1]))
        return hashes, parent, tokens


def _messages(args: argparse.Namespace) -> tuple[list[list[bytes]], int]:
    """The throughput stream, encoded; and the blocks it stores."""
    enc = msgspec.msgpack.Encoder()
    stream = _Stream()
    stored: list[EngineHash] = []
    frames, total = [], 0
    stored_cls, removed_cls, batch_cls = ((MapBlockStored, MapBlockRemoved, MapEventBatch) if args.map
                                          else (BlockStored, BlockRemoved, EventBatch))
    for seq in range(args.messages):
        events: list[Any] = []
        for _ in range(args.events):
            hashes, parent, tokens = stream.run(args.run, continue_chain=len(stream.chains) > 32)
            events.append(stored_cls(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                     block_size=BLOCK))
            stored.extend(hashes)
            total += len(hashes)
        if len(stored) > args.blocks:
            cut = len(stored) - args.blocks
            events.append(removed_cls(block_hashes=stored[:cut]))
            del stored[:cut]
        frames.append([b"", encode_seq(seq), enc.encode(batch_cls(ts=time.time(), events=events,
                                                                     data_parallel_rank=0))])
    return frames, total


def _throughput(args: argparse.Namespace) -> dict[str, Any]:
    """The stream decoded and applied ``--rounds`` times, each into a new index; the fastest round counts
    (what the code costs; the slower ones measure the machine's other load)."""
    frames, blocks = _messages(args)
    decoder = EventDecoder(64 << 20)
    rounds = []
    for _ in range(args.rounds):
        index = KvIndex(max_blocks=4 * args.blocks + 1_000_000, max_blocks_per_worker=4 * args.blocks + 1_000_000)
        gc.collect()
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        for message in frames:
            batch = decoder.decode_frames(message)
            index.apply("bench", batch.dp_rank or 0, batch.events)
        rounds.append((time.thread_time() - cpu0, time.perf_counter() - wall0))
        skipped = sum(index.stats.skipped_runs.values())
        if skipped:
            raise RuntimeError(f"the bench stream had {skipped} runs the index skipped: {index.stats.skipped_runs}")
    cpu, wall = min(rounds)
    return {"blocks": blocks, "rounds": len(rounds), "cpu_s": cpu, "wall_s": wall, "blocks_per_s": blocks / cpu,
            "median_blocks_per_s": blocks / sorted(r[0] for r in rounds)[len(rounds) // 2],
            "wall_blocks_per_s": blocks / wall, "entries": index.entries,
            "bytes_per_message": sum(len(f[2]) for f in frames) / len(frames)}


def _lag(args: argparse.Namespace) -> dict[str, Any]:
    """Batches published at ``--lag-rate`` to a real subscriber thread; its lag histogram's p50 and p99."""
    import zmq

    frames, _ = _messages(argparse.Namespace(**{**vars(args), "messages": args.lag_messages}))
    dec = msgspec.msgpack.Decoder()
    enc = msgspec.msgpack.Encoder()
    batch_cls = MapEventBatch if args.map else EventBatch
    # each batch's events, re-stamped as it is sent (a positional batch is [ts, events, dp_rank])
    bodies = [b["events"] if isinstance(b, dict) else b[1] for b in (dec.decode(f[2]) for f in frames)]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    stats = KvEventStats()
    index = KvIndex(max_blocks=1 << 22, max_blocks_per_worker=1 << 22, stats=stats)
    sub = KvEventSubscriber(index, SubscriberLimits(max_message_bytes=64 << 20, hwm=100_000, replay_timeout_s=2.0,
                                                    max_pending=1000, close_timeout_s=5.0))
    try:
        sub.follow(FeedSpec("bench", f"tcp://127.0.0.1:{port}", None, 1))
        seq = 0
        deadline = time.monotonic() + 10.0
        while not stats.batches:  # the slow joiner: a PUB drops what it sends before the SUB is connected
            if time.monotonic() > deadline:
                raise RuntimeError("the subscriber did not connect to the bench's publisher within 10 s")
            pub.send_multipart([b"", encode_seq(seq), enc.encode(batch_cls(ts=time.time(), events=[],
                                                                         data_parallel_rank=0))])
            seq += 1
            sub.wait_for(lambda: stats.batches > 0, 0.05)
        stats.lag_counts = [0] * len(stats.lag_counts)  # only the measured stream counts
        stats.lag_sum_s = 0.0
        interval = 1.0 / args.lag_rate
        start = time.perf_counter()
        for i, body in enumerate(bodies):
            wait = start + i * interval - time.perf_counter()
            if wait > 0:
                time.sleep(wait)  # paced: a sleep between sends, not a spin
            pub.send_multipart([b"", encode_seq(seq), enc.encode(batch_cls(ts=time.time(), events=body,
                                                                         data_parallel_rank=0))])
            seq += 1
        total = seq - 1
        if not sub.wait_for(lambda: sum(stats.lag_counts) >= len(bodies), 30.0):
            raise RuntimeError(f"the subscriber applied {sum(stats.lag_counts)} of {len(bodies)} batches in 30 s "
                               f"(gaps {stats.gaps}); the publisher ran to seq {total}")
    finally:
        sub.close()
        pub.close()
        ctx.term()
    return {"batches": len(bodies), "rate": args.lag_rate, "p50_s": stats.lag_quantile(0.5),
            "p99_s": stats.lag_quantile(0.99), "mean_s": stats.lag_sum_s / max(1, sum(stats.lag_counts))}


def _fill(index: KvIndex, worker: str, chains: list[tuple[int, list[EngineHash]]], run: int) -> list[list[EngineHash]]:
    """Store ``chains`` (first token, blocks) in ``worker``; the engine hashes of each chain."""
    out = []
    for start, hashes in chains:
        tokens = [(start * 7919 + i * 31) % 150_000 for i in range(len(hashes) * BLOCK)]
        tokens[0] = start % 150_000
        parent = None
        for i in range(0, len(hashes), run):
            part = hashes[i:i + run]
            index.apply(worker, 0, [BlockStored(block_hashes=part, parent_block_hash=parent,
                                                token_ids=tokens[i * BLOCK:(i + len(part)) * BLOCK],
                                                block_size=BLOCK)])
            parent = part[-1]
        out.append(hashes)
    return out


def _memory(args: argparse.Namespace, blocks_per_worker: int) -> dict[str, Any]:
    chains_per_worker = max(1, blocks_per_worker // 256)
    per_chain = blocks_per_worker // chains_per_worker
    gc.collect()
    tracemalloc.start()
    index = KvIndex(max_blocks=1 << 40, max_blocks_per_worker=1 << 40)
    before = tracemalloc.get_traced_memory()[0]
    next_hash = HASH_BASE
    for w in range(args.workers):
        chains: list[tuple[int, list[EngineHash]]] = []
        for c in range(chains_per_worker):
            start = w * chains_per_worker + c
            chains.append((start, list(range(next_hash, next_hash + per_chain))))
            next_hash += per_chain
        held = _fill(index, f"w{w}", chains, 16)
        # a running index: a quarter of the chains removed, as many new ones stored
        quarter = len(held) // 4
        for hashes in held[:quarter]:
            index.apply(f"w{w}", 0, [BlockRemoved(block_hashes=hashes)])
        fresh: list[tuple[int, list[EngineHash]]] = []
        for c in range(quarter):
            start = 10**6 + w * chains_per_worker + c
            fresh.append((start, list(range(next_hash, next_hash + per_chain))))
            next_hash += per_chain
        _fill(index, f"w{w}", fresh, 16)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {"workers": args.workers, "entries": index.entries, "bytes": used,
            "bytes_per_entry": used / max(1, index.entries), "index": index}


def _query(index: KvIndex, args: argparse.Namespace) -> dict[str, Any]:
    start = 10**6  # the first chain stored again after the removals: worker 0 holds it
    tokens = [(start * 7919 + i * 31) % 150_000 for i in range(args.prompt_tokens)]
    tokens[0] = start % 150_000
    rounds = 200
    t0 = time.thread_time()
    for _ in range(rounds):
        found = index.longest_prefix(tokens)
    per_query = (time.thread_time() - t0) / rounds
    return {"prompt_tokens": args.prompt_tokens, "us_per_query": per_query * 1e6,
            "matched_workers": len(found), "matched_tokens": max(found.values(), default=0)}


def run(args: argparse.Namespace) -> int:
    speed = _throughput(args)
    lag = _lag(args)
    memory = unique = _memory(args, args.blocks_per_worker)
    query = _query(memory.pop("index"), args)
    others = [_memory(args, n) for n in (args.blocks_per_worker // 4, args.blocks_per_worker * 2)]
    for row in others:
        row.pop("index")
    result: dict[str, Any] = {
        "throughput": speed, "lag": lag, "memory": memory, "memory_other_sizes": others, "query": query,
        "targets": {
            "bytes_per_entry": {"target": TARGET_BYTES, "value": round(unique["bytes_per_entry"], 1),
                                "met": unique["bytes_per_entry"] <= TARGET_BYTES},
            "blocks_per_s": {"target": TARGET_BLOCKS_PER_S, "value": round(speed["blocks_per_s"]),
                             "met": speed["blocks_per_s"] >= TARGET_BLOCKS_PER_S},
            "lag_p99_s": {"target": TARGET_LAG_P99_S, "value": lag["p99_s"], "met": lag["p99_s"] <= TARGET_LAG_P99_S},
        },
    }
    t = result["targets"]
    targets = [bench_targets.Target("kv-index", f"blocks/s decoded and applied on one core "
                                    f"({t['blocks_per_s']['value']:,}) >= {TARGET_BLOCKS_PER_S:,}",
                                    t["blocks_per_s"]["met"]),
               bench_targets.Target("kv-index", f"bytes per (block, instance) entry "
                                    f"({t['bytes_per_entry']['value']}) <= {TARGET_BYTES}",
                                    t["bytes_per_entry"]["met"]),
               bench_targets.Target("kv-index", f"event lag p99 (<= {lag['p99_s'] * 1000:g} ms, the bucket's bound) "
                                    f"<= {TARGET_LAG_P99_S * 1000:g} ms", t["lag_p99_s"]["met"])]
    if args.json:
        print(json.dumps(result, indent=2))
        return bench_targets.report(targets, explore=args.explore, json_output=True)
    shape = "maps" if args.map else "positional arrays"
    print(f"decode + apply, one core ({shape}, {args.events} runs x {args.run} blocks a batch, "
          f"{speed['bytes_per_message'] / 1024:.1f} KiB a message, {speed['entries']} entries kept): "
          f"{speed['blocks_per_s']:,.0f} blocks/s of CPU time, fastest of {speed['rounds']} rounds (median "
          f"{speed['median_blocks_per_s']:,.0f}; {speed['wall_blocks_per_s']:,.0f} by the wall clock); "
          f"target >= {TARGET_BLOCKS_PER_S:,}: {'met' if t['blocks_per_s']['met'] else 'MISSED'}")
    print(f"event lag, {lag['batches']} batches at {lag['rate']:g}/s over ZeroMQ to the subscriber thread: p50 <= "
          f"{lag['p50_s'] * 1000:g} ms, p99 <= {lag['p99_s'] * 1000:g} ms (histogram bucket bounds), mean "
          f"{lag['mean_s'] * 1000:.2f} ms; target p99 <= {TARGET_LAG_P99_S * 1000:g} ms: "
          f"{'met' if t['lag_p99_s']['met'] else 'MISSED'}")
    print(f"memory, no sharing ({unique['workers']} workers x {unique['entries'] // unique['workers']:,} entries): "
          f"{unique['bytes_per_entry']:.1f} B per (block, instance) entry; target <= {TARGET_BYTES}: "
          f"{'met' if t['bytes_per_entry']['met'] else 'MISSED'}")
    print("  other sizes: " + "; ".join(f"{r['entries'] // r['workers']:,} entries a worker: "
                                        f"{r['bytes_per_entry']:.1f} B" for r in others)
          + " (smaller workers cost more an entry: a set's table grows 4x below 50,000 entries)")
    print(f"query: longest_prefix of a {query['prompt_tokens']}-token prompt held by {query['matched_workers']} "
          f"workers: {query['us_per_query']:.0f} us")
    return bench_targets.report(targets, explore=args.explore, lines=False)
