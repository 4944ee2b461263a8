"""``python -m atom_kv.bench routing``: routing policies on a multi-turn workload, real reference engines.

C conversations of T turns over a few shared system prompts (``atom_kv.bench.routing_workload``), sent turn
by turn, each turn's requests shuffled and ``--concurrency`` at once, through a proxy in front of
``--prefill-engines`` + ``--decode-engines`` reference engines with KV events on. Each policy of
``--policies`` runs on new engines and a new proxy (``atom_kv.bench.routing_run``), so no run inherits
another's cache; each ``--cache-fraction`` sizes every engine's ``--num-blocks`` to that share of the
workload's working set (its distinct full blocks), at least the room the requests in flight take.

Per policy: the prefix-cache hit rate (1 - prompt tokens the engines computed / prompt tokens sent, from the
engines' counters; for the prefill pool alone too), the prefill tokens computed, the KV bytes the decode
engines' connectors moved (per turn), TTFT p50 and p99 (streamed), and the proxy's CPU per request; with the
oracle (every request meets its whole earlier prefix). ``NAME+local`` is policy NAME with
``--local-prefill-max-tokens`` (``--local-prefill-max-tokens`` here, else a turn's new tokens plus two
blocks). A policy the proxy refuses is reported with the proxy's error and its targets are not run.

Targets (issue 37), met or MISSED: hit rate with caches that hold the working set, kv_aware >= 0.9 x the
oracle; at half the working set, kv_aware >= 1.3 x cache_aware; KV bytes moved on turns >= 2, kv_aware <= 0.5
x round_robin; TTFT p50 on turns >= 2, kv_aware+local <= 0.7 x round_robin; proxy CPU per request, kv_aware
<= 1.3 x round_robin (the last three from the caches that hold the working set). The index's figures are
``bench kv-index``'s. The outside client's row (aiperf with a shared system prompt, kv_aware >= 1.2 x
cache_aware's output tok/s or TTFT p90 <= 0.5 x, same request rate and success rate) runs aiperf from
``--aiperf PATH`` or ``aiperf`` on PATH (``atom_kv.bench.routing_aiperf``), each policy on new engines; with
neither (or with ``--no-aiperf``) it is printed as not run, with the reason. ``--aiperf-only`` runs that row
alone.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
from typing import Any, Iterator, Optional

from atom_kv.bench import routing_aiperf, routing_chart
from atom_kv.bench import targets as bench_targets
from atom_kv.bench.routing_run import PolicySpec, RunShape, parse_policies, policy_cluster, proxy_refusal, run_policy
from atom_kv.bench.routing_run import warm_up
from atom_kv.bench.routing_workload import Plan, working_set_blocks

DEFAULT_POLICIES = "round_robin,cache_aware,kv_aware,kv_aware+local"
FULL, HALF = 1.0, 0.5
#: the workload's defaults, and --quick's (a flag given on the command line wins over both)
SIZES = {
    "conversations": (16, 8), "turns": (4, 3), "system_prompts": (3, 2), "system_chars": (384, 128),
    "user_chars": (64, 24), "answer_tokens": (24, 8), "concurrency": (4, 2),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench_targets.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--png", metavar="PATH", default=None,
                        help="also draw hit rate and TTFT per policy to PATH (needs matplotlib: the bench extra)")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help="comma-separated proxy --policy values, NAME+local for NAME with local prefill "
                             "(default %(default)s)")
    parser.add_argument("--local-prefill-max-tokens", type=int, default=None, metavar="N",
                        help="the proxy's --local-prefill-max-tokens for NAME+local (default: a turn's new tokens, "
                             "the previous answer and a user message, plus two blocks)")
    parser.add_argument("--cache-fraction", default=f"{FULL},{HALF}",
                        help="comma-separated engine cache sizes as shares of the working set; the targets need "
                             f"{FULL} and {HALF} (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="a small workload (the test's): " + ", ".join(
        f"--{k.replace('_', '-')} {v[1]}" for k, v in SIZES.items()))
    for key, (full, _quick) in SIZES.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"default {full}")
    parser.add_argument("--prefill-engines", type=int, default=2)
    parser.add_argument("--decode-engines", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16, help="the engines' --block-size")
    parser.add_argument("--seed", type=int, default=0, help="the workload's text and order")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--startup-timeout", type=float, default=120.0, help="seconds for a cluster to start")
    group = parser.add_argument_group("the outside client (aiperf)")
    group.add_argument("--aiperf", metavar="PATH", default=None,
                       help="the aiperf executable (pip install aiperf into its own virtualenv; default: aiperf "
                            "on PATH, else the row is not run)")
    group.add_argument("--aiperf-only", action="store_true", help="run only the outside client's row")
    group.add_argument("--no-aiperf", action="store_true", help="leave the outside client's row out (not run)")
    for flag, kind, default, what in AIPERF_FLAGS:
        group.add_argument(f"--aiperf-{flag}", type=kind, default=default, help=f"{what} (default %(default)s)")


#: (flag after --aiperf-, type, default, help): the aiperf workload, the same for both policies
AIPERF_FLAGS = (
    ("request-rate", float, 3.0, "requests/s, constant arrivals"),
    ("request-count", int, 36, "requests per policy"),
    ("system-prompt-tokens", int, 512, "the shared system prompt's tokens"),
    ("input-tokens", int, 48, "tokens of each user turn"),
    ("output-tokens", int, 16, "tokens of each answer"),
    ("turns", int, 3, "turns per conversation (each carries the conversation so far)"),
    ("num-blocks", int, 512, "each engine's --num-blocks for these runs"),
    ("timeout", float, 300.0, "seconds for one aiperf run, then it is stopped"),
)


def _aiperf_workload(args: argparse.Namespace) -> routing_aiperf.AiperfWorkload:
    for flag, _kind, _default, _what in AIPERF_FLAGS:
        value = getattr(args, "aiperf_" + flag.replace("-", "_"))
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"--aiperf-{flag}: must be a number > 0, got {value}")
    return routing_aiperf.AiperfWorkload(
        request_rate=args.aiperf_request_rate, request_count=args.aiperf_request_count,
        system_prompt_tokens=args.aiperf_system_prompt_tokens, input_tokens=args.aiperf_input_tokens,
        output_tokens=args.aiperf_output_tokens, turns=args.aiperf_turns, seed=args.seed,
        request_timeout_s=args.request_timeout, timeout_s=args.aiperf_timeout)


def _outside_client(args: argparse.Namespace, workload: routing_aiperf.AiperfWorkload, log_root: str,
                    info: Any) -> tuple[bench_targets.Target, dict[str, Any]]:
    """The aiperf row: not run (with the reason) when no aiperf is found, else both policies' runs."""
    exe, why = (None, "--no-aiperf") if args.no_aiperf else routing_aiperf.find_aiperf(args.aiperf)
    if exe is None:
        return bench_targets.Target(routing_aiperf.TARGET_NAME, f"{routing_aiperf.CLAIM}: not run ({why})",
                                    None), {"status": "not_run", "reason": why}
    shape = RunShape(args.prefill_engines, args.decode_engines, args.aiperf_num_blocks, args.block_size,
                     args.concurrency, args.request_timeout, args.startup_timeout)

    @contextlib.contextmanager
    def cluster(policy: str, log_dir: str) -> Iterator[Any]:
        with policy_cluster(PolicySpec(policy, policy), shape, log_dir) as started:
            warm_up(started, shape)
            yield started

    print(f"aiperf ({exe}): {workload.request_count} requests at {workload.request_rate:g}/s, a shared system "
          f"prompt of {workload.system_prompt_tokens} tokens, {workload.turns} turns of {workload.input_tokens} "
          f"+ {workload.output_tokens} tokens; new engines (--num-blocks {args.aiperf_num_blocks}) per policy",
          file=info, flush=True)
    target, runs = routing_aiperf.run_row(exe, workload, cluster, log_root,
                                          lambda line: print(line, file=sys.stderr, flush=True))
    return target, {"status": "run", "aiperf": exe, "workload": dataclasses.asdict(workload), "runs": runs}


