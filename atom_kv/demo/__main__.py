"""``python -m atom_kv.demo``: prefill/decode disaggregation end to end on 127.0.0.1.

Starts a proxy, one prefill and one decode reference engine (plus a colocated
engine for comparison), streams a handful of greedy requests through the
proxy with the ``openai`` client, runs the same prompts colocated, and prints
whether every token matches, the time to first token and how much KV moved.
Exits non-zero on any mismatch. Every process is stopped on success, failure
or Ctrl-C. The processes' logs (a folder ``atom-kv-cluster-*`` in the temporary
directory) are removed after a run that succeeded, unless ``--keep-logs``; any
other run keeps them and prints where.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from typing import Optional

from atom_kv._cli import OneLineParser
from atom_kv.extras import MissingExtraError, require
from atom_kv.launch.cluster import Cluster, EngineSpec
from atom_kv.launch.web import scrape_metrics

PROMPTS = [
    "Hello! Tell me about disaggregated inference.",
    "The prefill engine computes the KV cache of the prompt; the decode engine pulls it block by block "
    "over the network and generates the answer one token at a time. " * 2,
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n" * 4,
    "Once upon a time, in a data center far away, two GPUs shared a secret: the keys and values. " * 8,
    "Q: What moves between the engines?\nA: Only the KV blocks of the prompt, nothing else. " * 16,
]


@dataclass
class Row:
    prompt: str
    prompt_bytes: int
    pd_text: str
    colocated_text: str
    ttft_s: float
    colocated_ttft_s: float
    kv_bytes: float
    kv_seconds: float

    @property
    def identical(self) -> bool:
        return self.pd_text == self.colocated_text


def _transfer_totals(url: str) -> tuple[float, float]:
    """Decode engine's transfer bytes summed over ranks and the slowest rank's transfer seconds."""
    m = scrape_metrics(url + "/metrics")
    bytes_total = sum(v for k, v in m.items() if k.startswith("atom_kv_transfer_bytes{"))
    seconds = max([v for k, v in m.items() if k.startswith("atom_kv_transfer_seconds{")] or [0.0])
    return bytes_total, seconds


def _stream(client, model: str, prompt: str, max_tokens: int) -> tuple[str, float]:
    start = time.perf_counter()
    ttft: Optional[float] = None
    pieces = []
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True)
    for chunk in stream:
        for choice in chunk.choices:
            if choice.text:
                if ttft is None:
                    ttft = time.perf_counter() - start
                pieces.append(choice.text)
    return "".join(pieces), ttft if ttft is not None else float("nan")


def run(args: argparse.Namespace) -> int:
    from openai import OpenAI

    print(f"starting proxy, prefill (DP={args.dp} TP={args.tp_prefill}), decode (DP={args.dp} TP={args.tp_decode}) "
          f"and a colocated engine on 127.0.0.1 (backend {args.backend}, device {args.device}) ...", flush=True)
    device = ["--device", args.device]
    cluster = Cluster([
        EngineSpec("P", tp=args.tp_prefill, dp=args.dp, backend=args.backend, num_blocks=512, extra_args=device),
        EngineSpec("D", tp=args.tp_decode, dp=args.dp, backend=args.backend, num_blocks=512, extra_args=device),
        EngineSpec("colocated", num_blocks=512, extra_args=device),
    ], heartbeat_timeout=5.0)
    status = 1  # until the run has shown otherwise
    try:
        t0 = time.monotonic()
        cluster.start(timeout=args.startup_timeout)
        kept = "kept" if args.keep_logs else "removed at the end if all goes well; --keep-logs keeps them"
        print(f"all processes up and registered in {time.monotonic() - t0:.1f} s (logs: {cluster.log_dir} {kept})\n",
              flush=True)
        d_url = cluster.engine_url(cluster.index_of("D"))
        via_proxy = OpenAI(base_url=cluster.proxy_url + "/v1", api_key="none", max_retries=0, timeout=120)
        colocated = OpenAI(base_url=cluster.engine_url(cluster.index_of("colocated")) + "/v1", api_key="none",
                           max_retries=0, timeout=120)
        rows = []
        for prompt in PROMPTS[: args.num_prompts]:
            b0, s0 = _transfer_totals(d_url)
            pd_text, ttft = _stream(via_proxy, args.model, prompt, args.max_tokens)
            b1, s1 = _transfer_totals(d_url)
            co_text, co_ttft = _stream(colocated, args.model, prompt, args.max_tokens)
            rows.append(Row(prompt, len(prompt.encode()), pd_text, co_text, ttft, co_ttft, b1 - b0, s1 - s0))
        _print_table(rows)
        bad = [r for r in rows if not r.identical]
        if bad:
            for r in bad:
                print(f"\nMISMATCH for prompt {r.prompt[:40]!r}:\n  P/D:       {r.pd_text!r}\n"
                      f"  colocated: {r.colocated_text!r}")
            return 1
        print(f"\nall {len(rows)} outputs identical to the colocated engine, token for token")
        status = 0
        return 0
    finally:
        cluster.close()
        _dispose_of_logs(cluster.log_dir, keep=args.keep_logs or status != 0)


def _dispose_of_logs(log_dir: str, keep: bool) -> None:
    """Remove the run's log folder, or say where it stays (a run that failed or was interrupted)."""
    if keep:
        print(f"logs kept in {log_dir} (remove the folder when done)", flush=True)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)


