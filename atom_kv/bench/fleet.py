"""``python -m atom_kv.bench fleet``: how the proxy's costs grow with the fleet, N = 2 to 1,000 engines.

For each N in ``--sizes`` (half prefill, half decode), one process serves N fake engines on loopback
addresses of their own (:mod:`atom_kv.bench.fleet_engines`, which says how a fake engine differs from a
real one: no model, no KV cache, no reads, no queueing). They register with a real proxy (``python -m
atom_kv.proxy``, its defaults except the two caps that a fleet this size needs: ``--max-instances`` and
``--discovery-max-connections``) by signed pings at ``--ping-interval`` (the engines' default 3 s), and
the proxy probes them as usual (``--probe-interval``, its default 2 s; each up engine's load read from its
``/health`` every ``--engine-load-interval``, default 2 s). Then, with the proxy's CPU time read from
``/proc`` (user + system, every thread):

- **idle**: no requests for ``--idle-seconds``: the proxy's CPU on pings, probes and load readings, as a
  share of one core;
- **requests**: ``--requests`` streamed completions at ``--concurrency`` through the proxy (round robin):
  its CPU per request (CPU time is less sensitive than the wall clock to the machine's other load), net
  of the idle rate the pings and probes cost meanwhile (``gross_cpu_ms_per_request`` keeps it in), and
  the p50/p99 latency it adds over the load generator running both legs itself (direct, the same
  requests against the same engines, round robin too);
- **RSS**: the proxy's resident memory after the requests; per engine, the growth over the smallest N;
- **new engine**: while requests run, one prefill and one decode engine are added; the time from each
  one's first ping to its first request (both clocks are the host's monotonic clock);
- **KV events** (unless ``--no-kv-events``): a second proxy with ``--policy kv_aware``, and every engine
  publishing KV events (``--kv-rate`` batches a second of ``--kv-blocks`` new blocks each, ``--kv-held``
  kept): index entries (from ``/metrics``), the proxy's RSS over the first run's (the index's memory) and
  its CPU over the first run's idle CPU (event ingest).

Targets, each printed with met or MISSED (exit status 1 on a miss unless ``--explore``): CPU per request
at the largest N <= 1.2x the smallest N's; RSS per engine <= 20 KB without the KV index; idle CPU at
N >= 1,000 with the default intervals <= 5% of one core; new engine to first request <= one ping
interval + one probe interval. ``--json PATH`` writes the figures, each size's row as soon as it is
measured; a size that fails (a start-up or ``/metrics`` read past ``--startup-timeout``, which grows with
N) is one line on stderr and a row with its ``error``, the other sizes still run, and the exit status is 1.
``--png DIR`` draws one chart per figure against N (matplotlib: the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import aiohttp

from atom_kv.bench import targets as bench_targets
from atom_kv.bench.fleet_rows import kv_row, measured
from atom_kv.testing.ports import free_port
from atom_kv.testing.procfs import process_stat, rss_bytes

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_SIZES = (2, 64, 256, 1000)
DEFAULT_PING_INTERVAL = 3.0  # the engines' ping_interval_s
DEFAULT_PROBE_INTERVAL = 2.0  # the proxy's --probe-interval
CPU_RATIO_TARGET = 1.2
RSS_PER_ENGINE_TARGET = 20 * 1024
IDLE_CPU_TARGET = 0.05
IDLE_TARGET_N = 1000
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
STARTUP_BASE_S = 30.0  # --startup-timeout's default: this, plus ...
STARTUP_PER_ENGINE_S = 0.15  # ... this per engine (a loaded 2-core machine registered 1,000 in about 60 s)


def startup_timeout(args: argparse.Namespace, n: int) -> float:
    """The bound on one size's start-up (and on one /metrics read): ``--startup-timeout``, else scaled with N."""
    return args.startup_timeout if args.startup_timeout is not None else STARTUP_BASE_S + STARTUP_PER_ENGINE_S * n


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes: expected engine counts like 2,64,256,1000, got {text!r}") from None
    if not sizes or sizes[0] < 2:
        raise argparse.ArgumentTypeError(f"--sizes: every size must be at least 2 (a prefill and a decode), "
                                         f"got {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench_targets.add_arguments(parser)
    parser.add_argument("--sizes", type=_sizes, default=list(DEFAULT_SIZES),
                        help="engine counts, half prefill and half decode (default 2,64,256,1000)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (default %(default)s)")
    parser.add_argument("--requests", type=int, default=2000, help="requests per size and mode (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens each decode streams (default %(default)s)")
    parser.add_argument("--idle-seconds", type=float, default=10.0,
                        help="the idle window (pings and probes only) per size (default %(default)s)")
    parser.add_argument("--ping-interval", type=float, default=DEFAULT_PING_INTERVAL,
                        help="the engines' ping interval (default %(default)s, the engines' own)")
    parser.add_argument("--probe-interval", type=float, default=DEFAULT_PROBE_INTERVAL,
                        help="the proxy's --probe-interval and --engine-load-interval (default %(default)s, its own)")
    parser.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                        help="skip the KV event run (kv_aware, every engine publishing)")
    parser.add_argument("--kv-rate", type=float, default=1.0, help="KV event batches a second per engine")
    parser.add_argument("--kv-blocks", type=int, default=4, help="blocks stored per batch")
    parser.add_argument("--kv-held", type=int, default=32, help="blocks each engine keeps (older ones removed)")
    parser.add_argument("--startup-timeout", type=float, default=None,
                        help="seconds for the proxy to start and the fleet to register, and for one /metrics read "
                             f"(default {STARTUP_BASE_S:g} + {STARTUP_PER_ENGINE_S:g} per engine: 180 s at N=1,000)")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="run each proxy under cProfile, its stats written to DIR/proxy-N<n>[-kv].prof")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the figures as JSON to PATH ('-': stdout)")
    parser.add_argument("--png", metavar="DIR", default=None, help="write one PNG chart per figure against N to DIR")


