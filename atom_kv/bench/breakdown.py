"""``python -m atom_kv.bench e2e --breakdown``: where the time to first token goes, P/D next to colocated.

For a short (~64 tokens) and a long (~2,000 tokens) prompt, at concurrency 1
and 16, it sends rounds of streamed greedy requests through the proxy (P/D)
and straight to the colocated engine, alternating P/D and colocated rounds so
both see the same load on a busy machine. Per request it takes the client's
TTFT and time to the second token; the spans come from the proxy's
``atom_kv_proxy_span_seconds`` histogram (deltas of sum/count over each P/D
batch), the decode engine's transfer statistics (handshake, KV read) and, for
colocated, the engine's own ``Server-Timing`` header (queue, compute).
It holds nothing to a target (it explains; the e2e bench without
``--breakdown`` has the target) and says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from typing import Any

from atom_kv.bench.client import in_threads, stream_completion
from atom_kv.bench.targets import report
from atom_kv.proxy.observability.spans import SPANS
from atom_kv.testing.web import scrape_metrics

__all__ = ["MODES", "p50", "run_breakdown", "span_totals"]

#: why --breakdown prints no target
NO_TARGETS = "--breakdown shows where the time goes; without it, e2e holds P/D to colocated text"

_WORDS = "prefill computes the prompt once and decode reads it block by block "


@dataclass
class Sample:
    """One streamed request as the client saw it."""

    ttft: float
    second: float  # time to the second token (0: the answer had one token)
    engine_spans: dict[str, float] = field(default_factory=dict)


def _prompt(tokens: int, salt: str) -> str:
    text = f"[{salt}] " + _WORDS * (tokens // len(_WORDS) + 1)
    return text[:tokens]  # the reference engine's tokenizer is one token per byte


def stream_once(base_url: str, prompt: str, max_tokens: int, timeout: float = 300.0) -> Sample:
    """One streamed greedy completion; TTFT and time to the second token from the client."""
    got = stream_completion(base_url, {"model": "atom-kv-tiny", "prompt": prompt, "max_tokens": max_tokens,
                                       "temperature": 0}, timeout)
    if not got.texts:
        raise RuntimeError("no tokens streamed")
    second = 0.0
    n = 0
    for when, chars in got.texts:  # the reference engine's tokenizer is one token per byte
        if n < 2 <= n + chars:
            second = when
        n += chars
    return Sample(got.texts[0][0], second, got.server_timing)


def _batch(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> list[Sample]:
    return in_threads(lambda p: stream_once(url, p, max_tokens), prompts, concurrency, "bench-client")


def span_totals(proxy_url: str) -> dict[str, tuple[float, float]]:
    """Each span's (sum of seconds, count) in the proxy's ``atom_kv_proxy_span_seconds`` histogram now."""
    m = scrape_metrics(proxy_url + "/metrics")
    return {s: (m.get(f'atom_kv_proxy_span_seconds_sum{{span="{s}"}}', 0.0),
                m.get(f'atom_kv_proxy_span_seconds_count{{span="{s}"}}', 0.0)) for s in SPANS}


def _transfer_totals(decode_url: str) -> dict[str, float]:
    m = scrape_metrics(decode_url + "/metrics")
    keys = ("handshakes", "handshake_seconds", "transfers", "seconds")
    # per rank: the slowest rank's seconds bound the wait; counts are per rank alike
    return {k: max([v for name, v in m.items() if name.startswith(f"atom_kv_transfer_{k}{{")] or [0.0])
            for k in keys}


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


#: the P/D modes ``--modes`` compares, each through its own proxy on the same engines: its flags
MODES = {
    "sequential": ["--no-first-token-forwarding", "--no-concurrent-dispatch"],
    "first_token": ["--no-concurrent-dispatch"],
    "concurrent": ["--concurrent-dispatch"],
}


@dataclass
class _ModeRun:
    """One P/D mode's proxy and what its requests measured over the rounds."""

    name: str
    url: str
    samples: list[Sample] = field(default_factory=list)
    span_sum: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SPANS, 0.0))
    span_n: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SPANS, 0.0))
    xfer: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("handshakes", "handshake_seconds", "transfers", "seconds"), 0.0))

    def run(self, d_url: str, prompts: list[str], max_tokens: int, concurrency: int) -> None:
        before, t_before = span_totals(self.url), _transfer_totals(d_url)
        self.samples += _batch(self.url, prompts, max_tokens, concurrency)
        after, t_after = span_totals(self.url), _transfer_totals(d_url)
        for s in SPANS:
            self.span_sum[s] += after[s][0] - before[s][0]
            self.span_n[s] += after[s][1] - before[s][1]
        for k in self.xfer:
            self.xfer[k] += t_after[k] - t_before[k]

    def result(self, d_url: str) -> dict[str, Any]:
        spans = {s: self.span_sum[s] / self.span_n[s] * 1e3 for s in SPANS if self.span_n[s]}
        total = _transfer_totals(d_url)  # handshakes happen on first use only: the run's mean so far
        if total["handshakes"]:
            spans["handshake_first_use"] = total["handshake_seconds"] / total["handshakes"] * 1e3
        if self.xfer["transfers"]:
            spans["kv_read"] = self.xfer["seconds"] / self.xfer["transfers"] * 1e3
        pd = self.samples
        return {
            "pd_ttft_ms": statistics.mean(s.ttft for s in pd) * 1e3,
            "pd_ttft_p50_ms": p50([s.ttft for s in pd]) * 1e3,
            "pd_second_token_ms": statistics.mean(s.second for s in pd) * 1e3,
            "pd_spans_ms": spans,
        }