def _fractions(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--cache-fraction: {text!r} is not a comma-separated list of numbers") from None
    if not values or any(not 0 < v <= 4 for v in values) or len(set(values)) != len(values):
        raise ValueError(f"--cache-fraction: {text!r}: each share must be in (0, 4], each once")
    return values


def _plan(args: argparse.Namespace) -> Plan:
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else v[1 if args.quick else 0]
             for k, v in SIZES.items()}
    for key, value in sizes.items():
        if value < 1:
            raise ValueError(f"--{key.replace('_', '-')}: must be >= 1, got {value}")
    args.concurrency = sizes.pop("concurrency")
    return Plan(seed=args.seed, **sizes)


def _local_tokens(args: argparse.Namespace, plan: Plan) -> int:
    if args.local_prefill_max_tokens is not None:
        if args.local_prefill_max_tokens < 1:
            raise ValueError("--local-prefill-max-tokens: must be >= 1 (a NAME+local policy turns it on)")
        return args.local_prefill_max_tokens
    bs = args.block_size
    new = plan.user_chars + len("\nAssistant:") + plan.answer_tokens + 2 * bs
    return -(-new // bs) * bs


def _num_blocks(fraction: float, working_set: int, plan: Plan, args: argparse.Namespace) -> tuple[int, bool]:
    """An engine's ``--num-blocks`` for ``fraction``, and whether the requests in flight set it instead."""
    in_flight = args.concurrency * -(-plan.longest_request_tokens() // args.block_size)
    wanted = math.ceil(fraction * working_set)
    return max(wanted, in_flight), in_flight > wanted


def _ratio_target(name: str, cases: dict[float, dict[str, Any]], fraction: float, who: str, base: str,
                  figure: str, unit: str, most: Optional[float] = None, least: Optional[float] = None
                  ) -> bench_targets.Target:
    """``who``'s ``figure`` against ``base``'s in the ``fraction`` case: at most (or at least) a factor."""
    factor = most if most is not None else least
    sign = "<=" if most is not None else ">="
    claim = f"{who} {sign} {factor} x {base}"
    case = cases.get(fraction)
    if case is None:
        return bench_targets.Target(name, f"{claim}: not run (--cache-fraction has no {fraction})", None)
    mine, theirs = (_lookup(case, p, figure) for p in (who, base))
    why = mine[1] or theirs[1]
    if why:
        return bench_targets.Target(name, f"{claim}: not run ({why})", None)
    a, b = mine[0], theirs[0]
    ok = a <= factor * b if most is not None else a >= factor * b
    ratio = f"{a / b:.2f}x" if b else "inf"
    note = ""
    oracle = case["policies"][who].get("oracle_hit_rate") if figure == "hit_rate" else None
    if least is not None and oracle is not None and factor * b > oracle:
        note = (f"; unreachable on this workload: {factor} x {base} = {factor * b:.3f} is above the oracle "
                f"({oracle:.3f}), the hit rate if every turn met its whole earlier prefix")
    return bench_targets.Target(name, f"{claim}: {a:g}{unit} against {b:g}{unit} ({ratio}){note}", ok)


def _lookup(case: dict[str, Any], policy: str, figure: str) -> tuple[Any, str]:
    """(value, "") of ``policy``'s ``figure`` (a dotted path) in ``case``, or (None, why not)."""
    result = case["policies"].get(policy)
    if result is None:
        return None, f"{policy} is not in --policies"
    if result["status"] != "ok":
        return None, f"{policy}: {result['reason']}"
    value: Any = result
    for part in figure.split("."):
        value = value[part]
    if value is None:
        return None, f"{policy} has no {figure}"
    return value, ""


def _targets(cases: dict[float, dict[str, Any]]) -> dict[str, bench_targets.Target]:
    T = bench_targets.Target
    full = cases.get(FULL)
    if full is None:
        oracle_t = T("hit rate, full caches", f"kv_aware >= 0.9 x oracle: not run (--cache-fraction has no {FULL})",
                     None)
    else:
        value, why = _lookup(full, "kv_aware", "hit_rate")
        oracle = next((r["oracle_hit_rate"] for r in full["policies"].values() if r["status"] == "ok"), None)
        if oracle is None and not why:
            why = "no policy reported the oracle's hit rate"
        oracle_t = (T("hit rate, full caches", f"kv_aware >= 0.9 x oracle: not run ({why})", None)
                    if why or oracle is None else
                    T("hit rate, full caches", f"kv_aware {value:g} >= 0.9 x oracle ({oracle:g})",
                      value >= 0.9 * oracle))
    return {
        "hit_rate_full": oracle_t,
        "hit_rate_half": _ratio_target("hit rate, half caches", cases, HALF, "kv_aware", "cache_aware", "hit_rate",
                                       "", least=1.3),
        "kv_bytes_turns_2_plus": _ratio_target("KV bytes moved on turns >= 2", cases, FULL, "kv_aware", "round_robin",
                                               "kv_bytes_moved_turns_2_plus", " B", most=0.5),
        "ttft_p50_local": _ratio_target("TTFT p50, multi-turn (turns >= 2)", cases, FULL, "kv_aware+local",
                                        "round_robin", "ttft_ms.p50_turns_2_plus", " ms", most=0.7),
        "proxy_cpu": _ratio_target("proxy CPU per request", cases, FULL, "kv_aware", "round_robin",
                                   "proxy_cpu_ms_per_request", " ms", most=1.3),
        "index": T("index", "<= 160 B per (block, instance) entry, >= 300,000 blocks/s on one core, event lag p99 <= "
                   "50 ms: measured by "
                   "python -m atom_kv.bench kv-index, not here", None),
    }


def _print_case(case: dict[str, Any]) -> None:
    floored = "; the requests in flight need this many" if case["floored"] else ""
    print(f"\ncache fraction {case['cache_fraction']}: --num-blocks {case['num_blocks']} per engine (working set "
          f"about {case['working_set_blocks']} blocks{floored})")
    print(f"{'policy':<16} {'hit':>6} {'oracle':>6} {'P hit':>6} {'computed':>9} {'KV MB':>7} {'MB t>=2':>7} "
          f"{'TTFT p50':>8} {'p99':>7} {'t>=2 p50':>8} {'CPU ms/req':>10}")
    for name, r in case["policies"].items():
        if r["status"] != "ok":
            print(f"{name:<16} {r['status'].replace('_', ' ')}: {r['reason']}"
                  + (f" ({r['proxy_error']})" if r.get("proxy_error") else ""))
            continue
        pool = r["prefill_pool"]
        p_hit = pool["hits"] / pool["queries"] if pool["queries"] else 0.0
        t = r["ttft_ms"]
        print(f"{name:<16} {r['hit_rate']:>6.3f} {r['oracle_hit_rate']:>6.3f} {p_hit:>6.3f} "
              f"{r['prefill_tokens_computed']:>9} {r['kv_bytes_moved'] / 1e6:>7.1f} "
              f"{r['kv_bytes_moved_turns_2_plus'] / 1e6:>7.1f} {t['p50']:>8.1f} {t['p99']:>7.1f} "
              f"{t['p50_turns_2_plus']:>8.1f} {r['proxy_cpu_ms_per_request']:>10.2f}")
        if r["local_prefills"]:
            print(f"{'':<16} proxy: {', '.join(f'{k} {v:g}' for k, v in r['local_prefills'].items())}")


def _policy_cases(args: argparse.Namespace, plan: Plan, fractions: list[float], specs: list[PolicySpec],
                  local_tokens: int, log_root: str, info: Any) -> tuple[dict[float, dict[str, Any]], bool]:
    """Every policy of ``specs`` at every cache fraction, each on new engines; (the cases, whether one failed)."""
    refused: dict[str, str] = {}
    for spec in specs:
        why = proxy_refusal(spec.proxy_flags())
        if why is not None:
            refused[spec.name] = why
            print(f"policy {spec.name}: not run, the proxy refused {' '.join(spec.proxy_flags())}: {why}",
                  file=info, flush=True)
    if any(s.local_prefill_max_tokens for s in specs):
        print(f"NAME+local: --local-prefill-max-tokens {local_tokens}", file=info)
    estimate = working_set_blocks(plan.estimated_sequences(), args.block_size)
    print(f"workload: {plan.conversations} conversations x {plan.turns} turns over {plan.system_prompts} system "
          f"prompts ({plan.system_chars} characters), user messages of {plan.user_chars}, answers of "
          f"{plan.answer_tokens} tokens, {args.concurrency} at once; {args.prefill_engines} prefill + "
          f"{args.decode_engines} decode engines, new engines and proxy for every policy", file=info, flush=True)
    cases: dict[float, dict[str, Any]] = {}
    failed = False
    for fraction in fractions:
        num_blocks, floored = _num_blocks(fraction, estimate, plan, args)
        shape = RunShape(args.prefill_engines, args.decode_engines, num_blocks, args.block_size, args.concurrency,
                         args.request_timeout, args.startup_timeout)
        case: dict[str, Any] = {"cache_fraction": fraction, "num_blocks": num_blocks, "floored": floored,
                                "working_set_blocks": estimate, "policies": {}}
        for spec in specs:
            if spec.name in refused:
                case["policies"][spec.name] = {
                    "policy": spec.name, "status": "not_run", "proxy_flags": spec.proxy_flags(),
                    "reason": f"the proxy refused {' '.join(spec.proxy_flags())}", "proxy_error": refused[spec.name]}
                continue
            print(f"cache fraction {fraction}: {spec.name} ...", file=sys.stderr, flush=True)
            try:
                result = run_policy(spec, plan, shape, os.path.join(log_root, f"{fraction}-{spec.name}"))
            except Exception as exc:
                failed = True
                result = {"policy": spec.name, "status": "failed", "reason": str(exc)}
                print(f"policy {spec.name}: failed: {exc} (logs in {log_root})", file=sys.stderr, flush=True)
            case["policies"][spec.name] = result
        cases[fraction] = case
    return cases, failed


def run(args: argparse.Namespace) -> int:
    try:
        plan = _plan(args)
        fractions = _fractions(args.cache_fraction)
        local_tokens = _local_tokens(args, plan)
        specs = parse_policies(args.policies, local_tokens)
        if min(args.prefill_engines, args.decode_engines, args.block_size) < 1:
            raise ValueError("--prefill-engines, --decode-engines and --block-size must be >= 1")
        workload = _aiperf_workload(args)
        if args.no_aiperf and (args.aiperf is not None or args.aiperf_only):
            raise ValueError("--no-aiperf leaves out what --aiperf and --aiperf-only ask for: give one of them")
        if args.aiperf is not None and routing_aiperf.find_aiperf(args.aiperf)[0] is None:
            raise ValueError(routing_aiperf.find_aiperf(args.aiperf)[1])
    except ValueError as exc:
        print(f"routing bench: {exc}", file=sys.stderr)
        return 2
    if args.png is not None and args.aiperf_only:
        print("routing bench: --png draws the policies' runs, which --aiperf-only leaves out", file=sys.stderr)
        return 2
    if args.png is not None:
        folder = os.path.dirname(os.path.abspath(args.png))
        problem = routing_chart.missing() or (None if os.path.isdir(folder) else
                                              f"--png: the folder {folder} does not exist")
        if problem is not None:
            print(f"routing bench: {problem}", file=sys.stderr)
            return 2
    info = sys.stderr if args.json else sys.stdout
    log_root = tempfile.mkdtemp(prefix="atom-kv-bench-routing-")
    cases: dict[float, dict[str, Any]] = {}
    failed = False
    if not args.aiperf_only:
        cases, failed = _policy_cases(args, plan, fractions, specs, local_tokens, log_root, info)
    outside, outside_doc = _outside_client(args, workload, log_root, info)
    if any(r["status"] == "failed" for r in outside_doc.get("runs", {}).values()):
        failed = True
        print(f"aiperf: logs in {log_root}", file=sys.stderr, flush=True)
    if not failed:
        shutil.rmtree(log_root, ignore_errors=True)
    targets = {} if args.aiperf_only else _targets(cases)
    targets["outside_client"] = outside
    doc: dict[str, Any] = {"workload": {"conversations": plan.conversations, "turns": plan.turns,
                                       "system_prompts": plan.system_prompts, "system_chars": plan.system_chars,
                                       "user_chars": plan.user_chars, "answer_tokens": plan.answer_tokens,
                                       "concurrency": args.concurrency, "block_size": args.block_size,
                                       "prefill_engines": args.prefill_engines, "decode_engines": args.decode_engines},
                          "between_policies": "new engines and a new proxy for every policy",
                          "local_prefill_max_tokens": local_tokens,
                          "cases": list(cases.values()),
                          "outside_client": outside_doc,
                          "targets": {k: {"name": t.name, "text": t.text, "met": t.met} for k, t in targets.items()}}
    if args.png is not None:
        routing_chart.draw(doc, args.png)
        print(f"chart: {args.png}", file=info)
    if args.json:
        print(json.dumps(doc))
    else:
        for case in doc["cases"]:
            _print_case(case)
        if doc["cases"]:
            print()
    status = bench_targets.report(targets.values(), explore=args.explore, json_output=args.json)
    return 1 if failed else status
