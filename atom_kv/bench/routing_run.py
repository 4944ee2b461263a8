"""One routing policy's run of ``bench routing``'s workload on a fresh proxy and fresh reference engines.

:func:`run_policy` starts a :class:`~atom_kv.testing.cluster.Cluster` (prefill and decode engines with KV
events on, a proxy with the policy's flags), warms it up with prompts shorter than a block (nothing cached),
sends the plan turn by turn (streamed, ``concurrency`` at once, each turn's requests shuffled), and closes
it. Every policy gets new engines, so no run starts with another's cache. What it reports comes from:

- the engines' ``/metrics`` counters, as deltas over the workload: prompt tokens computed
  (``atom_kv_prompt_tokens_total``, every engine), prefix-cache queries and hits per pool, blocks the decode
  engines read and the bytes their connectors moved (``atom_kv_transfer_bytes``, scraped after every turn);
- the client: TTFT (the first event carrying a choice) and each answer's text, which the next turn appends;
- ``/proc/<pid>/stat`` of the proxy: its CPU time over the workload;
- the engine's ``/tokenize``: each prompt's tokens, for the :class:`~atom_kv.bench.routing_workload.PrefixOracle`.

:func:`proxy_refusal` asks the proxy's own parser whether it takes a policy's flags, so a policy this proxy
does not know is reported (with the proxy's words) before any engine is started.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from atom_kv.bench.client import in_threads, stream_completion
from atom_kv.bench.routing_workload import Plan, PrefixOracle, Turn, working_set_blocks
from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.procfs import process_stat
from atom_kv.testing.web import http_json, scrape_metrics

__all__ = ["PolicySpec", "RunShape", "parse_policies", "policy_cluster", "proxy_refusal", "run_policy", "warm_up"]

LOCAL_SUFFIX = "+local"
_EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
                      "replay_endpoint": "tcp://127.0.0.1:0"})
_COUNTERS = {"computed": "atom_kv_prompt_tokens_total", "queries": "atom_kv_prefix_cache_queries_total",
             "hits": "atom_kv_prefix_cache_hits_total", "blocks_read": "atom_kv_kv_load_blocks_total",
             "bytes": "atom_kv_transfer_bytes"}


@dataclass(frozen=True)
class PolicySpec:
    """A policy as ``--policies`` names it: the proxy's ``--policy`` and, for ``NAME+local``, local prefill."""

    name: str
    policy: str
    local_prefill_max_tokens: int = 0  # 0: off (the flag is not passed)

    def proxy_flags(self) -> list[str]:
        flags = ["--policy", self.policy]
        if self.local_prefill_max_tokens:
            flags += ["--local-prefill-max-tokens", str(self.local_prefill_max_tokens)]
        return flags


def parse_policies(text: str, local_prefill_max_tokens: int) -> list[PolicySpec]:
    """``--policies``: comma-separated names, each a proxy ``--policy`` value, optionally with ``+local``
    (that policy with ``--local-prefill-max-tokens``). Raises ValueError naming the bad entry."""
    out: list[PolicySpec] = []
    for raw in text.split(","):
        name = raw.strip()
        base = name[:-len(LOCAL_SUFFIX)] if name.endswith(LOCAL_SUFFIX) else name
        if not base or not all(ch.isalnum() or ch == "_" for ch in base):
            raise ValueError(f"--policies: {raw!r} is not a policy name (a proxy --policy value such as "
                             f"round_robin, optionally with {LOCAL_SUFFIX!r}: kv_aware{LOCAL_SUFFIX})")
        if any(p.name == name for p in out):
            raise ValueError(f"--policies: {name!r} is named twice")
        out.append(PolicySpec(name, base, local_prefill_max_tokens if name != base else 0))
    return out


def proxy_refusal(flags: list[str]) -> Optional[str]:
    """The proxy's own one-line refusal of ``flags`` (its parser and settings, in this process), or None
    when it takes them."""
    from atom_kv.proxy.__main__ import build_parser, settings_from_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            settings_from_args(build_parser().parse_args(flags))
    except SystemExit:
        return err.getvalue().strip() or f"the proxy refused {' '.join(flags)}"
    except ValueError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class RunShape:
    """The cluster and client settings every policy's run shares."""

    prefill_engines: int
    decode_engines: int
    num_blocks: int  # per engine
    block_size: int
    concurrency: int
    request_timeout_s: float
    startup_timeout_s: float