def _measure(cluster: Any, modes: list[tuple[str, str]], tokens: int, concurrency: int,
             args: argparse.Namespace) -> dict[str, Any]:
    d_url = cluster.engine_url(cluster.index_of("D"))
    co_url = cluster.engine_url(cluster.index_of("colocated"))
    runs = [_ModeRun(name, url) for name, url in modes]
    co: list[Sample] = []
    for rnd in range(args.rounds):
        prompts = [_prompt(tokens, f"{tokens}-{concurrency}-{rnd}-{i}") for i in range(concurrency)]
        for run in runs:
            run.run(d_url, prompts, args.max_tokens, concurrency)
        co += _batch(co_url, prompts, args.max_tokens, concurrency)
    co_spans = {k: statistics.mean(s.engine_spans.get(k, 0.0) for s in co) * 1e3 for k in ("queue", "compute")}
    co_spans["http"] = statistics.mean(s.ttft for s in co) * 1e3 - co_spans["queue"] - co_spans["compute"]
    return {
        "prompt_tokens": tokens, "concurrency": concurrency, "requests": len(co),
        "modes": {run.name: run.result(d_url) for run in runs},
        "colocated_ttft_ms": statistics.mean(s.ttft for s in co) * 1e3,
        "colocated_ttft_p50_ms": p50([s.ttft for s in co]) * 1e3,
        "colocated_second_token_ms": statistics.mean(s.second for s in co) * 1e3,
        "colocated_spans_ms": co_spans,
    }


def _print(results: list[dict[str, Any]]) -> None:
    for r in results:
        print(f"\n~{r['prompt_tokens']} prompt tokens, concurrency {r['concurrency']} ({r['requests']} requests each)")
        co_other = r["colocated_ttft_ms"] - r["colocated_spans_ms"]["compute"]
        print(f"  colocated        TTFT mean {r['colocated_ttft_ms']:8.1f} ms  p50 {r['colocated_ttft_p50_ms']:8.1f} ms"
              f"  2nd token {r['colocated_second_token_ms']:8.1f} ms")
        for name, m in r["modes"].items():
            ratio = m["pd_ttft_ms"] / r["colocated_ttft_ms"] if r["colocated_ttft_ms"] else 0.0
            ratio_p50 = m["pd_ttft_p50_ms"] / r["colocated_ttft_p50_ms"] if r["colocated_ttft_p50_ms"] else 0.0
            ratio2 = (m["pd_second_token_ms"] / r["colocated_second_token_ms"]
                      if r["colocated_second_token_ms"] else 0.0)
            # the model's compute is the same work on either side and swings with the machine's load:
            # what disaggregation adds or saves is the rest
            other = m["pd_ttft_ms"] - m["pd_spans_ms"].get("prefill_compute", 0.0)
            print(f"  P/D {name:12s} TTFT mean {m['pd_ttft_ms']:8.1f} ms  p50 {m['pd_ttft_p50_ms']:8.1f} ms"
                  f"  2nd token {m['pd_second_token_ms']:8.1f} ms   x{ratio:.2f} / p50 x{ratio_p50:.2f} / "
                  f"2nd x{ratio2:.2f}   TTFT - compute {other - co_other:+.1f} ms vs colocated")
            print("      spans (mean ms): " + ", ".join(f"{k} {v:.1f}" for k, v in m["pd_spans_ms"].items()))
        print("  colocated spans (mean ms): " + ", ".join(f"{k} {v:.1f}" for k, v in r["colocated_spans_ms"].items()))


def run_breakdown(args: argparse.Namespace) -> int:
    from atom_kv.testing.cluster import Cluster, EngineSpec

    sizes = [int(s) for s in args.breakdown_tokens.split(",") if s.strip()]
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    names = [m.strip() for m in (args.modes or "").split(",") if m.strip()]
    unknown = [m for m in names if m not in MODES]
    if unknown:
        print(f"--modes: unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}")
        return 2
    longest = max(sizes) + args.max_tokens + 64
    blocks = (longest // 16 + 2) * max(levels) * max(1, len(names)) + 64
    extra = ["--max-model-len", str(longest), "--max-num-batched-tokens", str(max(sizes) + 64)]
    base = list(args.proxy_arg or [])
    cluster = Cluster([
        EngineSpec("P", tp=args.tp_prefill, backend=args.backend, num_blocks=blocks, extra_args=extra),
        EngineSpec("D", tp=args.tp_decode, backend=args.backend, num_blocks=blocks, extra_args=extra),
        EngineSpec("colocated", num_blocks=blocks, extra_args=extra),
    ], heartbeat_timeout=10.0, proxy_args=base + (MODES[names[0]] if names else []),
        extra_proxies=[base + MODES[m] for m in names[1:]])
    try:
        cluster.start(timeout=120)
        modes = list(zip(names or ["proxy defaults"], [cluster.proxy_url, *cluster.extra_proxy_urls]))
        for url in (*[u for _, u in modes], cluster.engine_url(cluster.index_of("colocated"))):
            stream_once(url, "warm up", 4)
        results = [_measure(cluster, modes, n, c, args) for n in sizes for c in levels]
    finally:
        cluster.close()
    if args.json:
        print(json.dumps({"suite": "e2e-breakdown", "max_tokens": args.max_tokens, "rounds": args.rounds,
                          "results": results}, indent=2))
        return report([], explore=args.explore, json_output=True, none_reason=NO_TARGETS)
    print(f"e2e breakdown: backend={args.backend} P TP={args.tp_prefill} D TP={args.tp_decode}, "
          f"{args.max_tokens} tokens, {args.rounds} rounds, each P/D mode's and colocated rounds interleaved")
    _print(results)
    print("\nspans: see atom_kv.proxy.spans; handshake and kv_read from the decode engine's transfer stats "
          "(per read, per rank); colocated http = TTFT - queue - compute")
    return report([], explore=args.explore, none_reason=NO_TARGETS)
