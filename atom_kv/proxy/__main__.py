"""``python -m atom_kv.proxy`` / ``atom-kv-proxy``: the P/D proxy command line.

Engines come from registration pings on the ZeroMQ discovery port (ATOM's or
vLLM MoRIIO's format), from ``--prefill URL[,HANDSHAKE_PORT]`` /
``--decode URL`` flags, or both; flagged engines are health-probed.
Clients use the HTTP port like any OpenAI-compatible server
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``), and
operators use ``/health``, ``/readiness``, ``/liveness``, ``/instances`` and
``/metrics``; ``--log-format json`` writes one JSON object a log line
(:mod:`atom_kv.logfmt`). Served by the
proxy's own HTTP/1.1 server (:mod:`atom_kv.proxy.http.httpserver`, on uvloop when
installed); SIGINT or SIGTERM shuts it down gracefully (in-flight requests
get ``--shutdown-timeout`` seconds).

Engines that announce a KV event publisher (a ping's ``kv_events``, a spec's
``events=``) are followed by one background thread (``--kv-*`` flags), so the
proxy knows which prefixes each engine caches.

Clients get their errors in the proxy's words: which engine failed and how,
with the request id; the engine's address and text go to the log and
``/instances`` (``--expose-upstream-errors`` puts them in the client's error).
Completion routes take only ``Content-Type: application/json`` (415), and on
loopback every route answers only the ``Host`` names of ``--allowed-hosts``
(421).

Timeouts: ``--connect-timeout`` bounds every upstream connect,
``--prefill-timeout`` the whole prefill leg, ``--decode-timeout`` the longest
silence from the decode engine (before its headers or between two chunks), so
long generations are not cut off; ``--header-timeout`` and ``--body-timeout``
bound slow clients.

Admission control (off by default): ``--max-concurrent-per-engine`` caps each
engine's legs in flight, ``--queue-size`` / ``--queue-timeout`` bound the FIFO
queue of requests waiting for an engine under it (429 with ``Retry-After``,
503), ``--rate-limit RPS[,BURST]`` caps each client (:mod:`atom_kv.proxy.admission`).

Tokens: ``--registration-token-file`` and ``--admin-token-file`` (or the
variables ``ATOM_KV_REGISTRATION_TOKEN`` / ``ATOM_KV_ADMIN_TOKEN``) keep them
out of the process list (:mod:`atom_kv.proxy.token_flags`).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import sys
from dataclasses import replace
from typing import Any, Callable, Coroutine

from atom_kv._cli import OneLineParser
from atom_kv.config import is_port
from atom_kv.logfmt import add_log_format_argument, configure_logging
from atom_kv.proxy.admission.buckets import parse_rate_limit
from atom_kv.proxy.app import create_app
from atom_kv.proxy.fleet.discovery import DiscoveryError
from atom_kv.proxy.fleet.dns import parse_dns_server, parse_dns_spec
from atom_kv.proxy.fleet.static import Role, parse_engine_spec
from atom_kv.proxy.routing.hf_tokenizer import TokenizerError
from atom_kv.proxy.http.guard import allowed_host_problem
from atom_kv.proxy.server import listen_socket, serve_until_signalled
from atom_kv.proxy.settings import POLICIES, ProxySettings
from atom_kv.proxy.token_flags import add_token_file_arguments, resolve_token_arguments
from atom_kv.token_sources import TokenSourceError

logger = logging.getLogger("atom_kv.proxy")


def _checked(kind: Callable[[str], Any], not_one: str, ok: Callable[[Any], bool], bad: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``kind(text)`` (else "not <not_one>") that ``ok`` accepts (else ``bad``, with the text)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {not_one}: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(bad.format(text))
        return value
    return parse


_positive = _checked(float, "a number", lambda v: v > 0, "must be > 0, got {}")
_fraction = _checked(float, "a number", lambda v: 0.0 <= v <= 1.0, "must be between 0 and 1, got {}")
_port = _checked(int, "a port number", is_port, "port out of range: {}")
_nonneg_int = _checked(int, "an integer", lambda v: v >= 0, "must be >= 0, got {}")
_nonneg_float = _checked(float, "a number", lambda v: 0 <= v <= 1e6, "must be between 0 and 1e6, got {}")


def _pos_int(text: str) -> int:
    value = _nonneg_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _ratio(text: str) -> float:
    value = _positive(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a fraction > 0 and <= 1, got {text}")
    return value


def _rate_limit(text: str) -> tuple[float, int]:
    try:
        return parse_rate_limit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _host_list(text: str) -> tuple[str, ...]:
    """``--allowed-hosts``: a comma list of host names or addresses, each with an optional ``:PORT``."""
    entries = tuple(e.strip() for e in text.split(",") if e.strip())
    if not entries:
        raise argparse.ArgumentTypeError("give at least one host name, e.g. localhost,proxy.example.com ('*': any)")
    for entry in entries:
        problem = allowed_host_problem(entry)
        if problem:
            raise argparse.ArgumentTypeError(f"{entry!r} {problem}")
    return entries


def _engine(role: str):
    def parse(text: str):
        try:
            return parse_engine_spec(role, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = "engine URL"
    return parse


def _dns(role: Role):
    def parse(text: str):
        try:
            return parse_dns_spec(role, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = "DNS name"
    return parse


def _dns_server(text: str) -> tuple[str, int]:
    try:
        return parse_dns_server(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    d = ProxySettings()
    p = OneLineParser(prog="atom-kv-proxy", description="Prefill/decode proxy for ATOM-compatible engines.")
    g = p.add_argument_group("listening")
    g.add_argument("--host", default=d.host,
                   help="HTTP listen address (default %(default)s: loopback only); discovery follows it unless "
                        "--discovery-host says otherwise, and needs --registration-token off loopback")
    g.add_argument("--port", type=_port, default=d.port, help="HTTP port; 0 picks a free one (default %(default)s)")
    g.add_argument("--header-timeout", type=_positive, default=d.header_timeout,
                   help="seconds a client has to send a request head; also the idle keep-alive limit "
                        "(default %(default)s)")
    g.add_argument("--body-timeout", type=_positive, default=d.body_timeout,
                   help="seconds a client has to send a request body, else 408 (default %(default)s)")
    g.add_argument("--stall-timeout", type=_positive, default=d.stall_timeout,
                   help="seconds a client may read nothing while its answer waits (its socket buffer full); then "
                        "the connection is dropped, the decode leg aborted and the prefill released "
                        "(default %(default)s)")
    g.add_argument("--max-request-bytes", type=_pos_int, default=d.max_request_bytes,
                   help="largest request body, else 413 (default %(default)s)")
    g.add_argument("--max-inflight-body-bytes", type=_pos_int, default=d.max_inflight_body_bytes,
                   help="request bodies the proxy holds at once, all clients together; a request past it is "
                        "answered 503 (default %(default)s)")
    g.add_argument("--reuse-port", action="store_true",
                   help="share the HTTP --port with other proxy processes started with this flag (SO_REUSEPORT; "
                        "the kernel spreads connections among them), so one host's proxy uses several cores; "
                        "give each process its own --discovery-port and list every one in the engines' proxy_ip")
    g.add_argument("--backlog", type=int, default=d.backlog, help="listen backlog (default %(default)s)")
    g.add_argument("--admin-token", default=None,
                   help="the management routes (/instances, /metrics) answer only requests with "
                        "'Authorization: Bearer <this token>' (default: open; /health, /readiness and "
                        "/liveness always are); "
                        "--admin-token-file keeps it out of the process list")
    g.add_argument("--allowed-hosts", type=_host_list, default=None, metavar="HOST[:PORT],...",
                   help="the Host header values the proxy answers, every route (a name alone: any port; '*': any "
                        "host); others get 421, so a DNS-rebinding web page cannot use a proxy on loopback "
                        "(default on loopback: localhost, 127.0.0.1, ::1 and --host; beyond loopback: no check "
                        "unless this is given)")
    g.add_argument("--shutdown-timeout", type=_positive, default=d.shutdown_timeout,
                   help="graceful shutdown grace period (s)")

    g = p.add_argument_group("engines")
    g.add_argument("--prefill", dest="static_prefill", action="append", type=_engine("P"), default=[],
                   metavar="URL[,HANDSHAKE_PORT]",
                   help="a prefill engine (repeatable); optional key=value after the port: tp, dp, engine_id, "
                        "notify_port, dp_rank_field (else learnt from the engine's /health; its dp_size wins "
                        "over dp=), events and events_replay (its KV event publisher and replay endpoint of DP "
                        "rank 0, tcp://HOST:PORT)")
    g.add_argument("--decode", dest="static_decode", action="append", type=_engine("D"), default=[], metavar="URL",
                   help="a decode engine (repeatable); optional ,key=value as for --prefill")
    g.add_argument("--prefill-dns", action="append", type=_dns("P"), default=[], metavar="NAME:PORT[,HANDSHAKE_PORT]",
                   help="prefill engines at every A record of NAME (repeatable; e.g. a Kubernetes headless "
                        "service), re-resolved every --dns-interval: new addresses are probed, then routed; gone "
                        "ones are drained, then removed")
    g.add_argument("--decode-dns", action="append", type=_dns("D"), default=[], metavar="NAME:PORT",
                   help="decode engines at every A record of NAME, as for --prefill-dns")
    g.add_argument("--dns-interval", dest="dns_interval_s", type=_positive, default=d.dns_interval_s,
                   help="seconds between resolutions of the --prefill-dns/--decode-dns names (default %(default)s)")
    g.add_argument("--dns-timeout", type=_positive, default=d.dns_timeout,
                   help="timeout of one resolution (default %(default)s); a failed one keeps the last answer")
    g.add_argument("--dns-server", type=_dns_server, default=None, metavar="IPV4:PORT",
                   help="ask this DNS server over UDP instead of the system resolver")
    g.add_argument("--probe-interval", dest="probe_interval_s", type=_positive, default=d.probe_interval_s,
                   help="seconds between /health probes of flagged, new and down engines (default %(default)s)")
    g.add_argument("--probe-timeout", type=_positive, default=d.probe_timeout,
                   help="timeout of one /health probe (default %(default)s)")
    g.add_argument("--engine-load-interval", dest="engine_load_interval_s", type=_nonneg_float,
                   default=d.engine_load_interval_s,
                   help="seconds between readings of each up engine's own load: its /health (the reference "
                        "engine, ATOM), else vLLM's /metrics; 0: off (default %(default)s)")
    g.add_argument("--engine-load-timeout", type=_positive, default=d.engine_load_timeout,
                   help="timeout of one engine load reading (default %(default)s)")
    g.add_argument("--engine-load-max-bytes", type=_pos_int, default=d.engine_load_max_bytes,
                   help="largest /health or /metrics answer read for an engine's load (default %(default)s)")
    g.add_argument("--no-discovery", dest="discovery", action="store_false",
                   help="do not listen for registration pings (flagged engines only)")
    g.add_argument("--discovery-host", default=None,
                   help="ZeroMQ listen address for registration pings (default: --host)")
    g.add_argument("--discovery-port", type=_port, default=d.discovery_port,
                   help="ZeroMQ ROUTER port (default %(default)s)")
    g.add_argument("--heartbeat-timeout", type=_positive, default=d.heartbeat_timeout,
                   help="evict an instance not heard from (ping or probe) for this many seconds (default %(default)s)")
    g.add_argument("--registration-token", default=None,
                   help="accept only pings signed with this shared token, and sign releases with it: the engines' "
                        "auth_token (one cluster secret); --registration-token-file keeps it out of the process "
                        "list")
    g.add_argument("--allow-open-registration", action="store_true",
                   help="accept unsigned pings (without --registration-token), loopback included: anyone who can "
                        "reach the discovery port can then register an engine and receive client requests; without "
                        "a token or this flag every registration is refused")
    g.add_argument("--discovery-max-connections", type=_pos_int, default=d.discovery_max_connections,
                   help="open connections to the discovery port, all sources together; a quarter is kept for "
                        "sources that registered an engine before (default %(default)s)")
    g.add_argument("--discovery-max-connections-per-source", type=_pos_int,
                   default=d.discovery_max_connections_per_source,
                   help="open connections to the discovery port from one address (default %(default)s)")
    g.add_argument("--no-release", dest="release_prefills", action="store_false",
                   help="do not send releases to prefill engines for abandoned prefills (for engines that do not "
                        "speak atom-kv's handshake port; their blocks then wait for their lease)")
    g.add_argument("--no-first-token-forwarding", dest="first_token_forwarding", action="store_false",
                   help="never stream the prefill's first token before the decode leg answers, and do not pass it "
                        "to the decode engine (which then computes it again); by default it is streamed at once "
                        "to clients of decode engines announcing the first_token feature")
    g.add_argument("--concurrent-dispatch", dest="concurrent_dispatch", action="store_true", default=False,
                   help="send the decode leg at the same moment as the prefill leg for pairs whose engines both "
                        "announce the rendezvous feature (/health kv_features): the decode engine admits the "
                        "request while the prefill computes and learns the KV blocks from the prefill engine; "
                        "other pairs keep the legs in turn (off by default)")
    g.add_argument("--no-concurrent-dispatch", dest="concurrent_dispatch", action="store_false", default=False,
                   help="the legs in turn for every pair (the default)")
    g.add_argument("--concurrent-max-queued-tokens", type=_nonneg_int, default=d.concurrent_max_queued_tokens,
                   help="concurrent dispatch: send the legs at once only while the chosen prefill rank has at most "
                        "this many prompt tokens of this proxy's requests ahead of the new one; past it the legs "
                        "go in turn, so decode blocks are not held while the prefill queues (default %(default)s)")
    g.add_argument("--registration-window", dest="registration_window_s", type=_positive,
                   default=d.registration_window_s,
                   help="seconds a signed ping's timestamp may differ from now; nonces are remembered this long "
                        "(default %(default)s)")
    g.add_argument("--max-instances", type=_pos_int, default=d.max_instances,
                   help="most discovered instances at once (default %(default)s)")
    g.add_argument("--max-tp-size", type=_pos_int, default=d.max_tp_size,
                   help="refuse pings announcing a larger tp_size (default %(default)s)")
    g.add_argument("--max-dp-size", type=_pos_int, default=d.max_dp_size,
                   help="refuse pings (and static engines' /health) announcing a larger dp_size "
                        "(default %(default)s)")

    g = p.add_argument_group("routing")
    g.add_argument("--policy", choices=POLICIES, default=d.policy,
                   help="routing policy of both pools (default %(default)s); kv_aware: the (instance, DP rank) "
                        "caching most of the prompt by the engines' KV events, traded against its load "
                        "(docs/routing.md)")
    g.add_argument("--prefill-policy", choices=POLICIES, default=None, help="prefill pool policy (default: --policy)")
    g.add_argument("--decode-policy", choices=POLICIES, default=None, help="decode pool policy (default: --policy)")
    g.add_argument("--prefix-chars", type=_nonneg_int, default=d.prefix_chars,
                   help="prompt characters hashed by prefix_hash (default %(default)s)")
    g.add_argument("--cache-threshold", type=_fraction, default=d.cache_threshold,
                   help="cache_aware: share of the prompt an engine must already hold to win (default %(default)s)")
    g.add_argument("--balance-abs-threshold", type=_nonneg_int, default=d.balance_abs_threshold,
                   help="cache_aware: route to the least loaded when max-min in-flight requests exceed this "
                        "... (default %(default)s)")
    g.add_argument("--balance-rel-threshold", type=_positive, default=d.balance_rel_threshold,
                   help="... and max > min x this (default %(default)s)")
    g.add_argument("--cache-max-chars", type=_pos_int, default=d.cache_max_chars,
                   help="cache_aware: prompt characters remembered per engine, LRU beyond (default %(default)s)")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="kv_aware and local prefill: tokenize prompts here with this Hugging Face tokenizer.json "
                        "(a file, or a model folder holding one; its chat template is applied to chat messages; "
                        "needs the tokenizers package) instead of asking an engine's /tokenize (default: ask)")
    g.add_argument("--local-prefill-max-tokens", type=_nonneg_int, default=d.local_prefill_max_tokens, metavar="N",
                   help="skip the prefill leg when the chosen decode instance already caches all but at most N "
                        "of the prompt's tokens (by its KV events): the decode engine computes the rest itself "
                        "(counted in atom_kv_proxy_local_prefills_total; default 0: off)")

    g = p.add_argument_group("admission control (off by default)")
    g.add_argument("--max-concurrent-per-engine", type=_nonneg_int, default=d.max_concurrent_per_engine,
                   metavar="N", help="send an engine (prefill or decode) at most N legs at once; a request that "
                                     "finds no pair under this waits in the admission queue (default 0: no cap)")
    g.add_argument("--queue-size", type=_nonneg_int, default=d.queue_size,
                   help="requests that may wait for an engine under --max-concurrent-per-engine, first come first "
                        "served; one more is answered 429 with Retry-After (default %(default)s)")
    g.add_argument("--queue-timeout", type=_positive, default=d.queue_timeout,
                   help="seconds a request may wait in the admission queue, then 503; also the Retry-After of a "
                        "429 for a full queue, rounded up (default %(default)s)")
    g.add_argument("--rate-limit", type=_rate_limit, default=None, metavar="RPS[,BURST]",
                   help="per client (its bearer token, else its address): at most RPS completion requests a second "
                        "on average and BURST at once (default BURST: RPS rounded up); past it 429 with Retry-After "
                        "(default: off)")
    g.add_argument("--rate-limit-clients", type=_pos_int, default=d.rate_limit_clients,
                   help="--rate-limit: clients whose buckets are kept, least recently seen out (default %(default)s)")

    g = p.add_argument_group("KV cache events (engines that announce a publisher, or events= in --prefill/--decode)")
    g.add_argument("--kv-events-hwm", type=_pos_int, default=d.kv_events_hwm,
                   help="messages queued per publisher socket before ZeroMQ drops (a gap, then a replay) "
                        "(default %(default)s)")
    g.add_argument("--kv-events-max-message-bytes", type=_pos_int, default=d.kv_events_max_message_bytes,
                   help="largest frame a publisher may send; past it the proxy drops the connection (it "
                        "reconnects); with --kv-events-hwm, what one publisher can make the proxy queue "
                        "(default %(default)s)")
    g.add_argument("--kv-events-replay-timeout", dest="kv_events_replay_timeout_s", type=_positive,
                   default=d.kv_events_replay_timeout_s,
                   help="seconds a replay of missed batches may take; then the engine's entries are cleared "
                        "(default %(default)s)")
    g.add_argument("--kv-index-max-blocks", type=_pos_int, default=d.kv_index_max_blocks,
                   help="(block, instance) entries the index holds, all engines together, oldest evicted past "
                        "it; about 130 bytes each (python -m atom_kv.bench kv-index) (default %(default)s)")
    g.add_argument("--kv-index-max-blocks-per-worker", type=_pos_int, default=d.kv_index_max_blocks_per_worker,
                   help="entries of one (instance, DP rank); set it above the blocks the engine caches "
                        "(default %(default)s)")
    g.add_argument("--kv-predict-ttl", dest="kv_predict_ttl_s", type=_positive, default=d.kv_predict_ttl_s,
                   help="seconds a routing decision counts as cached there before its events arrive "
                        "(default %(default)s)")
    g.add_argument("--kv-predict-max-blocks", type=_pos_int, default=d.kv_predict_max_blocks,
                   help="(block, instance) predictions held at once, oldest dropped past it (default %(default)s)")

    g = p.add_argument_group("upstream requests")
    g.add_argument("--expose-upstream-errors", action="store_true",
                   help="for debugging: client error messages carry the engine's address and up to 300 bytes of "
                        "its error text (default: they name the failing engine role and the request id; the "
                        "address and text go to the log and to /instances' last_error)")
    g.add_argument("--max-retries", type=_nonneg_int, default=d.max_retries,
                   help="re-planned pairs after an upstream failure (default %(default)s)")
    g.add_argument("--retry-backoff", dest="retry_backoff_s", type=float, default=d.retry_backoff_s,
                   help="first retry backoff in seconds, doubled each retry (default %(default)s)")
    g.add_argument("--connect-timeout", type=_positive, default=d.connect_timeout, help="upstream connect timeout (s)")
    g.add_argument("--prefill-timeout", type=_positive, default=d.prefill_timeout, help="whole prefill leg timeout (s)")
    g.add_argument("--decode-timeout", type=_positive, default=d.decode_timeout,
                   help="longest wait for the next byte from decode (s)")
    g.add_argument("--tokenize-timeout", type=_positive, default=d.tokenize_timeout,
                   help="timeout of an engine's /tokenize: a long prompt's length check, and the prompt's token "
                        "ids for kv_aware and local prefill without --tokenizer (s)")
    g.add_argument("--circuit-failures", type=_pos_int, default=d.circuit_failures,
                   help="consecutive instance failures (of different requests) that open an instance's circuit; "
                        "a 500 counts only once another instance served the same request (default %(default)s)")
    g.add_argument("--circuit-cooldown", dest="circuit_cooldown_s", type=_positive, default=d.circuit_cooldown_s,
                   help="seconds before an open circuit lets a trial request through (default %(default)s)")
    g.add_argument("--circuit-min-requests", type=_pos_int, default=d.circuit_min_requests,
                   help="outcomes an instance needs within --circuit-window before its failure ratio can open "
                        "its circuit (default %(default)s)")
    g.add_argument("--circuit-failure-ratio", type=_ratio, default=d.circuit_failure_ratio,
                   help="share of failed outcomes within --circuit-window that opens a circuit (default %(default)s)")
    g.add_argument("--circuit-window", dest="circuit_window_s", type=_positive, default=d.circuit_window_s,
                   help="seconds of outcomes the failure ratio looks at (default %(default)s)")
    g.add_argument("--max-upstream-head-bytes", type=_pos_int, default=d.max_upstream_head_bytes,
                   help="largest status line plus headers of an engine's answer, else 502 (default %(default)s)")
    g.add_argument("--max-upstream-body-bytes", type=_pos_int, default=d.max_upstream_body_bytes,
                   help="largest engine answer the proxy reads whole (prefill, non-streamed decode, probes), "
                        "else 502 (default %(default)s)")
    g.add_argument("--max-server-timing-bytes", type=_nonneg_int, default=d.max_server_timing_bytes,
                   help="an engine's Server-Timing header longer than this is dropped unparsed (default %(default)s)")
    g.add_argument("--max-first-token-text-bytes", type=_nonneg_int, default=d.max_first_token_text_bytes,
                   help="a prefill's first_token_text longer than this is not forwarded: the request takes the "
                        "sequential path (default %(default)s)")
    g.add_argument("--sse-split-max", type=_nonneg_int, default=d.sse_split_max,
                   help="SSE events that arrive together are forwarded one write each up to this many; a larger "
                        "backlog goes out in one write (default %(default)s)")
    g.add_argument("--max-upstream-connections", type=_nonneg_int, default=d.max_upstream_connections,
                   help="pooled upstream connections, 0 = unlimited (default %(default)s)")
    g = p.add_argument_group("tracing (OpenTelemetry; needs pip install 'atom-kv[otel]')")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export one trace per relayed request (a root span and the time-to-first-token spans of "
                        "/metrics, with real start and end times) over OTLP/HTTP (protobuf) to this URL, e.g. "
                        "http://collector:4318/v1/traces; a client's traceparent is honoured and both legs carry "
                        "one to the engines (default: off, nothing imported)")
    g.add_argument("--otlp-timeout", dest="otlp_timeout_s", type=_positive, default=d.otlp_timeout_s,
                   help="seconds one export to --otlp-traces-endpoint may take, retries included "
                        "(default %(default)s)")
    add_token_file_arguments(p)  # --registration-token-file, --admin-token-file
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                   help="event loop: uvloop when installed (auto), or asyncio's own (default %(default)s)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_log_format_argument(p)
    return p


#: the parser's options that are not proxy settings (every other one is a ProxySettings field of its name)
_NOT_SETTINGS = frozenset({"loop", "log_level", "log_format"})


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    """The settings the parsed flags give: each flag's ``dest`` is the :class:`ProxySettings` field it sets
    (the token file flags give the tokens: :func:`resolve_token_arguments`, which may raise
    :class:`TokenSourceError`)."""
    args = argparse.Namespace(**vars(args))
    resolve_token_arguments(args)
    values = {name: value for name, value in vars(args).items() if name not in _NOT_SETTINGS}
    values["static_prefill"] = tuple(values["static_prefill"])
    values["static_decode"] = tuple(values["static_decode"])
    values["prefill_dns"] = tuple(values["prefill_dns"])
    values["decode_dns"] = tuple(values["decode_dns"])
    return ProxySettings(**values)


def tracing_problem(settings: ProxySettings) -> str | None:
    """Why ``--otlp-traces-endpoint`` cannot work here (None: it can, or it is not set). Imports the
    OpenTelemetry SDK only when the flag is set."""
    if settings.otlp_traces_endpoint is None:
        return None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf").strip()
    if protocol != "http/protobuf":
        return (f"--otlp-traces-endpoint: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is {protocol!r}; the proxy exports "
                "OTLP over HTTP only (http/protobuf)")
    try:
        import atom_kv.proxy.observability.otel  # noqa: F401
    except ImportError as exc:
        if not (exc.name or "").startswith("opentelemetry"):
            raise
        return (f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP/HTTP exporter ({exc.name} is "
                "not installed): pip install 'atom-kv[otel]'")
    return None


def _loop_runner(loop: str) -> Callable[[Coroutine[Any, Any, None]], None]:
    """``asyncio.run`` or ``uvloop.run`` (``auto``: uvloop when it is installed)."""
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise ValueError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
        else:
            return uvloop.run
    return asyncio.run


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        settings = settings_from_args(args)
    except TokenSourceError as exc:
        print(f"atom-kv-proxy: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        parser.error(str(exc))
    if not settings.discovery and not ((settings.static_prefill or settings.prefill_dns)
                                       and (settings.static_decode or settings.decode_dns)):
        logger.warning("no discovery and no static prefill/decode pair: requests get 503 until engines are added "
                       "with POST /workers (or /add_worker)")
    problem = tracing_problem(settings)
    if problem is not None:
        print(f"atom-kv-proxy: {problem}", file=sys.stderr)
        return 2
    try:
        run = _loop_runner(args.loop)
    except ValueError as exc:
        print(f"atom-kv-proxy: {exc}", file=sys.stderr)
        return 1
    try:
        sock = listen_socket(settings.host, settings.port, settings.backlog, reuse_port=settings.reuse_port)
    except OSError as exc:
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        print(f"atom-kv-proxy: cannot listen on {settings.host}:{settings.port}: {reason}", file=sys.stderr)
        return 1
    settings = replace(settings, port=sock.getsockname()[1])
    try:
        app = create_app(settings)
    except TokenizerError as exc:
        sock.close()
        print(f"atom-kv-proxy: {exc}", file=sys.stderr)
        return 2
    try:
        run(serve_until_signalled(app, settings, sock))
    except DiscoveryError as exc:
        # the proxy's own start-up failed (e.g. the discovery port is taken): one line, no traceback
        print(f"atom-kv-proxy: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    logger.info("proxy stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
