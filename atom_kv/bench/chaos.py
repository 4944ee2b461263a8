"""``python -m atom_kv.bench chaos``: a seeded soak across simulated hosts, with faults that overlap while
traffic runs, and the invariants no fault may break.

Set-up (:mod:`atom_kv.bench.chaos_fleet`): two proxies, two prefill and two decode reference engines, each on
a host of its own (network namespaces on a private bridge; needs root), with discovery, a token and the
``auto`` backend. A client host sends constant mixed traffic (greedy; streaming or not; chat and
completions) to both proxies (:mod:`atom_kv.bench.chaos_client`). After ``--warmup`` seconds of traffic,
faults are drawn from ``--seed``, one every ``--fault-interval`` seconds, and overlap
(:mod:`atom_kv.bench.chaos_faults`); the last ``--settle`` seconds run without new faults. With
``--read-fail F`` the decode engines fail a fraction F of their KV reads at the backend all along (the
test-only fault injector, :mod:`atom_kv.transfer.fault_injector`): reads must recover with
``transfer_retries``.

Invariants, checked here, each a target: no wrong answer (every text equals a colocated engine's, or is a
prefix of it for a stream cut short); no request late or hung (each ends within ``--deadline``); nothing
unclean (an error is a JSON 502, 503 or 504, or a clean error event, or a connection refused or broken by
the kill of the very proxy it was sent to); every engine's KV blocks free again after the run; RSS flat
after the warm-up; no traceback in any log; every fault undone. The report counts requests per fault kind
and the recovery after each fault (:mod:`atom_kv.bench.chaos_report`); ``--json PATH`` writes it all.
docs/performance.md ("Chaos soak") says how to read it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

from atom_kv.bench import targets as bench_targets
from atom_kv.bench.chaos_client import MAX_TOKENS, PROMPTS, Shape, Traffic, request_body
from atom_kv.bench.chaos_faults import KINDS, RESTART_TIMEOUT_S, FaultPlan
from atom_kv.bench.chaos_fleet import ENGINES, PROXIES, ChaosFleet, Settings
from atom_kv.bench.chaos_report import count_requests, recoveries, recovery_summary, rss_report, tracebacks
from atom_kv.launch.cluster import Cluster, EngineSpec
from atom_kv.launch.web import http_json
from atom_kv.testing.netns import unavailable_reason

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=900.0, help="seconds of traffic (default %(default)s)")
    parser.add_argument("--seed", type=int, default=1, help="draws the faults and the traffic (default 1)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the whole report to PATH as JSON")
    parser.add_argument("--concurrency", type=int, default=4, choices=range(1, 7), metavar="1..6",
                        help="client threads, each one request at a time (default %(default)s)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds of traffic before the first fault, and before RSS is measured "
                             "(default: a sixth of --duration, from 10 to 60)")
    parser.add_argument("--settle", type=float, default=8.0,
                        help="last seconds of traffic without new faults (default %(default)s)")
    parser.add_argument("--fault-interval", default="2,5", metavar="MIN,MAX",
                        help="seconds between two faults, drawn uniformly (default %(default)s)")
    parser.add_argument("--faults", default=",".join(KINDS), metavar="KIND,...",
                        help=f"the fault kinds drawn (default all: {','.join(KINDS)})")
    parser.add_argument("--read-fail", type=float, default=0.05,
                        help="fraction of the decode engines' KV reads failed by the test-only fault injector "
                             "(default %(default)s; 0: off)")
    parser.add_argument("--deadline", type=float, default=60.0,
                        help="seconds a request may take before it counts as hung (default %(default)s)")
    parser.add_argument("--rss-slack", type=float, default=24.0,
                        help="MiB a process's RSS may grow after warm-up, besides 10%% (default %(default)s)")
    parser.add_argument("--log-dir", default=None, help="keep every process's log here (default: a temporary "
                                                        "directory, removed unless an invariant broke)")
    bench_targets.add_arguments(parser)


def _parse(args: argparse.Namespace) -> tuple[tuple[float, float], tuple[str, ...], float]:
    try:
        lo, hi = (float(x) for x in args.fault_interval.split(","))
    except ValueError:
        raise SystemExit(f"error: --fault-interval {args.fault_interval!r}: expected MIN,MAX in seconds") from None
    if not 0 < lo <= hi:
        raise SystemExit(f"error: --fault-interval {args.fault_interval!r}: expected 0 < MIN <= MAX")
    kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise SystemExit(f"error: --faults: unknown kind {bad[0]!r}; allowed: {', '.join(KINDS)}")
    if not 0.0 <= args.read_fail < 1.0:
        raise SystemExit(f"error: --read-fail {args.read_fail}: a fraction of reads, from 0 to below 1")
    warmup = args.warmup if args.warmup is not None else min(60.0, max(10.0, args.duration / 6))
    if args.duration <= warmup + args.settle:
        raise SystemExit(f"error: --duration {args.duration:g} leaves no time for faults after --warmup "
                         f"{warmup:g} and --settle {args.settle:g}")
    return (lo, hi), kinds, warmup


def _expected_texts(log_dir: str) -> dict[tuple[int, bool, int], str]:
    """Every prompt, chat or not, at every length, answered by a colocated engine (greedy)."""
    cluster = Cluster([EngineSpec("colocated", num_blocks=256)], with_proxy=False, log_dir=log_dir)
    cluster.start()
    try:
        out = {}
        for p in range(len(PROMPTS)):
            for chat in (False, True):
                for n in MAX_TOKENS:
                    path, body = request_body(Shape(p, chat, False, n))
                    status, answer = http_json("POST", cluster.engine_url(0) + path, body, timeout=60.0)
                    if status != 200:
                        raise RuntimeError(f"the colocated engine answered {status}: {answer}")
                    choice = answer["choices"][0]
                    out[(p, chat, n)] = choice["message"]["content"] if chat else choice["text"]
        return out
    finally:
        cluster.close()


class _Sampler:
    """Owns the thread that samples every process's RSS every two seconds."""

    def __init__(self, fleet: ChaosFleet) -> None:
        self._fleet = fleet
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-rss", daemon=True)

    def __enter__(self) -> "_Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(2.0):
            self._fleet.sample_rss()


