"""``python -m atom_kv.bench proxy``: proxy-added latency, throughput and CPU in front of fake engines.

Processes: fake prefill and decode engines (``atom_kv.testing.fake_engine``),
the proxy (``python -m atom_kv.proxy``, engines given by ``--prefill`` /
``--decode``), optionally a peer router (``--peer vllm-router``: the Rust P/D
router from PyPI, run when its executable is on ``PATH``) in front of the
same engines, and this load generator. "Direct" means the load generator
itself runs both legs (prefill, then decode) against the engines, which is
exactly the work a proxy does; the difference is what the proxy adds. Every
figure for ours and the peer comes from the same run, measured alternately:
each throughput run is cut into ``--rounds`` slices taken in turn (ours,
peer, peer, ours, ...), so a shift in the machine's load (other processes,
frequency) does not favour whichever ran first.

CPU per request is each proxy process's user+system CPU time (from
``/proc``, children included) during a throughput run, divided by the
requests it served: its cost on a core of its own, whatever the load
generator does to the machine.

``--hit-rate`` also runs a multi-turn workload with shared system prompts
against several prefill engines that model a prefix cache, once per prefill
policy (and through the peer with its ``cache_aware``), and reports the share
of prompt characters that were already cached on the engine that got them.

Targets, each printed with met or MISSED (exit status 1 on a miss unless
``--explore``; 2 when a request failed): proxy-added p50 <= 2 ms at
concurrency 1, no errors at 512, and with ``--peer`` at least the peer's
req/s and at most its CPU per request at 64.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import aiohttp

from atom_kv._cli import OneLineParser
from atom_kv.bench import targets as bench_targets
from atom_kv.proxy.settings import POLICIES
from atom_kv.testing.ports import free_port
from atom_kv.testing.procfs import process_stats

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEERS = ("vllm-router",)
HIT_RATE_POLICIES = ("round_robin", "prefix_hash", "cache_aware")
HIT_RATE_CACHE_BLOCKS = 400  # per prefill engine: room for about two active conversations


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench_targets.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--prefill-delay", type=float, default=0.002, help="fake prefill delay in seconds")
    parser.add_argument("--tokens", type=int, default=32, help="tokens streamed by the fake decode")
    parser.add_argument("--latency-requests", type=int, default=300, help="requests for the concurrency-1 runs")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per throughput run")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --peer: each throughput run is split into this many slices, alternated "
                             "with the peer's (ours, peer, peer, ours, ...), so a change in the machine's load "
                             "hits both alike (default %(default)s)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 512], help="throughput concurrencies")
    parser.add_argument("--policy", default="round_robin", choices=POLICIES)
    parser.add_argument("--peer", choices=PEERS, default=None,
                        help="also run the same load through this router (its executable must be on PATH)")
    parser.add_argument("--hit-rate", action="store_true",
                        help="also measure prefix-cache hit rates of the prefill policies on a multi-turn workload")
    parser.add_argument("--sessions", type=int, default=32, help="--hit-rate: conversations")
    parser.add_argument("--turns", type=int, default=8, help="--hit-rate: turns per conversation")
    parser.add_argument("--prefill-engines", type=int, default=4, help="--hit-rate: prefill engines")
    parser.add_argument("--startup-timeout", type=float, default=20.0)
    parser.add_argument("--baseline", action="store_true",
                        help="also measure a minimal re-implementation of ATOM's original proxy behaviour "
                             "(Quart's built-in server, a new HTTP session per request) side by side")
    parser.add_argument("--admission", action="store_true",
                        help="also measure the proxy's CPU per request with admission control on (caps, queue and "
                             "rate limit far above the load) against off, alternated at c=64")


# ---------------------------------------------------------------------- ATOM's original proxy, for comparison
def _baseline_app(prefill: str, decode: str) -> Any:
    """ATOM's original proxy behaviour, reduced to what the bench exercises: Quart's own
    ``run_task`` server, one new aiohttp session per request, streams sent as
    ``application/json``. Used only as a point of comparison."""
    from quart import Quart, Response, make_response, request

    app = Quart("atom-original-proxy-baseline")

    @app.post("/v1/completions")
    async def completions() -> Any:
        body = await request.get_json()
        pre = dict(body, stream=False, max_tokens=1,
                   kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
        async with aiohttp.ClientSession() as session:
            async with session.post(prefill + "/v1/completions", json=pre) as resp:
                kv = (await resp.json())["kv_transfer_params"]

        async def generate() -> Any:
            dec = dict(body, kv_transfer_params=dict(kv, do_remote_prefill=True, do_remote_decode=False))
            async with aiohttp.ClientSession() as session:
                async with session.post(decode + "/v1/completions", json=dec) as resp:
                    async for chunk in resp.content.iter_chunked(1024):
                        yield chunk

        response = await make_response(generate())
        assert isinstance(response, Response)  # quart's, for a generator (werkzeug's has no timeout)
        response.headers["Content-Type"] = "application/json"  # as the original did, even for streams
        response.timeout = None
        return response

    @app.get("/health")
    async def health() -> Any:
        return Response(b"{}", content_type="application/json")

    return app


def _serve_baseline(argv: list[str]) -> int:
    parser = OneLineParser(description="ATOM original-proxy baseline for the proxy bench")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    args = parser.parse_args(argv)
    app = _baseline_app(args.prefill, args.decode)
    asyncio.run(app.run_task(host="127.0.0.1", port=args.port))
    return 0


# ---------------------------------------------------------------------- processes
def _start(cmd: list[str], log: Any, stdout: Any = subprocess.DEVNULL) -> subprocess.Popen:
    """Start a helper process; its stderr goes to ``log`` (never an unread pipe that could fill up)."""
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(cmd, cwd=_ROOT, env=env, stdout=stdout, stderr=log, text=True)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _fake_engines(log: Any, *args: str) -> tuple[subprocess.Popen, list[str], list[str]]:
    proc = _start([sys.executable, "-m", "atom_kv.testing.fake_engine", *args], log, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("ready "):
        _stop(proc)
        log.seek(0)
        raise RuntimeError(f"fake engines failed to start: {line}\n{log.read()[-2000:]}")
    addrs = dict(part.split("=", 1) for part in line.split()[1:])
    return proc, addrs["prefill"].split(","), addrs["decode"].split(",")


@dataclass
class Target:
    """A proxy under test: its URL and process."""

    name: str
    url: str
    proc: subprocess.Popen


def _start_ours(log: Any, prefills: list[str], decodes: list[str], prefill_policy: str,
                decode_policy: str, extra: tuple[str, ...] = ()) -> Target:
    port = free_port()
    cmd = [sys.executable, "-m", "atom_kv.proxy", "--host", "127.0.0.1", "--port", str(port), "--no-discovery",
           "--prefill-policy", prefill_policy, "--decode-policy", decode_policy, "--log-level", "WARNING", *extra]
    for url in prefills:
        cmd += ["--prefill", url]
    for url in decodes:
        cmd += ["--decode", url]
    return Target("atom-kv", f"http://127.0.0.1:{port}", _start(cmd, log))


def _start_vllm_router(log: Any, prefills: list[str], decodes: list[str], prefill_policy: str,
                       decode_policy: str) -> Target:
    exe = shutil.which("vllm-router")
    assert exe is not None
    port = free_port()
    cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
           "--prefill-policy", prefill_policy, "--decode-policy", decode_policy,
           "--prometheus-port", str(free_port()), "--log-level", "warning"]
    for url in prefills:
        cmd += ["--prefill", url]
    for url in decodes:
        cmd += ["--decode", url]
    return Target("vllm-router", f"http://127.0.0.1:{port}", _start(cmd, log))


def _cpu_seconds(pid: int | None) -> float | None:
    """User+system CPU seconds used so far by process ``pid`` and its children (Linux /proc), or None."""
    if pid is None:
        return None
    found = [s.cpu_s for s in process_stats() if pid in (s.pid, s.ppid)]
    return sum(found) if found else None


# ---------------------------------------------------------------------- load
def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _read_stream(resp: aiohttp.ClientResponse) -> bool:
    data = await resp.read()
    return resp.status == 200 and data.endswith(b"data: [DONE]\n\n") and b'"error"' not in data


class Load:
    """One client request, through a proxy or by running both legs directly."""

    def __init__(self, session: aiohttp.ClientSession, prefill: str, decode: str, tokens: int) -> None:
        self.session = session
        self.prefill = prefill
        self.decode = decode
        self.body = {"model": "fake-model", "prompt": "The quick brown fox " * 8, "max_tokens": tokens, "stream": True}

    def via(self, url: str) -> Callable[[], Awaitable[bool]]:
        async def request() -> bool:
            async with self.session.post(url + "/v1/completions", json=self.body) as resp:
                return await _read_stream(resp)
        return request

    async def direct(self) -> bool:
        pre = dict(self.body, stream=False, max_tokens=1,
                   kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
        async with self.session.post(self.prefill + "/v1/completions", json=pre) as resp:
            answer = await resp.json()
        kv = dict(answer["kv_transfer_params"], do_remote_prefill=True, do_remote_decode=False)
        async with self.session.post(self.decode + "/v1/completions", json=dict(self.body, kv_transfer_params=kv)) as resp:
            return await _read_stream(resp)


async def _latency(fns: list[Callable[[], Awaitable[bool]]], n: int) -> tuple[list[list[float]], int]:
    """Round-robin the functions at concurrency 1, so all see the same machine load."""
    lat: list[list[float]] = [[] for _ in fns]
    errors = 0
    for _ in range(min(20, n)):  # warm-up (connections, caches)
        for fn in fns:
            await fn()
    for _ in range(n):
        for fn, out in zip(fns, lat):
            t = time.perf_counter()
            try:
                ok = await fn()
            except aiohttp.ClientError:
                ok = False
            out.append(time.perf_counter() - t)
            errors += not ok
    return lat, errors


@dataclass
class _Slice:
    """One timed load slice against one target."""

    requests: int
    errors: int
    elapsed: float
    latencies: list[float]
    cpu_s: float | None


def _summary(concurrency: int, slices: list[_Slice]) -> dict[str, Any]:
    """Slices of one target at one concurrency, summed: requests over total time, CPU over requests."""
    done = sum(s.requests for s in slices)
    elapsed = sum(s.elapsed for s in slices)
    lat = [x for s in slices for x in s.latencies]
    out = {"concurrency": concurrency, "requests": done, "errors": sum(s.errors for s in slices),
           "req_per_s": round(done / elapsed, 1) if elapsed else 0.0,
           "p50_ms": round(_pct(lat, 0.5) * 1000, 2), "p99_ms": round(_pct(lat, 0.99) * 1000, 2)}
    cpu = [s.cpu_s for s in slices if s.cpu_s is not None]
    if done and len(cpu) == len(slices):  # every slice measured the proxy's CPU
        out["proxy_cpu_ms_per_req"] = round(sum(cpu) / done * 1000, 3)
    return out


async def _throughput(fn: Callable[[], Awaitable[bool]], concurrency: int, duration: float,
                      server_pid: int | None = None) -> dict[str, Any]:
    return _summary(concurrency, [await _slice(fn, concurrency, duration, server_pid)])


async def _slice(fn: Callable[[], Awaitable[bool]], concurrency: int, duration: float,
                 server_pid: int | None = None) -> _Slice:
    done = 0
    errors = 0
    lat: list[float] = []
    deadline = time.perf_counter() + duration

    async def worker() -> None:
        nonlocal done, errors
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            try:
                ok = await fn()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                ok = False
            lat.append(time.perf_counter() - t)
            done += 1
            errors += not ok

    cpu0 = _cpu_seconds(server_pid)
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    cpu1 = _cpu_seconds(server_pid)
    return _Slice(done, errors, elapsed, lat, cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None)


async def _alternated(ours: Target, peer: Target, fn_ours: Callable[[], Awaitable[bool]],
                      fn_peer: Callable[[], Awaitable[bool]], concurrency: int, duration: float,
                      rounds: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both targets at one concurrency, in ``rounds`` alternated slices (ABBA order), ``duration`` each in all."""
    part = duration / rounds
    slices: dict[str, list[_Slice]] = {"ours": [], "peer": []}
    for r in range(rounds):
        order = ("ours", "peer") if r % 2 == 0 else ("peer", "ours")
        for who in order:
            target, fn = (ours, fn_ours) if who == "ours" else (peer, fn_peer)
            slices[who].append(await _slice(fn, concurrency, part, target.proc.pid))
    return _summary(concurrency, slices["ours"]), _summary(concurrency, slices["peer"])


