"""``python -m atom_kv.reference --host H [--advertise-host A] --port P [--tp N] [--kv-transfer-config JSON] ...``

Starts the reference engine: a colocated engine without a config, a prefill
(``kv_producer``) or decode (``kv_consumer``) engine with one. With
``proxy_ip`` in the config, it registers with the proxy. ``--port 0`` lets
the OS pick the HTTP port; ``--port-file F`` writes the bound port to F once
requests can be served. ``--host`` is what the HTTP server and the KV
listeners bind; ``--advertise-host`` (default ``--host``) is what the engine
tells others: the registration ping's address and ``remote_host`` for KV
reads. An unspecified address (``0.0.0.0``, ``::``) is never advertised:
``--host 0.0.0.0`` without ``--advertise-host`` is refused in one line.

``--log-format json`` writes one JSON object a log line, in the TP rank
processes too (:mod:`atom_kv.logfmt`).

SIGINT/SIGTERM: the first shuts down in order, a second hurries it (exit
status still 0), a third exits at once (:mod:`atom_kv.reference.shutdown`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any, Callable, Optional

from atom_kv._cli import OneLineParser
from atom_kv._netaddr import is_unspecified
from atom_kv.config import ConfigError, is_port, parse_kv_transfer_config
from atom_kv.gc_heap import freeze_startup_heap
from atom_kv.logfmt import ENGINE, add_log_format_argument, configure_logging
from atom_kv.reference.faults import FLAG as FAULT_FLAG
from atom_kv.reference.faults import FaultInjector
from atom_kv.reference.kv_events.config import check_kv_events_listeners, parse_kv_events_config
from atom_kv.reference.shutdown import SIGNALS, ShutdownSignals

log = logging.getLogger("atom_kv.reference")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m atom_kv.reference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1",
                   help="address the HTTP server and the KV listeners bind (0.0.0.0: every interface)")
    p.add_argument("--advertise-host", default=None,
                   help="address other hosts reach this engine at, sent to the proxy and in KV transfer params "
                        "(default: the config's `advertise_host`, else --host; required when --host is 0.0.0.0 "
                        "or ::)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port; 0 lets the OS pick one (see --port-file)")
    p.add_argument("--port-file", default=None,
                   help="write the bound HTTP port to this file (atomically) once requests can be served")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (must divide the 2 KV heads)")
    p.add_argument("--data-parallel-size", "--dp", dest="dp", type=int, default=1,
                   help="data-parallel ranks behind this address, each with its own scheduler, KV cache and "
                        "TP ranks; a request names its rank with the `data_parallel_rank` body field or the "
                        "X-data-parallel-rank header, else the least-loaded rank takes it")
    p.add_argument("--kv-transfer-config", default=None, help="JSON; see docs/configuration.md")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV cache blocks per DP rank")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    p.add_argument("--max-model-len", type=int, default=10240, help="prompt + generated tokens per request")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="prefill tokens per step (soft)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--model-id", default="atom-kv-tiny", help="served model name (also checked in KV handshakes)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model and its KV cache live; cuda also means a ROCm build of torch "
                        "(TP ranks take GPU tp_rank mod the GPUs visible)")
    p.add_argument("--default-max-tokens", type=int, default=16)
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds for TP ranks to start")
    p.add_argument("--step-timeout", type=float, default=300.0,
                   help="seconds a TP rank may take for one step before the engine gives up on it")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds in-flight HTTP requests get to finish on shutdown")
    p.add_argument("--drain-timeout", type=float, default=2.0,
                   help="seconds a decode engine waits on shutdown, after the HTTP requests, for its TP ranks to "
                        "stop the KV loads of requests that ended")
    p.add_argument("--hurry-timeout", type=float, default=1.0,
                   help="after a second SIGINT/SIGTERM: in-flight requests end at once and every remaining "
                        "shutdown wait (the drain, the engine loop, the TP workers) gets at most this many seconds")
    p.add_argument("--instance-index", default=None,
                   help="index to register with the proxy (default: the bound HTTP port)")
    p.add_argument("--kv-checksums", default=None, metavar="DIR",
                   help="CHECKING AID: each TP rank appends per-block checksums of the KV it lends (prefill) or "
                        "loaded (decode) to DIR/<engine id>-dp<d>-tp<r>.jsonl (python -m atom_kv.bench e2e "
                        "--kv-checksums compares them across unequal TP)")
    p.add_argument("--log-level", default="INFO")
    add_log_format_argument(p)  # --log-format text|json; the TP rank processes log the same way
    # the prefix cache and its KV events (docs/kv-events.md)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of prompt prefixes already computed or loaded (default: on)")
    p.add_argument("--kv-events-config", default=None,
                   help="JSON with vLLM's KVEventsConfig keys, e.g. '{\"enable_kv_cache_events\": true, "
                        "\"endpoint\": \"tcp://127.0.0.1:5557\"}'; see docs/kv-events.md")
    p.add_argument(FAULT_FLAG, dest="inject_request_fault", action="append", default=[], metavar="STAGE=MARKER",
                   help="TESTING ONLY: fail every request whose prompt contains MARKER at STAGE (admit, sample, "
                        "decode or finish), to show one request's failure stays its own; repeatable")
    return p


def _write_port_file(path: str, port: int) -> None:
    """Write ``port`` so a reader never sees a partial file (write a temporary file, then rename)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)


