"""``python -m atom_kv.bench e2e``: TTFT and tokens/s, P/D versus colocated, with the reference engine.

Starts a proxy, a prefill and a decode engine and a colocated engine on
127.0.0.1, then for prompts of 512, 2k and 8k bytes measures (streaming,
greedy, sequential requests) the time to first token, decode tokens/s, the KV
bytes the decode engine read and the share of the P/D TTFT spent moving KV
(from the decode engine's transfer stats).

Decode speed is also reported as CPU time per token of the engine generating
the tokens (the decode engine for P/D; its whole process group, TP ranks
included), counted from the first streamed token to the last. Tokens/s on a
busy machine measure the neighbours as much as the engine; CPU ms per token
does not, so P/D and colocated decode should agree there. (They did not
until the engine stopped allocating a context-sized gather buffer on every
decode step: a decode engine, which never runs a long prefill, page-faulted
through those buffers and decoded at 0.6x colocated speed on 8 KiB prompts.)

Every P/D answer is also compared with the colocated engine's answer to the
same prompt (greedy): at equal TP the target is the same text, token for
token (exit 1 otherwise, unless ``--explore``). ``--device cuda`` puts every engine's model and KV
cache on the GPU (CUDA or ROCm torch).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from typing import Any, Callable, Optional

from atom_kv.bench import targets as bench_targets
from atom_kv.bench.targets import Target
from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.procfs import process_stats
from atom_kv.testing.web import scrape_metrics

_TEXT = ("Prefill computes the prompt's keys and values once; decode reads them block by block and "
         "generates one token per step. ")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench_targets.add_arguments(parser)
    parser.add_argument("--sizes", default="512,2048,8192", help="prompt sizes in bytes (comma separated)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backend", default="auto", choices=["auto", "tcp", "cma"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the engines keep their model and KV cache (cuda: GPU, CUDA or ROCm torch)")
    parser.add_argument("--tp-prefill", type=int, default=1, choices=[1, 2])
    parser.add_argument("--tp-decode", type=int, default=1, choices=[1, 2])
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.add_argument("--kv-checksums", action="store_true",
                        help="compare per-block checksums of the KV the decode engine loaded with what the prefill "
                             "lent, per (block, layer, k/v, head), so across unequal TP too (target: equal)")
    parser.add_argument("--breakdown", action="store_true",
                        help="print where the time to first token goes, span by span (see atom_kv.bench.breakdown)")
    parser.add_argument("--breakdown-tokens", default="64,2000", help="--breakdown: prompt sizes in tokens")
    parser.add_argument("--concurrency", default="1,16", help="--breakdown: concurrency levels")
    parser.add_argument("--rounds", type=int, default=3, help="--breakdown: alternating P/D and colocated rounds")
    parser.add_argument("--modes", default="",
                        help="--breakdown: P/D modes to compare side by side, comma separated, each through its own "
                             "proxy on the same engines, rounds interleaved: sequential (legs in turn, the decode "
                             "computes the first token), first_token (legs in turn, the prefill's token streamed at "
                             "once), concurrent (both legs at once); default: one proxy with its default flags")
    parser.add_argument("--proxy-arg", action="append",
                        help="--breakdown: an extra proxy flag (repeatable), e.g. --proxy-arg=--concurrent-dispatch "
                             "(both legs at once) or --proxy-arg=--no-first-token-forwarding")


def _prompt(size: int, salt: int) -> str:
    text = f"[{salt}] " + _TEXT * (size // len(_TEXT) + 1)
    return text[:size]


def _group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (Linux /proc)."""
    return sum(s.cpu_s for s in process_stats() if s.pgrp == pgid)