def _pct(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _ms(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value * 1000, 2)


class _Counters:
    """The engines' counters, scraped per engine and summed per pool."""

    def __init__(self, cluster: Cluster, timeout: float) -> None:
        self.cluster = cluster
        self.timeout = timeout

    def scrape(self) -> dict[str, dict[str, float]]:
        pools: dict[str, dict[str, float]] = {"P": dict.fromkeys(_COUNTERS, 0.0), "D": dict.fromkeys(_COUNTERS, 0.0)}
        for i, spec in enumerate(self.cluster.specs):
            metrics = scrape_metrics(self.cluster.engine_url(i) + "/metrics", timeout=self.timeout)
            for key, name in _COUNTERS.items():
                pools[spec.role][key] += metrics.get(name, 0.0)
        return pools

    @staticmethod
    def delta(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        return {pool: {k: after[pool][k] - before[pool][k] for k in after[pool]} for pool in after}


def _cluster(spec: PolicySpec, shape: RunShape, log_dir: str) -> Cluster:
    engine_args = ["--kv-events-config", _EVENTS, "--block-size", str(shape.block_size), "--log-level", "WARNING"]
    roles = ["P"] * shape.prefill_engines + ["D"] * shape.decode_engines
    return Cluster([EngineSpec(role, num_blocks=shape.num_blocks, extra_args=engine_args) for role in roles],
                   proxy_args=[*spec.proxy_flags(), "--log-level", "WARNING"], log_dir=log_dir)


def _tokens(url: str, prompt: str, timeout: float) -> list[int]:
    status, body = http_json("POST", url + "/tokenize", {"prompt": prompt}, timeout=timeout)
    if status != 200 or not isinstance(body, dict):
        raise RuntimeError(f"{url}/tokenize answered {status}: {str(body)[:200]}")
    return body["tokens"]


def _proxy_local_prefills(url: str, timeout: float) -> dict[str, float]:
    """The proxy's counters whose name says local prefill (none on a proxy without it)."""
    metrics = scrape_metrics(url + "/metrics", timeout=timeout)
    return {k: v for k, v in metrics.items() if "local_prefill" in k and "{" not in k and k.endswith("_total")}


@contextlib.contextmanager
def policy_cluster(spec: PolicySpec, shape: RunShape, log_dir: str) -> Iterator[Cluster]:
    """New engines and a new proxy for ``spec``, started (logs in ``log_dir``) and closed on exit. Raises
    RuntimeError when the cluster does not start (the proxy's last words in it when it exited)."""
    os.makedirs(log_dir, exist_ok=True)
    cluster = _cluster(spec, shape, log_dir)
    try:
        cluster.start(timeout=shape.startup_timeout_s)
    except Exception as exc:
        proxy = cluster.proxy
        why = proxy.tail(3) if proxy is not None and not proxy.alive() else str(exc)
        raise RuntimeError(f"the cluster for {spec.name} did not start: {why}") from exc
    try:
        yield cluster
    finally:
        cluster.close()


def run_policy(spec: PolicySpec, plan: Plan, shape: RunShape, log_dir: str) -> dict[str, Any]:
    """The workload through ``spec`` on new engines; the figures of the run (see the module docstring).
    Raises RuntimeError when the cluster does not start or a request fails (the proxy's or the engine's
    words in it)."""
    started = time.perf_counter()
    with policy_cluster(spec, shape, log_dir) as cluster:
        return _measure(spec, plan, shape, cluster, time.perf_counter() - started)


def _send(url: str, prompt: str, max_tokens: int, timeout: float) -> tuple[float, str, float]:
    sent = time.perf_counter()
    out = stream_completion(url, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, timeout)
    return sent, out.text, out.first_choice


def warm_up(cluster: Cluster, shape: RunShape) -> None:
    """One short request per (prefill, decode) pair through the proxy: each pair's first use (connections,
    handshakes) is paid before anything is measured, and nothing is cached (no prompt fills a block)."""
    for i in range(shape.prefill_engines * shape.decode_engines):
        _send(cluster.proxy_url, f"warm {i}", 2, shape.request_timeout_s)


def _measure(spec: PolicySpec, plan: Plan, shape: RunShape, cluster: Cluster, startup_s: float) -> dict[str, Any]:
    url, timeout = cluster.proxy_url, shape.request_timeout_s
    warm_up(cluster, shape)
    counters = _Counters(cluster, timeout)
    assert cluster.proxy is not None
    proxy_pid = cluster.proxy.pid
    before, cpu0 = counters.scrape(), process_stat(proxy_pid)
    history = {c: plan.system_of(c) for c in range(plan.conversations)}
    records: list[dict[str, Any]] = []
    bytes_by_turn: list[float] = []
    t0 = time.perf_counter()
    for turn in range(1, plan.turns + 1):
        turn_before = counters.scrape()

        def one(item: Turn) -> dict[str, Any]:
            prompt = history[item.conversation] + item.user
            sent, text, ttft = _send(url, prompt, plan.answer_tokens, timeout)
            return {"conversation": item.conversation, "turn": item.turn, "sent": sent, "ttft_s": ttft,
                    "prompt": prompt, "answer": text}

        rows = in_threads(one, plan.turn_order(turn), shape.concurrency, "bench-routing")
        for row in rows:
            history[row["conversation"]] = row["prompt"] + row["answer"]
        records += rows
        bytes_by_turn.append(counters.delta(counters.scrape(), turn_before)["D"]["bytes"])
    wall = time.perf_counter() - t0
    cpu1 = process_stat(proxy_pid)
    d = counters.delta(counters.scrape(), before)
    local = _proxy_local_prefills(url, timeout)

    engine = cluster.engine_url(0)
    oracle = PrefixOracle(shape.block_size)
    prompt_tokens = 0
    finals: dict[int, list[int]] = {}
    for row in sorted(records, key=lambda r: (r["turn"], r["sent"])):
        prompt = _tokens(engine, row["prompt"], timeout)
        computed = _tokens(engine, row["prompt"] + row["answer"], timeout)[:-1]
        prompt_tokens += len(prompt)
        oracle.offer(prompt, computed)
        finals[row["conversation"]] = computed
    computed_tokens = d["P"]["computed"] + d["D"]["computed"]
    ttft_all = [r["ttft_s"] for r in records]
    ttft_later = [r["ttft_s"] for r in records if r["turn"] >= 2]
    cpu_s = (cpu1.cpu_s - cpu0.cpu_s) if cpu0 is not None and cpu1 is not None else None
    return {
        "policy": spec.name, "proxy_flags": spec.proxy_flags(), "status": "ok",
        "requests": len(records), "wall_s": round(wall, 2), "startup_s": round(startup_s, 2),
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": int(computed_tokens),
        "hit_rate": round(1 - computed_tokens / prompt_tokens, 4) if prompt_tokens else None,
        "oracle_hit_rate": round(oracle.hit_rate, 4),
        "working_set_blocks": working_set_blocks(finals.values(), shape.block_size),
        "prefill_pool": {"queries": int(d["P"]["queries"]), "hits": int(d["P"]["hits"]),
                         "tokens_computed": int(d["P"]["computed"])},
        "decode_pool": {"queries": int(d["D"]["queries"]), "hits": int(d["D"]["hits"]),
                        "tokens_computed": int(d["D"]["computed"]), "blocks_read": int(d["D"]["blocks_read"])},
        "kv_bytes_moved": int(d["D"]["bytes"]),
        "kv_bytes_moved_by_turn": [int(b) for b in bytes_by_turn],
        "kv_bytes_moved_turns_2_plus": int(sum(bytes_by_turn[1:])),
        "ttft_ms": {"p50": _ms(_pct(ttft_all, 0.5)), "p99": _ms(_pct(ttft_all, 0.99)),
                    "p50_turns_2_plus": _ms(_pct(ttft_later, 0.5)), "p99_turns_2_plus": _ms(_pct(ttft_later, 0.99))},
        "proxy_cpu_ms_per_request": round(cpu_s * 1000 / len(records), 3) if cpu_s is not None and records else None,
        "local_prefills": local,
    }