async def _serve(args: argparse.Namespace, engine, router, make_pinger: Callable[[int], Any],
                 signals: ShutdownSignals) -> int:
    from aiohttp import web

    from atom_kv.reference.server import OpenAIServer

    server = OpenAIServer(engine, router, default_max_tokens=args.default_max_tokens)
    stop = asyncio.Event()
    exit_code = 0
    loop = asyncio.get_running_loop()
    signals.bind(on_stop=stop.set, on_hurry=engine.hurry)
    for sig in SIGNALS:
        loop.add_signal_handler(sig, signals.received, sig)

    def on_fatal(message: str) -> None:
        nonlocal exit_code
        exit_code = 1
        loop.call_soon_threadsafe(stop.set)

    engine.on_fatal = on_fatal
    if engine.fatal:
        return 1
    from atom_kv.reference.http_log import HttpServerLog

    runner = web.AppRunner(server.app, access_log=None, handle_signals=False,
                           shutdown_timeout=args.shutdown_timeout,
                           logger=HttpServerLog(logging.getLogger("aiohttp.server")))
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    pinger = None
    try:
        await site.start()
        port = runner.addresses[0][1]  # the bound port (the OS picks it for --port 0)
        log.info("serving %s on http://%s:%d (%s), advertised as %s", args.model_id, args.host, port, engine.role,
                 engine.args.host)
        pinger = make_pinger(port)
        if pinger is not None:  # register only once requests can be served
            pinger.start()
        if args.port_file:
            _write_port_file(args.port_file, port)
        await stop.wait()
        if pinger is not None:  # the proxies first: they stop routing here before the server stops accepting
            pinger.leaving()
            await loop.run_in_executor(None, pinger.left.wait, pinger.answer_timeout_s)
    finally:
        if pinger is not None:
            pinger.close()
        await runner.cleanup()
    return exit_code