def _wait_blocks_free(fleet: ChaosFleet, timeout: float) -> dict[str, dict]:
    """Until every engine's KV blocks are all free (or ``timeout``): the last ``kv_blocks`` of each."""
    deadline = time.monotonic() + timeout
    waiter = threading.Event()
    while True:
        blocks = fleet.blocks()
        if all(b and b.get("free") == b.get("total") for b in blocks.values()) or time.monotonic() > deadline:
            return blocks
        waiter.wait(1.0)


_ATTEMPT = re.compile(r"request (\S+): attempt \d+ of \d+: read of \d+ bytes in \d+ ranges from peer")
_LOAD_FAILED = re.compile(r"request (\S+): remote KV load failed")


def _read_faults(logs: dict[str, str], fraction: float) -> dict[str, Any]:
    """What the decode engines' logs say of their failed read attempts (injected or not) and what became of
    them: loads that recovered on a retry, loads that failed, peers dropped and handshakes."""
    retried: set[tuple[str, str]] = set()
    failed: set[tuple[str, str]] = set()
    out = {"read_fail": fraction, "injected": 0, "attempts_failed": 0, "peers_dropped": 0, "handshakes": 0}
    for name, text in logs.items():
        if not name.startswith("decode"):
            continue
        out["peers_dropped"] += text.count("declared failed after")
        out["handshakes"] += len(re.findall(r"handshake with engine \S+ rank \d+ at \S+ took", text))
        for line in text.splitlines():
            if m := _ATTEMPT.search(line):
                out["attempts_failed"] += 1
                out["injected"] += "fault injector: read of" in line  # its words in the attempt's error
                retried.add((name, m.group(1)))
            elif m := _LOAD_FAILED.search(line):
                failed.add((name, m.group(1)))
    out["loads_retried"] = len(retried)  # loads with a failed read attempt
    out["loads_recovered"] = len(retried - failed)  # ... that read on a later attempt
    out["loads_failed"] = len(failed)  # every failed load, whatever the cause (a handshake, a confirmation)
    return out


