"""``python -m atom_kv.bench proxy``: proxy-added latency and throughput in front of fake engines.

Three processes: fake prefill+decode engines (``atom_kv.proxy.testing``), the
proxy (``python -m atom_kv.proxy``), and this load generator. "Direct" means
the load generator itself runs both legs (prefill, then decode) against the
engines, which is exactly the work the proxy does; the difference is what the
proxy adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import aiohttp

from atom_kv.proxy.settings import POLICIES

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--prefill-delay", type=float, default=0.005, help="fake prefill delay in seconds")
    parser.add_argument("--tokens", type=int, default=32, help="tokens streamed by the fake decode")
    parser.add_argument("--latency-requests", type=int, default=300, help="requests for the concurrency-1 runs")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per throughput run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 512], help="throughput concurrencies")
    parser.add_argument("--policy", default="round_robin", choices=POLICIES)
    parser.add_argument("--startup-timeout", type=float, default=20.0)
    parser.add_argument("--baseline", action="store_true",
                        help="also measure a minimal re-implementation of ATOM's original proxy behaviour "
                             "(Quart's built-in server, a new HTTP session per request) side by side")


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
        response.headers["Content-Type"] = "application/json"  # as the original did, even for streams
        response.timeout = None
        return response

    @app.get("/health")
    async def health() -> Any:
        return Response(b"{}", content_type="application/json")

    return app


def _serve_baseline(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="ATOM original-proxy baseline for the proxy bench")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    args = parser.parse_args(argv)
    app = _baseline_app(args.prefill, args.decode)
    asyncio.run(app.run_task(host="127.0.0.1", port=args.port))
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _read_stream(resp: aiohttp.ClientResponse) -> bool:
    data = await resp.read()
    return resp.status == 200 and data.endswith(b"data: [DONE]\n\n") and b'"error"' not in data


class Load:
    """One client request, either through the proxy or by running both legs directly."""

    def __init__(self, session: aiohttp.ClientSession, proxy: str, prefill: str, decode: str, tokens: int) -> None:
        self.session = session
        self.proxy = proxy
        self.prefill = prefill
        self.decode = decode
        self.body = {"model": "fake-model", "prompt": "The quick brown fox " * 8, "max_tokens": tokens, "stream": True}

    async def via_proxy(self) -> bool:
        async with self.session.post(self.proxy + "/v1/completions", json=self.body) as resp:
            return await _read_stream(resp)

    async def direct(self) -> bool:
        pre = dict(self.body, stream=False, max_tokens=1,
                   kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
        async with self.session.post(self.prefill + "/v1/completions", json=pre) as resp:
            answer = await resp.json()
        kv = dict(answer["kv_transfer_params"], do_remote_prefill=True, do_remote_decode=False)
        async with self.session.post(self.decode + "/v1/completions", json=dict(self.body, kv_transfer_params=kv)) as resp:
            return await _read_stream(resp)


async def _latency_pair(direct, via_proxy, n: int) -> tuple[list[float], list[float], int]:
    """Alternate direct and proxied requests at concurrency 1, so both see the same machine load."""
    lat: tuple[list[float], list[float]] = ([], [])
    errors = 0
    for _ in range(min(20, n)):  # warm-up (connections, caches)
        await direct()
        await via_proxy()
    for _ in range(n):
        for fn, out in ((direct, lat[0]), (via_proxy, lat[1])):
            t = time.perf_counter()
            try:
                ok = await fn()
            except aiohttp.ClientError:
                ok = False
            out.append(time.perf_counter() - t)
            errors += not ok
    return lat[0], lat[1], errors


def _cpu_seconds(pid: int | None) -> float | None:
    """User+system CPU seconds used so far by process ``pid`` (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


async def _throughput(fn, concurrency: int, duration: float, server_pid: int | None = None) -> dict[str, Any]:
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
    out = {"concurrency": concurrency, "requests": done, "errors": errors, "req_per_s": round(done / elapsed, 1),
           "p50_ms": round(_pct(lat, 0.5) * 1000, 2), "p99_ms": round(_pct(lat, 0.99) * 1000, 2)}
    if cpu0 is not None and cpu1 is not None and done:
        # CPU the proxy process spent per request: its capacity on a core of its own, whatever the load
        out["proxy_cpu_ms_per_req"] = round((cpu1 - cpu0) / done * 1000, 3)
    return out


async def _wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(f"proxy at {url} did not become healthy within {timeout}s")


async def _measure(args: argparse.Namespace, proxy_url: str, prefill: str, decode: str) -> dict[str, Any]:
    await _wait_healthy(proxy_url, args.startup_timeout)
    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        load = Load(session, proxy_url, prefill, decode, args.tokens)
        direct_lat, proxy_lat, c1_errors = await _latency_pair(load.direct, load.via_proxy, args.latency_requests)
        result: dict[str, Any] = {
            "prefill_delay_ms": args.prefill_delay * 1000,
            "tokens": args.tokens,
            "c1_direct_p50_ms": round(_pct(direct_lat, 0.5) * 1000, 3),
            "c1_direct_p99_ms": round(_pct(direct_lat, 0.99) * 1000, 3),
            "c1_proxy_p50_ms": round(_pct(proxy_lat, 0.5) * 1000, 3),
            "c1_proxy_p99_ms": round(_pct(proxy_lat, 0.99) * 1000, 3),
            "c1_added_p50_ms": round((_pct(proxy_lat, 0.5) - _pct(direct_lat, 0.5)) * 1000, 3),
            "c1_added_p99_ms": round((_pct(proxy_lat, 0.99) - _pct(direct_lat, 0.99)) * 1000, 3),
            "c1_errors": c1_errors,
            "direct_c64": await _throughput(load.direct, 64, args.duration),
            "throughput": [],
        }
        for c in args.concurrency:
            result["throughput"].append(await _throughput(load.via_proxy, c, args.duration, args.proxy_pid))
        if args.baseline_url:
            base = Load(session, args.baseline_url, prefill, decode, args.tokens)
            await _wait_healthy(args.baseline_url, args.startup_timeout)
            direct_lat, base_lat, errs = await _latency_pair(load.direct, base.via_proxy, args.latency_requests)
            result["baseline"] = {
                "c1_p50_ms": round(_pct(base_lat, 0.5) * 1000, 3),
                "c1_added_p50_ms": round((_pct(base_lat, 0.5) - _pct(direct_lat, 0.5)) * 1000, 3),
                "c1_errors": errs,
                "throughput": [await _throughput(base.via_proxy, 64, args.duration, args.baseline_pid)],
            }
    return result


def _start(cmd: list[str], log: Any) -> subprocess.Popen:
    """Start a helper process; its stderr goes to ``log`` (never an unread pipe that could fill up)."""
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(cmd, cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(args: argparse.Namespace) -> int:
    http_port, disc_port = _free_port(), _free_port()
    log = tempfile.TemporaryFile(mode="w+")
    baseline: subprocess.Popen | None = None
    proxy = _start([sys.executable, "-m", "atom_kv.proxy", "--host", "127.0.0.1", "--port", str(http_port),
                    "--discovery-host", "127.0.0.1", "--discovery-port", str(disc_port), "--policy", args.policy,
                    "--log-level", "WARNING"], log)
    engines = _start([sys.executable, "-m", "atom_kv.proxy.testing", "--discovery", f"tcp://127.0.0.1:{disc_port}",
                      "--prefill-delay", str(args.prefill_delay), "--tokens", str(args.tokens)], log)
    try:
        assert engines.stdout is not None
        line = engines.stdout.readline().strip()
        if not line.startswith("ready "):
            log.seek(0)
            print(f"fake engines failed to start: {line}\n{log.read()}", file=sys.stderr)
            return 1
        addrs = dict(part.split("=", 1) for part in line.split()[1:])
        args.baseline_url = None
        args.baseline_pid = None
        args.proxy_pid = proxy.pid
        if args.baseline:
            base_port = _free_port()
            baseline = _start([sys.executable, "-m", "atom_kv.bench.proxy", "--port", str(base_port),
                               "--prefill", addrs["prefill"], "--decode", addrs["decode"]], log)
            args.baseline_url = f"http://127.0.0.1:{base_port}"
            args.baseline_pid = baseline.pid
        result = asyncio.run(_measure(args, f"http://127.0.0.1:{http_port}", addrs["prefill"], addrs["decode"]))
    except Exception as exc:
        log.seek(0)
        print(f"proxy bench failed: {exc}\n{log.read()[-4000:]}", file=sys.stderr)
        return 1
    finally:
        _stop(engines)
        _stop(proxy)
        if baseline is not None:
            _stop(baseline)
        log.close()
    by_c = {t["concurrency"]: t for t in result["throughput"]}
    result["targets"] = {
        "added_p50_le_2ms": result["c1_added_p50_ms"] <= 2.0,
        "c512_zero_errors": by_c[512]["errors"] == 0 if 512 in by_c else None,
        "c64_ge_273_req_per_s": by_c[64]["req_per_s"] >= 273 if 64 in by_c else None,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"prefill delay {result['prefill_delay_ms']:.1f} ms, {result['tokens']} streamed tokens")
        print(f"concurrency 1: direct p50 {result['c1_direct_p50_ms']} ms p99 {result['c1_direct_p99_ms']} ms; "
              f"via proxy p50 {result['c1_proxy_p50_ms']} ms p99 {result['c1_proxy_p99_ms']} ms")
        print(f"proxy-added latency: p50 {result['c1_added_p50_ms']} ms, p99 {result['c1_added_p99_ms']} ms "
              f"(errors {result['c1_errors']})")
        d = result["direct_c64"]
        print(f"direct (both legs, no proxy) c=64: {d['req_per_s']} req/s, p50 {d['p50_ms']} ms, errors {d['errors']}")
        for t in result["throughput"]:
            print(f"via proxy c={t['concurrency']}: {t['req_per_s']} req/s, p50 {t['p50_ms']} ms, "
                  f"p99 {t['p99_ms']} ms, {t['requests']} requests, errors {t['errors']}, "
                  f"proxy CPU {t.get('proxy_cpu_ms_per_req', 'n/a')} ms/request")
        if "baseline" in result:
            b = result["baseline"]
            t = b["throughput"][0]
            print(f"baseline (original ATOM proxy behaviour): c=1 p50 {b['c1_p50_ms']} ms "
                  f"(added {b['c1_added_p50_ms']} ms); c=64 {t['req_per_s']} req/s, p50 {t['p50_ms']} ms, "
                  f"errors {t['errors'] + b['c1_errors']}, proxy CPU {t.get('proxy_cpu_ms_per_req', 'n/a')} ms/request")
        print("targets: " + ", ".join(f"{k}={'n/a' if v is None else ('yes' if v else 'NO')}"
                                      for k, v in result["targets"].items()))
    errors = result["c1_errors"] + sum(t["errors"] for t in result["throughput"])
    return 0 if errors == 0 else 2


if __name__ == "__main__":
    sys.exit(_serve_baseline(sys.argv[1:]))