def _plan_error(kv_config: Any, args: argparse.Namespace) -> Optional[str]:
    """Why the port plan of this engine cannot work (blocks colliding or past 65535, the
    HTTP port inside it), or None."""
    from atom_kv.ports import planned_ports

    try:
        plan = planned_ports(kv_config, dp_size=args.dp, tp_size=args.tp)
    except (ConfigError, ValueError) as exc:
        return str(exc)
    clash = next((p for p in plan if args.port and p.covers(args.port)), None)
    if clash is not None:
        return f"--port {args.port} is also the {clash.describe()}; pick another HTTP port or move `{clash.key}`"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # before the config: reading it may warn (an inline auth_token)
    configure_logging(args.log_level.upper(), args.log_format)
    try:
        kv_config = parse_kv_transfer_config(args.kv_transfer_config)
        kv_events = parse_kv_events_config(args.kv_events_config)
        if kv_events is not None:
            check_kv_events_listeners(kv_events, kv_config, dp_size=args.dp, http_port=args.port)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for flag in ("startup_timeout", "step_timeout", "shutdown_timeout", "drain_timeout", "hurry_timeout"):
        if not getattr(args, flag) > 0:
            print(f"error: --{flag.replace('_', '-')} must be > 0", file=sys.stderr)
            return 2
    if not is_port(args.port):
        print(f"error: --port must be in 0..65535 (0: the OS picks one), got {args.port}", file=sys.stderr)
        return 2
    for flag in ("tp", "dp", "num_blocks", "block_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
                 "num_layers", "threads"):
        if getattr(args, flag) < 1:
            name = "data-parallel-size" if flag == "dp" else flag.replace("_", "-")
            print(f"error: --{name} must be >= 1", file=sys.stderr)
            return 2
    if args.device == "cuda":
        from atom_kv.transfer.memory import gpu_unavailable_reason

        if (why := gpu_unavailable_reason()) is not None:
            print(f"error: --device cuda: {why}; use --device cpu", file=sys.stderr)
            return 2
    if 2 % args.tp:
        print(f"error: --tp {args.tp} must divide the model's 2 KV heads (use 1 or 2)", file=sys.stderr)
        return 2
    configured = kv_config.advertise_host if kv_config is not None else None
    if args.advertise_host and configured and args.advertise_host != configured:
        print(f"error: --advertise-host {args.advertise_host} and the config's `advertise_host` {configured} "
              f"disagree; give one of them", file=sys.stderr)
        return 2
    advertise = args.advertise_host or configured or args.host
    if is_unspecified(advertise):
        flag = "--advertise-host" if args.advertise_host else "--host"
        print(f"error: {flag} {advertise} is an unspecified address, which peers cannot dial and is never "
              f"advertised; set --advertise-host to this host's reachable address (--host {args.host} may stay, "
              f"to bind every interface)", file=sys.stderr)
        return 2
    if kv_config is not None and (why := _plan_error(kv_config, args)) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        faults = FaultInjector.parse(args.inject_request_fault)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from atom_kv.reference.dp import DataParallelEngine
    from atom_kv.reference.engine import EngineArgs
    from atom_kv.reference.server import OutputRouter

    router = OutputRouter()
    engine = DataParallelEngine(
        EngineArgs(model_id=args.model_id, seed=args.seed, num_layers=args.num_layers, tp=args.tp,
                   num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                   max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                   host=advertise, bind_host=args.host, threads=args.threads, device=args.device, startup_timeout_s=args.startup_timeout,
                   step_timeout_s=args.step_timeout, drain_timeout_s=args.drain_timeout,
                   hurry_timeout_s=args.hurry_timeout, faults=faults,
                   enable_prefix_caching=args.enable_prefix_caching, kv_events=kv_events,
                   kv_checksum_dir=os.path.abspath(args.kv_checksums) if args.kv_checksums else None),
        kv_config, router.deliver, dp_size=args.dp,
    )
    ENGINE.set(engine.engine_id)  # this thread's log lines (and the HTTP server's) name the engine
    if faults:
        log.warning("%s is set (%s): requests whose prompt contains its marker fail on purpose", FAULT_FLAG,
                    ", ".join(args.inject_request_fault))

    def make_pinger(http_port: int) -> Any:
        if kv_config is None or not kv_config.proxy_addresses:
            return None
        from atom_kv import engine_hooks

        events, replay = engine.cores[0].kv_events_endpoints  # DP rank 0's (None until started)
        return engine_hooks.build_registration_pinger(
            kv_config, role="P" if kv_config.is_producer else "D",
            index=args.instance_index or str(http_port), http_host=advertise, http_port=http_port,
            tp_size=args.tp, dp_size=args.dp, engine_id=engine.engine_id, model=args.model_id,
            kv_events_endpoint=events, kv_events_replay_endpoint=replay,
        )

    try:
        make_pinger(args.port)  # a bad proxy address fails now, before the ranks start
    except ValueError as exc:
        print(f"error: kv-transfer-config: `proxy_ip`: {exc}", file=sys.stderr)
        return 2
    signals = ShutdownSignals(shutdown_timeout_s=args.shutdown_timeout, hurry_timeout_s=args.hurry_timeout)
    try:
        engine.start()
        freeze_startup_heap()  # full collections skip the start-up heap from here on
        return asyncio.run(_serve(args, engine, router, make_pinger, signals))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # startup failures (ports in use, worker crash) in one line
        log.error("engine failed: %s", exc)
        return 1
    finally:
        # asyncio gave both signals their default action back: a signal during close() hurries it
        signals.bind(on_stop=lambda: None, on_hurry=lambda: engine.hurry(end_requests=False))
        signals.install()
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
