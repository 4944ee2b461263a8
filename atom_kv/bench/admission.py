"""``python -m atom_kv.bench admission``: the proxy's admission control under a burst, in front of fake engines.

Processes: fake prefill and decode engines (``atom_kv.testing.fake_engine``, one of each, each request
streaming ``--tokens`` tokens ``--token-delay`` apart) and the proxy (``python -m atom_kv.proxy``) with
``--max-concurrent-per-engine C``: the pair serves C requests at once, its capacity.

- **burst**: ``--over`` x C requests sent back to back (one every ``--gap`` seconds, so their order of
  arrival is known) to a proxy with ``--queue-size Q``. Targets: the first C + Q are served, and in the
  order they arrived (their first bytes come in that order); every one after them gets 429 with a
  ``Retry-After``, and none before them does.
- **timeout**: the same burst against a queue as long as the burst and a short ``--queue-timeout``:
  the requests that cannot be served in time get 503. Target: the p99 wait (a served request's time to
  its first byte less the unloaded one; a refused request's time to its 503) is at most
  ``--queue-timeout`` plus ``TRANSPORT_SLACK_S`` (the HTTP round trips of a loaded machine).

``python -m atom_kv.bench proxy --admission`` measures what admission control costs: the proxy's CPU
per request with it on (caps, queue and rate limit set far above the load, so all the bookkeeping runs
and nothing is refused) against it off, in alternated slices of one run
(:func:`atom_kv.bench.proxy.admission_cpu_on_vs_off`). Target: at most 1.1x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from typing import Any

import aiohttp

from atom_kv.bench import targets as bench_targets
from atom_kv.bench.proxy import Target, _fake_engines, _pct, _start_ours, _stop, _wait_healthy

TRANSPORT_SLACK_S = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    bench_targets.add_arguments(parser)
    parser.add_argument("--cap", type=int, default=4, help="--max-concurrent-per-engine of the proxy (default 4)")
    parser.add_argument("--over", type=int, default=4, help="the burst, in multiples of --cap (default 4)")
    parser.add_argument("--queue-size", type=int, default=None,
                        help="burst run: the queue (default: half the burst, so the last quarter gets 429)")
    parser.add_argument("--queue-timeout", type=float, default=0.3,
                        help="timeout run: seconds a request may wait (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens streamed per request (default %(default)s)")
    parser.add_argument("--token-delay", type=float, default=0.01,
                        help="seconds between two streamed tokens (default %(default)s)")
    parser.add_argument("--gap", type=float, default=0.003,
                        help="seconds between two requests of the burst (default %(default)s)")
    parser.add_argument("--startup-timeout", type=float, default=20.0)


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], index: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body, headers={"X-Request-Id": f"burst-{index}"}) as r:
        first = None
        async for _ in r.content.iter_any():
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        return {"index": index, "status": r.status, "retry_after": r.headers.get("Retry-After"),
                "sent": t0, "first": first if first is not None else end, "end": end}


async def _burst(url: str, n: int, gap: float, tokens: int) -> list[dict[str, Any]]:
    body = {"model": "fake-model", "prompt": "admission bench", "max_tokens": tokens, "stream": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        await _one(session, url, body, -1)  # warm-up: connections, the engines' first answer
        unloaded = (await _one(session, url, body, -1))
        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(_one(session, url, body, i)))
            await asyncio.sleep(gap)
        rows = await asyncio.gather(*tasks)
    base = unloaded["first"] - unloaded["sent"]
    for row in rows:
        ttfb = row["first"] - row["sent"]
        row["wait_s"] = max(0.0, ttfb - base) if row["status"] == 200 else row["end"] - row["sent"]
    return rows


def _start_proxy(log: Any, prefills: list[str], decodes: list[str], *flags: str) -> Target:
    return _start_ours(log, prefills, decodes, "round_robin", "round_robin", extra=flags)


async def _run(args: argparse.Namespace, log: Any, prefills: list[str], decodes: list[str]) -> dict[str, Any]:
    cap, n = args.cap, args.cap * args.over
    queue = args.queue_size if args.queue_size is not None else n // 2
    out: dict[str, Any] = {"cap": cap, "burst": n, "tokens": args.tokens, "token_delay_s": args.token_delay}

    proxy = _start_proxy(log, prefills, decodes, "--max-concurrent-per-engine", str(cap), "--queue-size", str(queue),
                         "--queue-timeout", "60")
    try:
        await _wait_healthy(proxy.url, args.startup_timeout, proxy.proc)
        rows = await _burst(proxy.url, n, args.gap, args.tokens)
    finally:
        _stop(proxy.proc)
    served = [r for r in rows if r["status"] == 200]
    refused = [r["index"] for r in rows if r["status"] == 429]
    by_first = [r["index"] for r in sorted(served, key=lambda r: r["first"])]
    out["burst_run"] = {
        "queue_size": queue, "served": len(served), "refused_429": len(refused),
        "other": sorted({r["status"] for r in rows} - {200, 429}),
        "retry_after": sorted({r["retry_after"] for r in rows if r["status"] == 429}),
        "first_byte_order": by_first,
    }
    expected_refused = list(range(cap + queue, n))

    proxy = _start_proxy(log, prefills, decodes, "--max-concurrent-per-engine", str(cap), "--queue-size", str(n),
                         "--queue-timeout", str(args.queue_timeout))
    try:
        await _wait_healthy(proxy.url, args.startup_timeout, proxy.proc)
        rows_t = await _burst(proxy.url, n, args.gap, args.tokens)
    finally:
        _stop(proxy.proc)
    waits = [r["wait_s"] for r in rows_t if r["status"] in (200, 503)]
    p99 = _pct(waits, 0.99)
    out["timeout_run"] = {
        "queue_timeout_s": args.queue_timeout, "served": sum(r["status"] == 200 for r in rows_t),
        "refused_503": sum(r["status"] == 503 for r in rows_t),
        "other": sorted({r["status"] for r in rows_t} - {200, 503}),
        "p50_wait_ms": round(_pct(waits, 0.5) * 1000, 1), "p99_wait_ms": round(p99 * 1000, 1),
    }
    out["targets"] = {
        "burst_queued_and_served_in_order": len(served) == cap + queue and by_first == list(range(cap + queue)),
        "429_only_past_the_queue": refused == expected_refused and not out["burst_run"]["other"]
        and all(r["retry_after"] for r in rows if r["status"] == 429),
        "p99_wait_le_queue_timeout": p99 <= args.queue_timeout + TRANSPORT_SLACK_S and not out["timeout_run"]["other"],
    }
    return out


def run(args: argparse.Namespace) -> int:
    if args.cap < 1 or args.over < 1:
        print("admission bench: --cap and --over must be >= 1", file=sys.stderr)
        return 2
    log = tempfile.TemporaryFile(mode="w+")
    engines = None
    try:
        engines, prefills, decodes = _fake_engines(log, "--prefill-delay", "0.002", "--tokens", str(args.tokens),
                                                   "--token-delay", str(args.token_delay))
        result = asyncio.run(_run(args, log, prefills, decodes))
    except Exception as exc:
        log.seek(0)
        print(f"admission bench failed: {exc}\n{log.read()[-4000:]}", file=sys.stderr)
        return 1
    finally:
        _stop(engines)
        log.close()
    if args.json:
        print(json.dumps(result))
    else:
        b, t = result["burst_run"], result["timeout_run"]
        print(f"capacity {result['cap']} concurrent requests (--max-concurrent-per-engine {result['cap']}, one "
              f"prefill and one decode engine); burst of {result['burst']} requests")
        print(f"burst run (--queue-size {b['queue_size']}): {b['served']} served, {b['refused_429']} answered 429 "
              f"(Retry-After {','.join(b['retry_after']) or '-'}), other statuses {b['other'] or 'none'}; "
              f"first bytes in the order {b['first_byte_order']}")
        print(f"timeout run (--queue-timeout {t['queue_timeout_s']}s): {t['served']} served, {t['refused_503']} "
              f"answered 503; wait p50 {t['p50_wait_ms']} ms, p99 {t['p99_wait_ms']} ms")
    return bench_targets.report([bench_targets.Target("admission", _TARGET_TEXT[k], v)
                                 for k, v in result["targets"].items()], explore=args.explore, json_output=args.json)


_TARGET_TEXT = {"burst_queued_and_served_in_order": "a burst over capacity is queued and served in arrival order",
                "429_only_past_the_queue": "429 with Retry-After only past the queue",
                "p99_wait_le_queue_timeout": "p99 queue wait <= --queue-timeout"}