def _print_table(rows: list[Row]) -> None:
    header = (f"{'prompt':<34} {'bytes':>6} {'identical':>9} {'TTFT P/D':>9} {'TTFT colo':>9} "
              f"{'KV moved':>10} {'GB/s':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        short = r.prompt.replace("\n", " ")[:32]
        rate = r.kv_bytes / r.kv_seconds / 1e9 if r.kv_seconds > 0 else 0.0
        print(f"{short:<34} {r.prompt_bytes:>6} {'yes' if r.identical else 'NO':>9} {r.ttft_s * 1e3:>7.0f}ms "
              f"{r.colocated_ttft_s * 1e3:>7.0f}ms {r.kv_bytes / 2**20:>7.2f}MiB {rate:>6.2f}")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Optional[list[str]] = None) -> int:
    p = OneLineParser(prog="python -m atom_kv.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="auto", choices=["auto", "tcp", "cma", "gpu_ipc", "nixl"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where every engine keeps its model and KV cache (cuda also means ROCm)")
    p.add_argument("--tp-prefill", type=int, default=1, choices=[1, 2])
    p.add_argument("--tp-decode", type=int, default=1, choices=[1, 2])
    p.add_argument("--dp", type=int, default=1, choices=[1, 2, 3, 4],
                   help="data-parallel ranks of the prefill and of the decode engine (requests spread over them)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1))
    p.add_argument("--model", default="atom-kv-tiny")
    p.add_argument("--startup-timeout", type=float, default=60.0)
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the processes' logs after a run that succeeded too (the folder is printed)")
    args = p.parse_args(argv)
    try:
        require("torch", extra="reference", feature="the demo (it runs the reference engine)")
    except MissingExtraError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.device == "cuda":
        from atom_kv.transfer.memory import gpu_unavailable_reason

        if (why := gpu_unavailable_reason()) is not None:
            print(f"error: --device cuda: {why}; use --device cpu", file=sys.stderr)
            return 2
    elif args.backend == "gpu_ipc":
        print("error: --backend gpu_ipc moves GPU memory only; add --device cuda, or use --backend auto",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    # Ctrl-C and SIGTERM both unwind through `finally`, which stops every process we started
    # (SIGINT may arrive ignored when launched from a non-interactive shell).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\ninterrupted; every process stopped", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # e.g. an openai client error mid-run: one line, processes already stopped
        print(f"error: {type(exc).__name__}: {exc} (engine logs are in the directory printed above)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
