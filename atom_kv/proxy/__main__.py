"""``python -m atom_kv.proxy`` / ``atom-kv-proxy``: the P/D proxy command line.

Engines register by pinging the ZeroMQ discovery port (ATOM's or vLLM
MoRIIO's format); clients use the HTTP port like any OpenAI-compatible server
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``), and operators
use ``/health``, ``/instances`` and ``/metrics``. Served by hypercorn; SIGINT
or SIGTERM shuts it down gracefully (in-flight requests get
``--shutdown-timeout`` seconds).

Timeouts: ``--connect-timeout`` bounds every upstream connect,
``--prefill-timeout`` the whole prefill leg, ``--decode-timeout`` the longest
silence from the decode engine (before its headers or between two chunks), so
long generations are not cut off.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import sys

import zmq

from atom_kv.proxy.app import STATE_KEY, create_app
from atom_kv.proxy.server import hypercorn_config, serve_until_signalled
from atom_kv.proxy.settings import POLICIES, ProxySettings

logger = logging.getLogger("atom_kv.proxy")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"port out of range: {value}")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = ProxySettings()
    p = argparse.ArgumentParser(prog="atom-kv-proxy", description="Prefill/decode proxy for ATOM-compatible engines.")
    p.add_argument("--host", default=d.host, help="HTTP listen address (default %(default)s)")
    p.add_argument("--port", type=_port, default=d.port, help="HTTP port (default %(default)s)")
    p.add_argument("--discovery-host", default=d.discovery_host, help="ZeroMQ listen address (default %(default)s)")
    p.add_argument("--discovery-port", type=_port, default=d.discovery_port, help="ZeroMQ ROUTER port (default %(default)s)")
    p.add_argument("--heartbeat-timeout", type=_positive, default=d.heartbeat_timeout,
                   help="evict an instance not heard from for this many seconds (default %(default)s)")
    p.add_argument("--policy", choices=POLICIES, default=d.policy, help="routing policy (default %(default)s)")
    p.add_argument("--registration-token", default=None, help="refuse pings without this auth_token")
    p.add_argument("--prefix-chars", type=_nonneg_int, default=d.prefix_chars,
                   help="prompt characters hashed by prefix_hash (default %(default)s)")
    p.add_argument("--max-retries", type=_nonneg_int, default=d.max_retries,
                   help="re-planned pairs after an upstream failure (default %(default)s)")
    p.add_argument("--retry-backoff", type=float, default=d.retry_backoff_s,
                   help="first retry backoff in seconds, doubled each retry (default %(default)s)")
    p.add_argument("--connect-timeout", type=_positive, default=d.connect_timeout, help="upstream connect timeout (s)")
    p.add_argument("--prefill-timeout", type=_positive, default=d.prefill_timeout, help="whole prefill leg timeout (s)")
    p.add_argument("--decode-timeout", type=_positive, default=d.decode_timeout,
                   help="longest wait for the next byte from decode (s)")
    p.add_argument("--circuit-failures", type=int, default=d.circuit_failures,
                   help="consecutive failures that open an instance's circuit (default %(default)s)")
    p.add_argument("--circuit-cooldown", type=_positive, default=d.circuit_cooldown_s,
                   help="seconds before an open circuit lets a trial request through (default %(default)s)")
    p.add_argument("--max-upstream-connections", type=_nonneg_int, default=d.max_upstream_connections,
                   help="pooled upstream connections, 0 = unlimited (default %(default)s)")
    p.add_argument("--shutdown-timeout", type=_positive, default=d.shutdown_timeout,
                   help="graceful shutdown grace period (s)")
    p.add_argument("--backlog", type=int, default=d.backlog, help="listen backlog (default %(default)s)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    return ProxySettings(
        host=args.host, port=args.port, discovery_host=args.discovery_host, discovery_port=args.discovery_port,
        heartbeat_timeout=args.heartbeat_timeout, policy=args.policy, registration_token=args.registration_token,
        prefix_chars=args.prefix_chars, max_retries=args.max_retries, retry_backoff_s=args.retry_backoff,
        connect_timeout=args.connect_timeout, prefill_timeout=args.prefill_timeout,
        decode_timeout=args.decode_timeout, circuit_failures=args.circuit_failures,
        circuit_cooldown_s=args.circuit_cooldown, max_upstream_connections=args.max_upstream_connections,
        shutdown_timeout=args.shutdown_timeout, backlog=args.backlog,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    state = app.extensions[STATE_KEY]
    try:
        for sock in hypercorn_config(settings).create_sockets().insecure_sockets:
            sock.close()
    except OSError as exc:
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        print(f"atom-kv-proxy: cannot listen on {settings.host}:{settings.port}: {reason}", file=sys.stderr)
        return 1
    try:
        state.discovery.start()
    except zmq.ZMQError as exc:
        print(f"atom-kv-proxy: cannot listen for discovery on {settings.discovery_host}:{settings.discovery_port}: {exc}",
              file=sys.stderr)
        return 1
    try:
        asyncio.run(serve_until_signalled(app, settings))
    except OSError as exc:
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        print(f"atom-kv-proxy: cannot listen on {settings.host}:{settings.port}: {reason}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        state.discovery.close()
    logger.info("proxy stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