def _stream(url: str, prompt: str, max_tokens: int, on_first_token: Optional[Callable[[], None]] = None,
            pieces: Optional[list[str]] = None) -> tuple[float, float, int]:
    """Returns (ttft_s, total_s, tokens); the streamed text goes to ``pieces`` when given."""
    body = json.dumps({"model": "atom-kv-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    ttft = None
    tokens = 0
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            text = "".join(c.get("text") or "" for c in event.get("choices", []))
            if pieces is not None:
                pieces.append(text)
            if text:
                if ttft is None:
                    ttft = time.perf_counter() - start
                    if on_first_token is not None:
                        on_first_token()
                tokens += len(text.encode())  # one byte per generated token
    total = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("no tokens streamed")
    return ttft, total, tokens


def _transfer(url: str) -> tuple[float, float]:
    m = scrape_metrics(url + "/metrics")
    b = sum(v for k, v in m.items() if k.startswith("atom_kv_transfer_bytes{"))
    s = max([v for k, v in m.items() if k.startswith("atom_kv_transfer_seconds{")] or [0.0])
    return b, s


def _decode_cpu(url: str, prompt: str, max_tokens: int, pgid: int,
                pieces: Optional[list[str]] = None) -> tuple[tuple[float, float, int], float]:
    """Stream one request; also return the CPU ms per token the engine group ``pgid`` spent
    between the first streamed token and the end."""
    first: list[float] = []
    sample = _stream(url, prompt, max_tokens, on_first_token=lambda: first.append(_group_cpu_s(pgid)),
                     pieces=pieces)
    cpu = _group_cpu_s(pgid) - first[0]
    return sample, cpu * 1e3 / (sample[2] - 1) if sample[2] > 1 else 0.0


def _measure(cluster: Cluster, size: int, args: argparse.Namespace) -> dict[str, Any]:
    d = cluster.index_of("D")
    co = cluster.index_of("colocated")
    d_url, co_url = cluster.engine_url(d), cluster.engine_url(co)
    pd: list[tuple[float, float, int, float, float]] = []
    co_samples: list[tuple[float, float, int]] = []
    pd_cpu: list[float] = []
    co_cpu: list[float] = []
    equal = True
    for rep in range(args.repeats):
        prompt = _prompt(size, rep)
        b0, s0 = _transfer(d_url)
        pd_text: list[str] = []
        co_text: list[str] = []
        (ttft, total, n), cpu = _decode_cpu(cluster.proxy_url, prompt, args.max_tokens, cluster.engines[d].pid,
                                            pd_text)
        b1, s1 = _transfer(d_url)
        pd.append((ttft, total, n, b1 - b0, s1 - s0))
        pd_cpu.append(cpu)
        sample, cpu = _decode_cpu(co_url, prompt, args.max_tokens, cluster.engines[co].pid, co_text)
        co_samples.append(sample)
        co_cpu.append(cpu)
        equal = equal and "".join(pd_text) == "".join(co_text)

    def tps(samples: list) -> float:
        rates = [(s[2] - 1) / (s[1] - s[0]) for s in samples if s[1] > s[0] and s[2] > 1]
        return statistics.mean(rates) if rates else 0.0

    pd_ttft = statistics.mean(s[0] for s in pd)
    kv_bytes = statistics.mean(s[3] for s in pd)
    kv_seconds = statistics.mean(s[4] for s in pd)
    return {
        "prompt_bytes": size,
        "pd_ttft_ms": pd_ttft * 1e3,
        "colocated_ttft_ms": statistics.mean(s[0] for s in co_samples) * 1e3,
        "pd_tokens_per_s": tps(pd),
        "colocated_tokens_per_s": tps(co_samples),
        "pd_decode_cpu_ms_per_token": statistics.mean(pd_cpu),
        "colocated_decode_cpu_ms_per_token": statistics.mean(co_cpu),
        "kv_mib": kv_bytes / 2**20,
        "kv_transfer_ms": kv_seconds * 1e3,
        "kv_gb_per_s": kv_bytes / kv_seconds / 1e9 if kv_seconds > 0 else 0.0,
        "kv_share_of_ttft": kv_seconds / pd_ttft if pd_ttft > 0 else 0.0,
        "pd_equals_colocated": equal,
    }


def run(args: argparse.Namespace) -> int:
    if args.breakdown:
        from atom_kv.bench.breakdown import run_breakdown

        return run_breakdown(args)
    if args.device != "cpu":
        from atom_kv.transfer.memory import gpu_unavailable_reason

        if (why := gpu_unavailable_reason()) is not None:
            print(f"e2e bench: --device {args.device}: {why}; use --device cpu", file=sys.stderr)
            return 2
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    blocks = (max(sizes) + args.max_tokens + 64) // 16 + 64
    extra = ["--max-model-len", str(max(sizes) + args.max_tokens + 64), "--max-num-batched-tokens",
             str(max(sizes) + 64), "--device", args.device]
    sums = tempfile.TemporaryDirectory(prefix="atom-kv-e2e-checksums-") if args.kv_checksums else None
    sums_of = {role: ["--kv-checksums", os.path.join(sums.name, role)] if sums else [] for role in ("P", "D")}
    cluster = Cluster([
        EngineSpec("P", tp=args.tp_prefill, backend=args.backend, num_blocks=blocks, extra_args=extra + sums_of["P"]),
        EngineSpec("D", tp=args.tp_decode, backend=args.backend, num_blocks=blocks, extra_args=extra + sums_of["D"]),
        EngineSpec("colocated", num_blocks=blocks, extra_args=extra),
    ], heartbeat_timeout=10.0)
    checksums = None
    try:
        cluster.start(timeout=120)
        _stream(cluster.proxy_url, "warm up", 4)
        _stream(cluster.engine_url(cluster.index_of("colocated")), "warm up", 4)
        results = [_measure(cluster, size, args) for size in sizes]
        if sums is not None:
            from atom_kv.reference.kv_checksums import compare, read_records

            checksums = compare(read_records(os.path.join(sums.name, "P")), read_records(os.path.join(sums.name, "D")))
    except BaseException:
        cluster.close()
        print(f"e2e bench: the processes' logs are kept in {cluster.log_dir}", file=sys.stderr)
        raise
    finally:
        cluster.close()
        if sums is not None:
            sums.cleanup()
    shutil.rmtree(cluster.log_dir, ignore_errors=True)  # a run that went through leaves no log folder behind
    equal_tp = args.tp_prefill == args.tp_decode
    equal = all(r["pd_equals_colocated"] for r in results)
    doc = {"suite": "e2e", "backend": args.backend, "device": args.device, "tp_prefill": args.tp_prefill,
           "tp_decode": args.tp_decode, "max_tokens": args.max_tokens, "repeats": args.repeats,
           "pd_equals_colocated": equal, "results": results}
    targets = [Target(f"TP {args.tp_prefill}/{args.tp_decode}", "P/D text == colocated text, greedy, token for token",
                      equal)] if equal_tp else []
    if checksums is not None:
        doc["kv_checksums"] = checksums
        targets.append(Target(f"TP {args.tp_prefill}/{args.tp_decode}",
                              f"the KV the decode engine loaded == what the prefill lent, per (block, layer, k/v, "
                              f"head): {checksums['compared']} compared over {checksums['transfers']} transfers, "
                              f"{checksums['differ']} differ, {checksums['missing']} not lent", checksums["equal"]))
    none_reason = (f"P/D text == colocated text: {equal}; a target only at equal TP, the reduction order differs "
                   f"at TP {args.tp_prefill}/{args.tp_decode}")
    if args.json:
        print(json.dumps(doc, indent=2))
        return bench_targets.report(targets, explore=args.explore, json_output=True, none_reason=none_reason)
    print(f"e2e: backend={args.backend} device={args.device} P TP={args.tp_prefill} D TP={args.tp_decode}, "
          f"{args.max_tokens} tokens, mean of {args.repeats} sequential streamed requests")
    head = (f"{'bytes':>6} {'TTFT P/D':>10} {'TTFT colo':>10} {'tok/s P/D':>10} {'tok/s colo':>10} "
            f"{'CPUms/tok P/D':>13} {'colo':>6} {'KV MiB':>7} {'KV ms':>7} {'GB/s':>6} {'KV/TTFT':>8}")
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['prompt_bytes']:>6} {r['pd_ttft_ms']:>8.0f}ms {r['colocated_ttft_ms']:>8.0f}ms "
              f"{r['pd_tokens_per_s']:>10.1f} {r['colocated_tokens_per_s']:>10.1f} "
              f"{r['pd_decode_cpu_ms_per_token']:>13.1f} {r['colocated_decode_cpu_ms_per_token']:>6.1f} "
              f"{r['kv_mib']:>7.2f} {r['kv_transfer_ms']:>7.1f} {r['kv_gb_per_s']:>6.2f} "
              f"{r['kv_share_of_ttft'] * 100:>7.1f}%")
    print("tok/s: decode tokens per wall second (sensitive to other load on the machine); CPUms/tok: CPU time "
          "the generating engine spent per decoded token (P/D: the decode engine)")
    return bench_targets.report(targets, explore=args.explore, none_reason=none_reason)