def run(args: argparse.Namespace) -> int:
    reason = unavailable_reason()
    for tool in ("tc", "iptables"):
        if reason is None and shutil.which(tool) is None:
            reason = f"needs `{tool}` on PATH (iproute2, iptables)"
    if reason is not None:
        print(f"chaos: cannot run here: {reason}", file=sys.stderr)
        return 1
    interval, kinds, warmup = _parse(args)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="atom-kv-chaos-")
    os.makedirs(log_dir, exist_ok=True)
    settings = Settings(read_fail=args.read_fail, seed=args.seed)
    fleet = ChaosFleet(log_dir, settings)
    expected: dict = {}
    report: dict[str, Any] = {}
    try:
        t0 = time.monotonic()
        colocated = threading.Thread(target=lambda: expected.update(_expected_texts(log_dir)),
                                     name="chaos-colocated", daemon=True)
        colocated.start()  # while the fleet starts
        fleet.start(timeout=180.0)
        colocated.join(180.0)
        if len(expected) != len(PROMPTS) * 2 * len(MAX_TOKENS):
            raise RuntimeError("the colocated engine did not answer every prompt (its log is in "
                               f"{log_dir})")
        startup_s = time.monotonic() - t0
        proxy_urls = {p: fleet.url(p) for p in PROXIES}
        traffic = Traffic(lambda fn, *a: fleet.hosts.submit("client", fn, *a), list(proxy_urls.values()),
                          expected, concurrency=args.concurrency, seed=args.seed, deadline_s=args.deadline)
        plan = FaultPlan(fleet, seed=args.seed, interval=interval, kinds=kinds)
        stop = threading.Event()
        with _Sampler(fleet):
            start = time.monotonic()
            traffic.start()
            stop.wait(warmup)
            plan.start(until=start + args.duration - args.settle)
            stop.wait(max(0.0, start + args.duration - time.monotonic()))
            unfinished = traffic.stop(timeout=args.deadline + 5.0)
            end = time.monotonic()
            undone = plan.join(timeout=RESTART_TIMEOUT_S + 10.0)
            back = fleet.wait_ready(list(ENGINES) + list(PROXIES), 60.0) is not None
            phases = {"start_up": startup_s, "traffic": end - start, "faults_undone": time.monotonic() - end}
            t1 = time.monotonic()
            blocks = _wait_blocks_free(fleet, settings.abort_timeout_s + 15.0)
            phases["blocks_free"] = time.monotonic() - t1
        t1 = time.monotonic()
        fleet.close()  # SIGTERM to every process: their logs are complete
        phases["shutdown"] = time.monotonic() - t1
        logs = fleet.logs()
        report = _report(args, warmup, startup_s, end - start, traffic, plan, proxy_urls, end, unfinished, undone,
                         back, blocks, fleet, logs)
        report["phases_s"] = {k: round(v, 1) for k, v in phases.items()}
    finally:
        fleet.close()
    keep = args.log_dir is not None or not report["all_invariants_held"]
    report["log_dir"] = log_dir if keep else None
    status = _print(report, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if not keep:
        shutil.rmtree(log_dir, ignore_errors=True)
    return status


def _report(args: argparse.Namespace, warmup: float, startup_s: float, ran_s: float, traffic: Traffic,
            plan: FaultPlan, proxy_urls: dict[str, str], end: float, unfinished: list, undone: bool, back: bool,
            blocks: dict[str, dict], fleet: ChaosFleet, logs: dict[str, str]) -> dict[str, Any]:
    by_kind = count_requests(traffic.requests, plan.faults, proxy_urls, end)
    rows = recoveries(traffic.requests, plan.faults, proxy_urls)
    leaked = sum(max(0, int(b.get("total", 0)) - int(b.get("free", 0))) for b in blocks.values() if b)
    rss = rss_report(fleet.history, warmup, min_span_s=min(30.0, ran_s / 3), slack_mib=args.rss_slack,
                     slack_ratio=0.10)
    traced = tracebacks(logs)
    total = by_kind.get("all", {})
    invariants = {
        "no_wrong_answer": total.get("wrong", 0) == 0,
        "none_late_or_hung": total.get("late", 0) == 0 and not unfinished,
        "every_error_clean": total.get("unclean", 0) == 0,
        "no_leaked_block": leaked == 0 and all(blocks.values()),
        "rss_flat": bool(rss) and all(r["flat"] for r in rss.values()),
        "no_traceback": not traced,
        "every_fault_undone": undone and back and not any(r["failed"] for r in rows),
    }
    examples = [{"proxy": r.proxy, "shape": vars(r.shape), "status": r.status,
                 "outcome": r.outcome.value if r.outcome else None, "seconds": round(r.seconds, 2),
                 "detail": r.detail}
                for r in traffic.requests if r.outcome is not None and r.outcome.value in ("wrong", "unclean")
                or r.late][:20]
    return {
        "command": "python -m atom_kv.bench chaos " + " ".join(sys.argv[sys.argv.index("chaos") + 1:]
                                                              if "chaos" in sys.argv else []),
        "seed": args.seed, "duration_s": round(ran_s, 1), "warmup_s": warmup, "startup_s": round(startup_s, 1),
        "concurrency": args.concurrency, "deadline_s": args.deadline,
        "requests": by_kind, "faults": rows, "recovery": recovery_summary(rows),
        "transient_reads": _read_faults(logs, args.read_fail),
        "blocks": blocks, "leaked_blocks": leaked, "unfinished_requests": len(unfinished),
        "rss": rss, "tracebacks": traced, "examples": examples,
        "invariants": invariants, "all_invariants_held": all(invariants.values()),
    }


def _print(report: dict[str, Any], args: argparse.Namespace) -> int:
    out = sys.stdout
    print(f"chaos soak: seed {report['seed']}, {report['duration_s']} s of traffic after a "
          f"{report['startup_s']} s start-up, {len(report['faults'])} faults; seconds by phase: "
          + ", ".join(f"{k} {v}" for k, v in report.get("phases_s", {}).items()), file=out)
    header = ("fault kind", "requests", "ok", "cut", "clean_errors", "refused", "dropped", "wrong", "unclean",
              "late")
    print("  ".join(f"{h:>12}" for h in header), file=out)
    table = report["requests"]
    for kind in [k for k in (*KINDS, "none", "all") if k in table]:
        row = table[kind]
        print("  ".join([f"{kind:>12}", *(f"{row[h]:>12}" for h in header[1:])]), file=out)
    print("recovery after each fault (s, from cleared to the next success):", file=out)
    for kind, summary in report["recovery"].items():
        print(f"  {kind}: {summary['faults']} faults, p50 {summary['recovery_p50_s']}, max "
              f"{summary['recovery_max_s']}, {summary['not_recovered']} without a success after", file=out)
    t = report["transient_reads"]
    print(f"transient reads (read_fail {t['read_fail']}): {t['injected']} injected, {t['attempts_failed']} "
          f"failed attempts; {t['loads_recovered']} of the {t['loads_retried']} loads with one recovered on a "
          f"retry; {t['loads_failed']} loads failed in all (any cause); {t['peers_dropped']} peers dropped, "
          f"{t['handshakes']} handshakes", file=out)
    for name, r in report["rss"].items():
        print(f"  rss {name}: {r['warm_mib']} -> {r['end_mib']} MiB", file=out)
    for name, text in report["tracebacks"].items():
        print(f"traceback in {name}:\n{text}", file=out)
    for example in report["examples"]:
        print(f"  {example}", file=out)
    total = table.get("all", {})
    inv = report["invariants"]
    targets = [
        bench_targets.Target("chaos wrong answers", f"{total.get('wrong', 0)} (target 0)", inv["no_wrong_answer"]),
        bench_targets.Target("chaos late or hung requests",
                             f"{total.get('late', 0)} late, {report['unfinished_requests']} unfinished (target 0)",
                             inv["none_late_or_hung"]),
        bench_targets.Target("chaos unclean errors", f"{total.get('unclean', 0)} (target 0)", inv["every_error_clean"]),
        bench_targets.Target("chaos leaked blocks", f"{report['leaked_blocks']} (target 0)", inv["no_leaked_block"]),
        bench_targets.Target("chaos RSS after warm-up", f"{len(report['rss'])} processes, flat within "
                             f"10% + {args.rss_slack:g} MiB", inv["rss_flat"]),
        bench_targets.Target("chaos tracebacks", f"{len(report['tracebacks'])} logs (target 0)", inv["no_traceback"]),
        bench_targets.Target("chaos faults undone", f"{len(report['faults'])} faults", inv["every_fault_undone"]),
    ]
    if report.get("log_dir"):
        print(f"logs: {report['log_dir']}", file=out)
    return bench_targets.report(targets, explore=args.explore)