async def _wait_healthy(url: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited with status {proc.returncode}")
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(f"proxy at {url} did not become healthy within {timeout}s")


def _ms(values: list[float], q: float) -> float:
    return round(_pct(values, q) * 1000, 3)


async def _measure(args: argparse.Namespace, targets: list[Target], prefill: str, decode: str,
                   baseline: Target | None) -> dict[str, Any]:
    for t in targets + ([baseline] if baseline else []):
        await _wait_healthy(t.url, args.startup_timeout, t.proc)
    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        load = Load(session, prefill, decode, args.tokens)
        lat, c1_errors = await _latency([load.direct] + [load.via(t.url) for t in targets], args.latency_requests)
        direct_lat = lat[0]
        ours = lat[1]
        result: dict[str, Any] = {
            "prefill_delay_ms": args.prefill_delay * 1000,
            "tokens": args.tokens,
            "c1_direct_p50_ms": _ms(direct_lat, 0.5),
            "c1_direct_p99_ms": _ms(direct_lat, 0.99),
            "c1_proxy_p50_ms": _ms(ours, 0.5),
            "c1_proxy_p99_ms": _ms(ours, 0.99),
            "c1_added_p50_ms": round((_pct(ours, 0.5) - _pct(direct_lat, 0.5)) * 1000, 3),
            "c1_added_p99_ms": round((_pct(ours, 0.99) - _pct(direct_lat, 0.99)) * 1000, 3),
            "c1_errors": c1_errors,
            "direct_c64": await _throughput(load.direct, 64, args.duration),
            "throughput": [],
        }
        peer = targets[1] if len(targets) > 1 else None
        if peer is not None:
            result["peer"] = {"name": peer.name, "c1_p50_ms": _ms(lat[2], 0.5), "c1_p99_ms": _ms(lat[2], 0.99),
                              "throughput": []}
        for c in args.concurrency:  # ours and the peer alternated at each concurrency: same machine state
            if peer is None:
                result["throughput"].append(await _throughput(load.via(targets[0].url), c, args.duration,
                                                              targets[0].proc.pid))
                continue
            ours_row, peer_row = await _alternated(targets[0], peer, load.via(targets[0].url), load.via(peer.url),
                                                   c, args.duration, max(1, args.rounds))
            result["throughput"].append(ours_row)
            result["peer"]["throughput"].append(peer_row)
        if baseline is not None:
            base_lat, errs = await _latency([load.direct, load.via(baseline.url)], args.latency_requests)
            result["baseline"] = {
                "c1_p50_ms": _ms(base_lat[1], 0.5),
                "c1_added_p50_ms": round((_pct(base_lat[1], 0.5) - _pct(base_lat[0], 0.5)) * 1000, 3),
                "c1_errors": errs,
                "throughput": [await _throughput(load.via(baseline.url), 64, args.duration, baseline.proc.pid)],
            }
    return result


# ---------------------------------------------------------------------- admission control's cost
#: admission control on but never binding: what its bookkeeping costs per request (atom_kv.bench.admission
#: shows what it does under a burst)
ADMISSION_ON = ("--max-concurrent-per-engine", "100000", "--queue-size", "1024", "--queue-timeout", "30",
                "--rate-limit", "1000000,1000000")
ADMISSION_CPU_RATIO_TARGET = 1.1


async def admission_cpu_on_vs_off(args: argparse.Namespace, off: Target, on: Target, prefill: str,
                                  decode: str, concurrency: int = 64) -> dict[str, Any]:
    """The proxy's CPU per request with admission control on (``on``, started with :data:`ADMISSION_ON`)
    against off, in alternated slices at ``concurrency``; for ``bench proxy --admission``."""
    await _wait_healthy(on.url, args.startup_timeout, on.proc)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        load = Load(session, prefill, decode, args.tokens)
        await _alternated(off, on, load.via(off.url), load.via(on.url), 8, 0.5, 1)  # warm-up
        row_off, row_on = await _alternated(off, on, load.via(off.url), load.via(on.url), concurrency,
                                            args.duration, max(2, args.rounds))
    a, b = row_off.get("proxy_cpu_ms_per_req"), row_on.get("proxy_cpu_ms_per_req")
    ratio = round(b / a, 3) if a and b is not None else None
    return {"flags": " ".join(ADMISSION_ON), "concurrency": concurrency, "off": row_off, "on": row_on,
            "cpu_ratio": ratio, "cpu_ratio_target": ADMISSION_CPU_RATIO_TARGET}


# ---------------------------------------------------------------------- prefix-cache hit rate
def _conversations(sessions: int, turns: int, seed: int = 7) -> list[list[str]]:
    """Each conversation: a system prompt shared by a group of conversations, then turns that
    append a user message and the previous answer (the prompt grows: multi-turn chat)."""
    rng = random.Random(seed)
    words = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda")
    systems = [" ".join(rng.choice(words) for _ in range(80)) for _ in range(4)]  # ~0.5 KB each, all different
    out = []
    for s in range(sessions):
        history = systems[s % len(systems)]
        prompts = []
        for _t in range(turns):
            history += f"\nuser {s}: " + " ".join(rng.choice(words) for _ in range(80))
            prompts.append(history)
            history += "\nassistant:" + " t0 t1 t2 t3 t4 t5 t6 t7"
        out.append(prompts)
    return out


async def _run_conversations(url: str, conversations: list[list[str]], concurrency: int) -> int:
    errors = 0
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async def one(prompts: list[str]) -> None:
            nonlocal errors
            async with sem:
                for prompt in prompts:
                    async with s.post(url + "/v1/completions",
                                      json={"model": "fake-model", "prompt": prompt, "max_tokens": 8}) as r:
                        await r.read()
                        errors += r.status != 200
        await asyncio.gather(*(one(c) for c in conversations))
    return errors


async def _engine_stats(urls: list[str], reset: bool) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as s:
        out = []
        for url in urls:
            if reset:
                async with s.post(url + "/fake/reset") as r:
                    await r.read()
            else:
                async with s.get(url + "/fake/stats") as r:
                    out.append(await r.json())
        return out


async def _hit_rate_one(args: argparse.Namespace, target: Target, prefills: list[str],
                        conversations: list[list[str]]) -> dict[str, Any]:
    await _wait_healthy(target.url, args.startup_timeout, target.proc)
    await _engine_stats(prefills, reset=True)
    errors = await _run_conversations(target.url, conversations, concurrency=8)
    stats = await _engine_stats(prefills, reset=False)
    hit = sum(s["hit_chars"] for s in stats)
    total = sum(s["prompt_chars"] for s in stats)
    per_engine = [s["cache_requests"] for s in stats]
    return {"hit_rate": round(hit / total, 3) if total else 0.0, "requests_per_engine": per_engine,
            "errors": errors}


def _hit_rates(args: argparse.Namespace, log: Any, with_peer: bool) -> dict[str, Any]:
    engines, prefills, decodes = _fake_engines(
        log, "--prefills", str(args.prefill_engines), "--decodes", "2", "--tokens", "8",
        "--prefill-delay", "0.001", "--prefix-cache-blocks", str(HIT_RATE_CACHE_BLOCKS))
    conversations = _conversations(args.sessions, args.turns)
    out: dict[str, Any] = {"prefill_engines": args.prefill_engines, "sessions": args.sessions, "turns": args.turns,
                           "cache_blocks_per_engine": HIT_RATE_CACHE_BLOCKS, "policies": {}}
    try:
        runs: list[tuple[str, Callable[[Any, list[str], list[str], str, str], Target], str]] = [
            ("atom-kv " + p, _start_ours, p) for p in HIT_RATE_POLICIES]
        if with_peer:
            runs.append(("vllm-router cache_aware", _start_vllm_router, "cache_aware"))
        for name, starter, policy in runs:
            target = starter(log, prefills, decodes, policy, "round_robin")
            try:
                out["policies"][name] = asyncio.run(_hit_rate_one(args, target, prefills, conversations))
            finally:
                _stop(target.proc)
    finally:
        _stop(engines)
    return out


# ---------------------------------------------------------------------- report
def _print(result: dict[str, Any]) -> None:
    print(f"prefill delay {result['prefill_delay_ms']:.1f} ms, {result['tokens']} streamed tokens")
    print(f"concurrency 1: direct p50 {result['c1_direct_p50_ms']} ms p99 {result['c1_direct_p99_ms']} ms; "
          f"via proxy p50 {result['c1_proxy_p50_ms']} ms p99 {result['c1_proxy_p99_ms']} ms")
    print(f"proxy-added latency: p50 {result['c1_added_p50_ms']} ms, p99 {result['c1_added_p99_ms']} ms "
          f"(errors {result['c1_errors']})")
    d = result["direct_c64"]
    print(f"direct (both legs, no proxy) c=64: {d['req_per_s']} req/s, p50 {d['p50_ms']} ms, errors {d['errors']}")
    peer = result.get("peer")
    rows = [("atom-kv", result["c1_proxy_p50_ms"], result["throughput"])]
    if peer:
        rows.append((peer["name"], peer["c1_p50_ms"], peer["throughput"]))
    print(f"{'proxy':<12} {'c':>5} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} {'CPU ms/req':>10}")
    for name, _, tps in rows:
        for t in tps:
            print(f"{name:<12} {t['concurrency']:>5} {t['req_per_s']:>8} {t['p50_ms']:>8} {t['p99_ms']:>8} "
                  f"{t['errors']:>6} {t.get('proxy_cpu_ms_per_req', 'n/a'):>10}")
    if peer:
        r = result["ratio"]
        print(f"atom-kv / {peer['name']}: c=1 p50 {r['c1_p50']}x (lower is better), "
              + ", ".join(f"c={c} req/s {v}x" for c, v in r["req_per_s"].items())
              + ", " + ", ".join(f"c={c} CPU/request {v}x" for c, v in r["cpu_per_req"].items() if v is not None))
    elif result.get("peer_skipped"):
        print(result["peer_skipped"])
    if "baseline" in result:
        b = result["baseline"]
        t = b["throughput"][0]
        print(f"baseline (original ATOM proxy behaviour): c=1 p50 {b['c1_p50_ms']} ms "
              f"(added {b['c1_added_p50_ms']} ms); c=64 {t['req_per_s']} req/s, p50 {t['p50_ms']} ms, "
              f"errors {t['errors'] + b['c1_errors']}, proxy CPU {t.get('proxy_cpu_ms_per_req', 'n/a')} ms/request")
    if "hit_rate" in result:
        h = result["hit_rate"]
        print(f"prefix-cache hit rate: {h['sessions']} conversations x {h['turns']} turns, shared system prompts, "
              f"{h['prefill_engines']} prefill engines ({h['cache_blocks_per_engine']} cached 16-char blocks each)")
        for name, row in h["policies"].items():
            print(f"  {name:<26} hit rate {row['hit_rate']:.1%}  requests per engine {row['requests_per_engine']}"
                  f"  errors {row['errors']}")
    if "admission" in result:
        a = result["admission"]
        print(f"admission control on ({a['flags']}) vs off, c={a['concurrency']}: CPU "
              f"{a['on'].get('proxy_cpu_ms_per_req', 'n/a')} vs {a['off'].get('proxy_cpu_ms_per_req', 'n/a')} "
              f"ms/request ({a['cpu_ratio']}x), {a['on']['req_per_s']} vs {a['off']['req_per_s']} req/s, "
              f"errors {a['on']['errors'] + a['off']['errors']}")


def _ratios(result: dict[str, Any]) -> dict[str, Any]:
    peer = result["peer"]
    ours = {t["concurrency"]: t for t in result["throughput"]}
    theirs = {t["concurrency"]: t for t in peer["throughput"]}
    cpu = {}
    for c in ours:
        a, b = ours[c].get("proxy_cpu_ms_per_req"), theirs[c].get("proxy_cpu_ms_per_req")
        cpu[c] = round(a / b, 2) if a is not None and b else None
    return {
        "c1_p50": round(result["c1_proxy_p50_ms"] / peer["c1_p50_ms"], 2) if peer["c1_p50_ms"] else None,
        "req_per_s": {c: round(ours[c]["req_per_s"] / theirs[c]["req_per_s"], 2) if theirs[c]["req_per_s"] else None
                      for c in ours},
        "cpu_per_req": cpu,
    }


def run(args: argparse.Namespace) -> int:
    log = tempfile.TemporaryFile(mode="w+")
    targets: list[Target] = []
    baseline: Target | None = None
    engines = None
    with_peer = False
    skipped = None
    if args.peer == "vllm-router":
        with_peer = shutil.which("vllm-router") is not None
        if not with_peer:
            skipped = "peer vllm-router skipped: no vllm-router executable on PATH (pip install vllm-router)"
    try:
        engines, prefills, decodes = _fake_engines(log, "--prefill-delay", str(args.prefill_delay),
                                                   "--tokens", str(args.tokens))
        targets.append(_start_ours(log, prefills, decodes, args.policy, args.policy))
        if with_peer:
            targets.append(_start_vllm_router(log, prefills, decodes, args.policy, args.policy))
        if args.baseline:
            port = free_port()
            baseline = Target("baseline", f"http://127.0.0.1:{port}", _start(
                [sys.executable, "-m", "atom_kv.bench.proxy", "--port", str(port), "--prefill", prefills[0],
                 "--decode", decodes[0]], log))
        result = asyncio.run(_measure(args, targets, prefills[0], decodes[0], baseline))
        if args.admission:
            on = _start_ours(log, prefills, decodes, args.policy, args.policy, extra=ADMISSION_ON)
            targets.append(on)
            result["admission"] = asyncio.run(admission_cpu_on_vs_off(args, targets[0], on, prefills[0],
                                                                      decodes[0]))
    except Exception as exc:
        log.seek(0)
        print(f"proxy bench failed: {exc}\n{log.read()[-4000:]}", file=sys.stderr)
        return 1
    finally:
        for t in targets + ([baseline] if baseline else []):
            _stop(t.proc)
        _stop(engines)
    try:
        if args.hit_rate:
            result["hit_rate"] = _hit_rates(args, log, with_peer)
    except Exception as exc:
        log.seek(0)
        print(f"proxy bench (hit rate) failed: {exc}\n{log.read()[-4000:]}", file=sys.stderr)
        return 1
    finally:
        log.close()
    if skipped:
        result["peer_skipped"] = skipped
    by_c = {t["concurrency"]: t for t in result["throughput"]}
    result["targets"] = {
        "added_p50_le_2ms": result["c1_added_p50_ms"] <= 2.0,
        "c512_zero_errors": by_c[512]["errors"] == 0 if 512 in by_c else None,
    }
    if "admission" in result:
        ratio = result["admission"]["cpu_ratio"]
        result["targets"]["admission_cpu_le_1.1x"] = (None if ratio is None
                                                      else ratio <= ADMISSION_CPU_RATIO_TARGET)
    if "peer" in result:
        result["ratio"] = _ratios(result)
        peer64 = {t["concurrency"]: t for t in result["peer"]["throughput"]}.get(64)
        ours64 = by_c.get(64)
        result["targets"]["c64_req_per_s_ge_peer"] = (ours64["req_per_s"] >= peer64["req_per_s"]
                                                      if ours64 and peer64 else None)
        cpu = result["ratio"]["cpu_per_req"].get(64)
        result["targets"]["c64_cpu_per_req_le_peer"] = cpu <= 1.0 if cpu is not None else None
    if args.json:
        print(json.dumps(result))
    else:
        _print(result)
    missed = bench_targets.report(proxy_targets(result), explore=args.explore, json_output=args.json)
    errors = result["c1_errors"] + sum(t["errors"] for t in result["throughput"])
    if "admission" in result:
        errors += result["admission"]["on"]["errors"] + result["admission"]["off"]["errors"]
    return 2 if errors else missed


#: each of ``result["targets"]``'s keys: what it claims
TARGET_TEXT = {"added_p50_le_2ms": "proxy-added latency p50 <= 2 ms at concurrency 1",
               "c512_zero_errors": "no errors at concurrency 512",
               "c64_req_per_s_ge_peer": "req/s at concurrency 64 >= the peer's",
               "c64_cpu_per_req_le_peer": "CPU per request at concurrency 64 <= the peer's",
               "admission_cpu_le_1.1x": "CPU per request with admission control on <= 1.1x off"}


def proxy_targets(result: dict[str, Any]) -> list[bench_targets.Target]:
    """``result["targets"]`` (None: not measured, e.g. no concurrency 512 or no peer) with the figures."""
    figures = {"added_p50_le_2ms": f" ({result['c1_added_p50_ms']} ms)"}
    return [bench_targets.Target("proxy", TARGET_TEXT.get(k, k) + figures.get(k, ""), v)
            for k, v in result["targets"].items()]


if __name__ == "__main__":
    sys.exit(_serve_baseline(sys.argv[1:]))