# ---------------------------------------------------------------------- processes
class _Proc:
    """A helper process (the proxy or the fleet): started with its stderr in ``log``, stopped once."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 15.0)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def _start(name: str, args: list[str], log: Any, *, pipes: bool = False) -> _Proc:
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pipe = asyncio.subprocess.PIPE if pipes else asyncio.subprocess.DEVNULL
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", *args, cwd=_ROOT, env=env, stdin=pipe,
                                                stdout=pipe, stderr=log)
    return _Proc(proc, name)


def _cpu(pid: int) -> float:
    """``pid``'s CPU seconds so far, all its threads: from each thread's ``schedstat`` (nanoseconds), else
    from ``stat`` (clock ticks, 10 ms each: too coarse for a short window)."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        stat = process_stat(pid)
        if stat is None:
            raise RuntimeError(f"process {pid} is gone") from None
        return stat.cpu_s


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


class _Run:
    """One proxy and one fleet for one N: started, waited for, measured, stopped."""

    def __init__(self, args: argparse.Namespace, n: int, log: Any, token_file: str, *, kv: bool) -> None:
        self.args = args
        self.n = n
        self.prefills = max(1, n // 2)
        self.decodes = max(1, n - self.prefills)
        self.log = log
        self.token_file = token_file
        self.kv = kv
        self.timeout = startup_timeout(args, n)
        self.port = free_port()
        self.discovery_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proxy: Optional[_Proc] = None
        self.fleet: Optional[_Proc] = None
        self.prefill_urls: list[str] = []
        self.decode_urls: list[str] = []

    async def __aenter__(self) -> "_Run":
        try:
            return await self._start()
        except BaseException:
            await self.__aexit__()  # a failed start leaves no process behind
            raise

    async def _start(self) -> "_Run":
        a = self.args
        extra = a.sizes[-1] + 16
        profile = ([] if not a.profile else
                   ["cProfile", "-o", os.path.join(a.profile, f"proxy-N{self.n}{'-kv' if self.kv else ''}.prof"), "-m"])
        self.proxy = await _start("proxy", [
            *profile, "atom_kv.proxy", "--host", "127.0.0.1", "--port", str(self.port), "--discovery-port",
            str(self.discovery_port), "--registration-token-file", self.token_file, "--log-level", "WARNING",
            "--policy", "kv_aware" if self.kv else "round_robin", "--probe-interval", str(a.probe_interval),
            "--engine-load-interval", str(a.probe_interval), "--max-instances", str(max(256, extra)),
            "--discovery-max-connections", str(max(512, 2 * extra + 64))], self.log)
        fleet_args = ["atom_kv.bench.fleet_engines", "--prefills", str(self.prefills), "--decodes", str(self.decodes),
                      "--discovery", f"tcp://127.0.0.1:{self.discovery_port}", "--token-file", self.token_file,
                      "--ping-interval", str(a.ping_interval)]
        if self.kv:
            fleet_args += ["--kv-events", "--kv-rate", str(a.kv_rate), "--kv-blocks", str(a.kv_blocks),
                           "--kv-held", str(a.kv_held)]
        self.fleet = await _start("fleet", fleet_args, self.log, pipes=True)
        line = await self._line(self.timeout)
        if not line.startswith("ready "):
            raise RuntimeError(f"the fake fleet did not start: {line!r}")
        urls = dict(part.split("=", 1) for part in line.split()[1:])
        self.prefill_urls, self.decode_urls = urls["prefill"].split(","), urls["decode"].split(",")
        await self._registered(self.timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for proc in (self.fleet, self.proxy):
            if proc is not None:
                await proc.stop()

    async def _line(self, timeout: float) -> str:
        assert self.fleet is not None and self.fleet.proc.stdout is not None
        raw = await asyncio.wait_for(self.fleet.proc.stdout.readline(), timeout)
        return raw.decode().strip()

    async def command(self, text: str) -> None:
        assert self.fleet is not None and self.fleet.proc.stdin is not None
        self.fleet.proc.stdin.write(text.encode() + b"\n")
        await self.fleet.proc.stdin.drain()

    async def _registered(self, timeout: float) -> None:
        """Wait (polling /health every 0.2 s, bounded by ``timeout``) until every engine is usable."""
        deadline = time.monotonic() + timeout
        last: Any = None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            while time.monotonic() < deadline:
                assert self.proxy is not None
                if self.proxy.proc.returncode is not None:
                    raise RuntimeError(f"the proxy exited with status {self.proxy.proc.returncode}")
                try:
                    async with s.get(self.url + "/health") as r:
                        last = await r.json(content_type=None)
                    if last.get("prefill") == self.prefills and last.get("decode") == self.decodes:
                        return
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    pass
                await asyncio.sleep(0.2)
        raise TimeoutError(f"{self.n} engines did not all register within {timeout:g} s (last /health: {last})")

    async def metric(self, name: str) -> Optional[float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as s:
            async with s.get(self.url + "/metrics") as r:
                text = await r.text()
        found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
        return sum(float(v) for v in found) if found else None

    async def idle_cpu(self, seconds: float) -> float:
        """The proxy's CPU over ``seconds`` of no requests, as a share of one core."""
        assert self.proxy is not None
        cpu0, t0 = _cpu(self.proxy.pid), time.monotonic()
        await asyncio.sleep(seconds)
        return (_cpu(self.proxy.pid) - cpu0) / (time.monotonic() - t0)


# ---------------------------------------------------------------------- load
class _Load:
    """Streamed completions through the proxy, or both legs run directly against the engines (round robin)."""

    def __init__(self, session: aiohttp.ClientSession, run: _Run, tokens: int) -> None:
        self.session = session
        self.run = run
        self.body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": tokens, "stream": True}
        self._next = 0

    async def via_proxy(self) -> bool:
        async with self.session.post(self.run.url + "/v1/completions", json=self.body) as resp:
            data = await resp.read()
        return resp.status == 200 and data.endswith(b"data: [DONE]\n\n")

    async def direct(self) -> bool:
        i, self._next = self._next, self._next + 1
        prefill = self.run.prefill_urls[i % len(self.run.prefill_urls)]
        decode = self.run.decode_urls[i % len(self.run.decode_urls)]
        pre = dict(self.body, stream=False, max_tokens=1,
                   kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
        async with self.session.post(prefill + "/v1/completions", json=pre) as resp:
            answer = await resp.json()
        kv = dict(answer["kv_transfer_params"], do_remote_prefill=True, do_remote_decode=False)
        async with self.session.post(decode + "/v1/completions", json=dict(self.body, kv_transfer_params=kv)) as resp:
            data = await resp.read()
        return resp.status == 200 and data.endswith(b"data: [DONE]\n\n")


async def _batch(fn: Any, concurrency: int, requests: int) -> tuple[list[float], int]:
    """``requests`` calls of ``fn`` at ``concurrency``; their latencies and the failures."""
    left = requests
    lat: list[float] = []
    errors = 0

    async def worker() -> None:
        nonlocal left, errors
        while left > 0:
            left -= 1
            t = time.perf_counter()
            try:
                ok = await fn()
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
                ok = False
            lat.append(time.perf_counter() - t)
            errors += not ok

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat, errors


async def _until(fn: Any, concurrency: int, stop: asyncio.Event) -> int:
    """Calls of ``fn`` at ``concurrency`` until ``stop`` is set; the failures."""
    errors = 0

    async def worker() -> None:
        nonlocal errors
        while not stop.is_set():
            try:
                errors += not await fn()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                errors += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return errors


async def _new_engines(run: _Run, load: _Load, args: argparse.Namespace) -> dict[str, Any]:
    """One prefill and one decode engine added while requests run: first ping to first request, each."""
    stop = asyncio.Event()
    traffic = asyncio.create_task(_until(load.via_proxy, args.concurrency, stop))
    found: dict[str, float] = {}
    limit = 4 * (args.ping_interval + args.probe_interval) + 5.0
    try:
        await run.command("add P")
        await run.command("add D")
        deadline = time.monotonic() + limit
        while len(found) < 2:
            line = await run._line(max(0.1, deadline - time.monotonic()))
            parts = line.split()
            if parts[:1] == ["first-request"]:
                found[parts[1]] = float(parts[4]) - float(parts[3])
            elif parts[:1] == ["error"]:
                raise RuntimeError(f"the fleet refused a command: {line}")
    except asyncio.TimeoutError:
        raise RuntimeError(f"a new engine got no request within {limit:g} s of its first ping "
                           f"(got: {found})") from None
    finally:
        stop.set()
        errors = await traffic
    return {"prefill_s": round(found["P"], 3), "decode_s": round(found["D"], 3),
            "max_s": round(max(found.values()), 3), "errors": errors}


async def _plain(args: argparse.Namespace, n: int, log: Any, token_file: str) -> dict[str, Any]:
    async with _Run(args, n, log, token_file, kv=False) as run:
        assert run.proxy is not None
        await asyncio.sleep(min(args.ping_interval, args.idle_seconds))  # the registration burst passes
        idle = await run.idle_cpu(args.idle_seconds)
        rss_idle = rss_bytes(run.proxy.pid)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
            load = _Load(session, run, args.tokens)
            warm = max(args.concurrency, min(args.requests // 10, 2 * n))  # every engine's connection opened
            await _batch(load.via_proxy, args.concurrency, warm)
            await _batch(load.direct, args.concurrency, warm)
            direct_lat, direct_err = await _batch(load.direct, args.concurrency, args.requests)
            cpu0, t0 = _cpu(run.proxy.pid), time.monotonic()
            proxy_lat, proxy_err = await _batch(load.via_proxy, args.concurrency, args.requests)
            cpu = _cpu(run.proxy.pid) - cpu0
            background = idle * (time.monotonic() - t0)  # pings and probes went on meanwhile
            rss_load = rss_bytes(run.proxy.pid)
            new = await _new_engines(run, load, args)
        refused = await run.metric("atom_kv_proxy_rejected_registrations_total")
    return {
        "n": n, "prefills": run.prefills, "decodes": run.decodes,
        "idle_cpu_core_share": round(idle, 5),
        "cpu_ms_per_request": round(max(0.0, cpu - background) / args.requests * 1000, 4),
        "gross_cpu_ms_per_request": round(cpu / args.requests * 1000, 4),
        "direct_p50_ms": round(_pct(direct_lat, 0.5) * 1000, 3), "direct_p99_ms": round(_pct(direct_lat, 0.99) * 1000, 3),
        "proxy_p50_ms": round(_pct(proxy_lat, 0.5) * 1000, 3), "proxy_p99_ms": round(_pct(proxy_lat, 0.99) * 1000, 3),
        "added_p50_ms": round((_pct(proxy_lat, 0.5) - _pct(direct_lat, 0.5)) * 1000, 3),
        "added_p99_ms": round((_pct(proxy_lat, 0.99) - _pct(direct_lat, 0.99)) * 1000, 3),
        "rss_idle_bytes": rss_idle, "rss_bytes": rss_load,
        "new_engine": new, "errors": direct_err + proxy_err + new["errors"],
        "refused_registrations": int(refused or 0),
    }


async def _kv(args: argparse.Namespace, n: int, log: Any, token_file: str, plain: dict[str, Any]) -> dict[str, Any]:
    async with _Run(args, n, log, token_file, kv=True) as run:
        assert run.proxy is not None
        want = 0.9 * n * args.kv_held
        deadline = time.monotonic() + args.kv_held / (args.kv_rate * args.kv_blocks) + run.timeout
        entries = 0.0
        while time.monotonic() < deadline:  # polled every 0.5 s, bounded: the index fills at the events' rate
            entries = await run.metric("atom_kv_proxy_kv_index_entries") or 0.0
            if entries >= want:
                break
            await asyncio.sleep(0.5)
        else:
            raise RuntimeError(f"the KV index held {entries:g} entries, not the {want:g} expected, after the "
                               "events' fill time")
        busy = await run.idle_cpu(args.idle_seconds)
        rss = rss_bytes(run.proxy.pid)
        entries = await run.metric("atom_kv_proxy_kv_index_entries") or 0.0
        bad = await run.metric("atom_kv_proxy_kv_event_decode_failures_total")
    blocks_per_s = n * args.kv_rate * args.kv_blocks
    ingest = max(0.0, busy - plain["idle_cpu_core_share"])
    return {"entries": int(entries), "rss_bytes": rss, "index_bytes": rss - plain["rss_idle_bytes"],
            "index_bytes_per_entry": round((rss - plain["rss_idle_bytes"]) / entries, 1) if entries else None,
            "cpu_core_share": round(busy, 5), "ingest_cpu_core_share": round(ingest, 5),
            "blocks_per_s": blocks_per_s,
            "ingest_us_per_block": round(ingest / blocks_per_s * 1e6, 2) if blocks_per_s else None,
            "decode_failures": int(bad or 0)}


# ---------------------------------------------------------------------- figures and targets
def _derive(rows: list[dict[str, Any]]) -> None:
    """Each measured row's RSS per engine: its growth over the smallest measured N's, per engine added."""
    done = measured(rows)
    if not done:
        return
    base = done[0]
    for row in done:
        extra = row["n"] - base["n"]
        row["rss_per_engine_bytes"] = round((row["rss_bytes"] - base["rss_bytes"]) / extra) if extra else None


def fleet_targets(doc: dict[str, Any]) -> list[bench_targets.Target]:
    rows = measured(doc["sizes"])
    if not rows:
        return [bench_targets.Target("fleet", "every figure (no size was measured: see each row's error)", None)]
    first, last = rows[0], rows[-1]
    out = []
    if len(rows) > 1:
        ratio = last["cpu_ms_per_request"] / first["cpu_ms_per_request"]
        out.append(bench_targets.Target("fleet", f"proxy CPU per request at N={last['n']} "
                                        f"({last['cpu_ms_per_request']:.3f} ms) <= {CPU_RATIO_TARGET}x N={first['n']}'s "
                                        f"({first['cpu_ms_per_request']:.3f} ms): {ratio:.2f}x", ratio <= CPU_RATIO_TARGET))
        per = last["rss_per_engine_bytes"]
        out.append(bench_targets.Target("fleet", f"proxy RSS per engine, N={first['n']} to {last['n']}, no KV index "
                                        f"({per / 1024:.1f} KB) <= {RSS_PER_ENGINE_TARGET // 1024} KB",
                                        per <= RSS_PER_ENGINE_TARGET))
    else:
        out.append(bench_targets.Target("fleet", "proxy CPU per request and RSS per engine (two sizes needed)", None))
    defaults = doc["ping_interval_s"] == DEFAULT_PING_INTERVAL and doc["probe_interval_s"] == DEFAULT_PROBE_INTERVAL
    share = last["idle_cpu_core_share"]
    text = (f"pings and probes at N={last['n']} (ping every {doc['ping_interval_s']:g} s, probes and load readings "
            f"every {doc['probe_interval_s']:g} s): {share:.2%} of one core <= {IDLE_CPU_TARGET:.0%}")
    out.append(bench_targets.Target("fleet", text if defaults and last["n"] >= IDLE_TARGET_N else
                                    text + f" (the target is at N >= {IDLE_TARGET_N} and the default intervals)",
                                    share <= IDLE_CPU_TARGET if defaults and last["n"] >= IDLE_TARGET_N else None))
    bound = doc["ping_interval_s"] + doc["probe_interval_s"]
    worst = max(rows, key=lambda r: r["new_engine"]["max_s"])
    out.append(bench_targets.Target("fleet", f"new engine's first ping to its first request, worst at "
                                    f"N={worst['n']} ({worst['new_engine']['max_s']:.2f} s) <= one ping and one "
                                    f"probe interval ({bound:g} s)", worst["new_engine"]["max_s"] <= bound))
    return out


def _table(doc: dict[str, Any]) -> str:
    head = (f"{'N':>5} {'CPU ms/req':>10} {'added p50':>9} {'added p99':>9} {'RSS MiB':>8} {'KB/engine':>9} "
            f"{'idle core':>9} {'new s':>6} {'kv entries':>10} {'kv MiB':>7} {'ingest core':>11} {'us/block':>8}")
    lines = [head]
    for r in doc["sizes"]:
        if "error" in r:
            lines.append(f"{r['n']:>5} failed: {r['error']}")
            continue
        kv = kv_row(r) or {}
        per = "-" if r["rss_per_engine_bytes"] is None else f"{r['rss_per_engine_bytes'] / 1024:.1f}"
        entries = str(kv.get("entries", "-"))
        index = f"{kv['index_bytes'] / 2**20:.1f}" if kv else "-"
        ingest = f"{kv['ingest_cpu_core_share']:.2%}" if kv else "-"
        per_block = str(kv.get("ingest_us_per_block") if kv else "-")
        if r.get("kv") and not kv:
            per_block = f"KV run failed: {r['kv']['error']}"
        lines.append(f"{r['n']:>5} {r['cpu_ms_per_request']:>10.3f} {r['added_p50_ms']:>9.2f} {r['added_p99_ms']:>9.2f} "
                     f"{r['rss_bytes'] / 2**20:>8.1f} {per:>9} {r['idle_cpu_core_share']:>9.2%} "
                     f"{r['new_engine']['max_s']:>6.2f} {entries:>10} {index:>7} {ingest:>11} {per_block:>8}")
    return "\n".join(lines)


async def _measure(args: argparse.Namespace, log: Any, token_file: str,
                   done: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """One row per size, each handed to ``done`` (with the rows before it) as soon as it is complete: a size
    that fails is one line on stderr and a row with its ``error``, and the next size still runs."""
    rows: list[dict[str, Any]] = []
    for n in args.sizes:
        print(f"fleet: N={n} ...", file=sys.stderr, flush=True)
        try:
            row = await _plain(args, n, log, token_file)
        except Exception as exc:
            row = {"n": n, "error": f"the run without KV events: {exc!r}"}
            print(f"fleet: N={n} failed: {row['error']}", file=sys.stderr, flush=True)
        if args.kv_events and "error" not in row:
            try:
                row["kv"] = await _kv(args, n, log, token_file, row)
            except Exception as exc:
                row["kv"] = {"error": f"the KV event run: {exc!r}"}
                print(f"fleet: N={n} failed: {row['kv']['error']}", file=sys.stderr, flush=True)
        rows.append(row)
        done(rows)
    return rows


def run(args: argparse.Namespace) -> int:
    if args.png:
        from atom_kv.bench import fleet_chart

        why = fleet_chart.missing()
        if why:
            print(f"error: {why}", file=sys.stderr)
            return 1
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="atom-kv-fleet-") as tmp, tempfile.TemporaryFile(mode="w+") as log:
        token_file = os.path.join(tmp, "token")
        with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(os.urandom(32).hex() + "\n")
        to_stdout = args.json == "-"

        def document(rows: list[dict[str, Any]]) -> dict[str, Any]:
            _derive(rows)
            doc = {"concurrency": args.concurrency, "requests": args.requests, "tokens": args.tokens,
                   "ping_interval_s": args.ping_interval, "probe_interval_s": args.probe_interval,
                   "idle_seconds": args.idle_seconds,
                   "kv": {"rate": args.kv_rate, "blocks": args.kv_blocks, "held": args.kv_held}
                   if args.kv_events else None, "sizes": rows}
            doc["targets"] = [{"text": t.text, "met": t.met} for t in fleet_targets(doc)]
            return doc

        def done(rows: list[dict[str, Any]]) -> None:  # each size's row on disk as soon as it is measured
            if args.json and not to_stdout:
                with open(args.json + ".tmp", "w") as f:
                    json.dump(document(rows), f, indent=2)
                os.replace(args.json + ".tmp", args.json)

        try:
            rows = asyncio.run(_measure(args, log, token_file, done))
        except Exception as exc:
            log.seek(0)
            print(f"fleet bench failed: {exc}\n{log.read()[-4000:]}", file=sys.stderr)
            return 1
        failed = [r for r in rows if "error" in r or "error" in (r.get("kv") or {})]
        if failed:
            log.seek(0)
            print(f"fleet: {len(failed)} size(s) failed; the proxy's and the fleet's last log lines:\n"
                  f"{log.read()[-4000:]}", file=sys.stderr)
    doc = document(rows)
    targets = fleet_targets(doc)
    if to_stdout:
        print(json.dumps(doc, indent=2))
    else:
        print(f"fleet: {args.requests} requests at concurrency {args.concurrency} per size, {args.tokens} tokens "
              f"streamed; pings every {args.ping_interval:g} s, probes every {args.probe_interval:g} s")
        print(_table(doc))
    if args.png:
        from atom_kv.bench import fleet_chart

        for path in fleet_chart.draw(doc, args.png):
            print(f"wrote {path}", file=sys.stderr if to_stdout else sys.stdout)
    missed = bench_targets.report(targets, explore=args.explore, json_output=to_stdout)
    if failed:
        return 1
    errors = sum(r["errors"] + r["refused_registrations"] for r in measured(rows))
    if errors:
        print(f"fleet: {errors} failed requests or refused registrations", file=sys.stderr)
        return 2
    return missed
