"""Every knob of the proxy, in one immutable object built from the CLI or by tests."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from atom_kv._netaddr import is_loopback
from atom_kv.proxy.fleet.dns import DnsTarget
from atom_kv.proxy.fleet.static import StaticEngine
from atom_kv.proxy.http.guard import allowed_host_problem

POLICIES = ("round_robin", "random", "power_of_two", "least_loaded", "prefix_hash", "cache_aware", "kv_aware")


@dataclass(frozen=True)
class ProxySettings:
    """Proxy configuration. Timeouts are seconds; every network wait uses one of them."""

    host: str = "127.0.0.1"  # loopback unless the operator names another address
    port: int = 10001
    discovery: bool = True  # listen for registration pings
    discovery_host: str | None = None  # None: the HTTP host
    discovery_port: int = 36367
    heartbeat_timeout: float = 15.0
    # routing
    policy: str = "round_robin"
    prefill_policy: str | None = None  # None: ``policy``
    decode_policy: str | None = None  # None: ``policy``
    prefix_chars: int = 256  # prefix_hash: prompt characters hashed
    cache_threshold: float = 0.3  # cache_aware: match ratio that wins over "smallest tree"
    balance_abs_threshold: int = 64  # cache_aware: imbalanced if max-min load > this ...
    balance_rel_threshold: float = 1.5  # ... and max load > min load * this
    cache_max_chars: int = 4 * 1024 * 1024  # cache_aware: prompt characters remembered per engine
    # kv_aware and local prefill route on the prompt's token ids: from the body, this Hugging Face
    # tokenizer.json (file or model folder; None: none), else an engine's /tokenize
    tokenizer: str | None = None
    # local prefill (conditional disaggregation): a request whose chosen decode (instance, DP rank) already
    # caches all but at most this many of its prompt tokens goes to the decode engine alone (0: off)
    local_prefill_max_tokens: int = 0
    # registration
    registration_token: str | None = None  # also signs releases: the engines' auth_token (one cluster secret)
    release_prefills: bool = True  # tell a prefill engine when its KV will not be read (atom-kv engines)
    # stream the prefill's first token at once where the decode engine continues from it (kv_features);
    # off: the decode leg gets no first_token_ids (it computes the first token again, as before)
    first_token_forwarding: bool = True
    # send the decode leg together with the prefill leg where both engines announce the rendezvous
    # (kv_features); the decode learns the block ids from the prefill's handshake port. Off: the legs in turn
    concurrent_dispatch: bool = False
    # ... only while the chosen prefill rank has at most this many prompt tokens of this proxy's requests
    # ahead of the new one: past it the prefill queues, overlapping saves nothing worth holding decode blocks for
    concurrent_max_queued_tokens: int = 2048
    registration_window_s: float = 30.0  # signed pings: |now - ts| bound and replay memory
    # unsigned pings (no registration_token), loopback included: any process that reaches the discovery port
    # can then register an engine; without a token or this, every ping is refused (operator's choice)
    allow_open_registration: bool = False
    discovery_max_connections: int = 512  # open connections to the discovery port, all sources together
    discovery_max_connections_per_source: int = 32  # ... from one source address
    admin_token: str | None = None  # bearer token for /instances and /metrics (None: open)
    # the Host header values the HTTP server answers (atom_kv.proxy.http.guard); None: on loopback, the loopback
    # names and ``host`` (any port), beyond loopback no check. Stops DNS rebinding of a proxy on loopback
    allowed_hosts: tuple[str, ...] | None = None
    # client errors carry the engine's address and up to 300 bytes of its error text (debugging); off: they
    # name the failure and the request id, and the rest goes to the log and /instances
    expose_upstream_errors: bool = False
    max_instances: int = 256
    max_tp_size: int = 512
    max_dp_size: int = 512
    static_prefill: tuple[StaticEngine, ...] = ()
    static_decode: tuple[StaticEngine, ...] = ()
    # DNS discovery (--prefill-dns/--decode-dns): names re-resolved every dns_interval_s, each resolution
    # bounded by dns_timeout; dns_server: (IPv4, port) queried over UDP (None: the system resolver)
    prefill_dns: tuple[DnsTarget, ...] = ()
    decode_dns: tuple[DnsTarget, ...] = ()
    dns_interval_s: float = 5.0
    dns_timeout: float = 2.0
    dns_server: tuple[str, int] | None = None
    probe_interval_s: float = 2.0  # health probes of static, new and down engines
    probe_timeout: float = 2.0
    # engine-reported load (atom_kv.proxy.fleet.load): each up engine's /health (or vLLM's /metrics) read
    # every engine_load_interval_s (0: off), each read bounded by engine_load_timeout and engine_load_max_bytes
    engine_load_interval_s: float = 2.0
    engine_load_timeout: float = 2.0
    engine_load_max_bytes: int = 4 << 20
    # KV cache events (atom_kv.proxy.kv_events): bounds of each publisher's sockets (RCVHWM messages of at
    # most max_message_bytes per frame), the replay wait, the index's caps in (block, worker) entries, and
    # how long (and how much of) the proxy's own routing decisions count as cached before their events come
    kv_events_hwm: int = 1000
    kv_events_max_message_bytes: int = 4 << 20
    kv_events_replay_timeout_s: float = 2.0
    kv_index_max_blocks: int = 1 << 21
    kv_index_max_blocks_per_worker: int = 1 << 18
    kv_predict_ttl_s: float = 5.0
    kv_predict_max_blocks: int = 1 << 16
    # relay
    max_retries: int = 2
    retry_backoff_s: float = 0.05
    connect_timeout: float = 5.0
    prefill_timeout: float = 300.0
    decode_timeout: float = 300.0
    models_timeout: float = 10.0
    tokenize_timeout: float = 5.0
    # the breaker counts instance failures, not one request's (atom_kv.proxy.fleet.breaker): it opens after
    # ``circuit_failures`` consecutive ones of different requests, or once the last ``circuit_window_s`` held at
    # least ``circuit_min_requests`` outcomes with ``circuit_failure_ratio`` of them failures
    circuit_failures: int = 3
    circuit_cooldown_s: float = 10.0
    circuit_min_requests: int = 20
    circuit_failure_ratio: float = 0.5
    circuit_window_s: float = 30.0
    discovery_poll_s: float = 0.5
    max_upstream_connections: int = 4096
    max_request_bytes: int = 64 * 1024 * 1024
    # engine answers are bounded like client requests (more: 502 naming the flag)
    max_upstream_head_bytes: int = 64 * 1024  # status line and headers of one answer
    max_upstream_body_bytes: int = 64 * 1024 * 1024  # an answer read whole (prefill, non-streamed decode, probes)
    max_server_timing_bytes: int = 4096  # a longer Server-Timing header is dropped unparsed
    max_first_token_text_bytes: int = 1024  # a prefill's first_token_text (longer: the sequential path)
    max_inflight_body_bytes: int = 1 << 30  # request bodies held at once, all clients together (more: 503)
    # admission control (atom_kv.proxy.admission): a leg goes only to an engine with fewer than this many legs
    # in flight (0: no cap); a request finding no pair under its caps waits, FIFO, in a queue of ``queue_size``
    # (one more: 429) for at most ``queue_timeout`` seconds (then 503)
    max_concurrent_per_engine: int = 0
    queue_size: int = 256
    queue_timeout: float = 30.0
    rate_limit: tuple[float, int] | None = None  # (requests a second, burst) per client: bearer token, else address
    rate_limit_clients: int = 65536  # token buckets kept (least recently used out)
    sse_split_max: int = 4  # SSE events arriving together are written one by one up to this many
    # HTTP server
    header_timeout: float = 10.0  # request head must arrive within this (also the idle keep-alive limit)
    body_timeout: float = 30.0  # request body must arrive within this
    stall_timeout: float = 60.0  # a client that reads nothing this long while an answer waits is dropped
    shutdown_timeout: float = 5.0
    backlog: int = 4096
    # SO_REUSEPORT on the HTTP socket: N proxy processes on one host share ``port`` (each with its own
    # discovery port), so one host's proxy uses N cores; needs a fixed port
    reuse_port: bool = False
    log_summary_interval_s: float = 10.0  # rate-limited warnings: one summary per interval
    # OpenTelemetry: each relayed request becomes one trace, exported over OTLP/HTTP (protobuf) to this
    # URL (vLLM's --otlp-traces-endpoint; e.g. http://collector:4318/v1/traces). None: off, nothing imported
    otlp_traces_endpoint: str | None = None
    otlp_timeout_s: float = 10.0  # one export request (the exporter's own retries included)

    def __post_init__(self) -> None:
        for name in ("policy", "prefill_policy", "decode_policy"):
            value = getattr(self, name)
            if value is not None and value not in POLICIES:
                raise ValueError(f"{name}: must be one of {', '.join(POLICIES)}, got {value!r}")
        positive = (
            "heartbeat_timeout", "connect_timeout", "prefill_timeout", "decode_timeout", "models_timeout",
            "tokenize_timeout", "circuit_cooldown_s", "discovery_poll_s", "shutdown_timeout", "probe_interval_s",
            "probe_timeout", "header_timeout", "body_timeout", "stall_timeout", "registration_window_s",
            "log_summary_interval_s", "balance_rel_threshold", "otlp_timeout_s", "circuit_window_s", "queue_timeout",
            "dns_interval_s", "dns_timeout",
            "kv_events_replay_timeout_s", "kv_predict_ttl_s", "engine_load_timeout",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        for name in ("max_retries", "prefix_chars", "balance_abs_threshold", "sse_split_max",
                     "concurrent_max_queued_tokens", "max_server_timing_bytes", "max_first_token_text_bytes",
                     "max_concurrent_per_engine", "queue_size", "engine_load_interval_s",
                     "local_prefill_max_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")
        for name in ("circuit_failures", "max_inflight_body_bytes", "max_instances", "max_tp_size", "max_dp_size",
                     "cache_max_chars", "discovery_max_connections", "discovery_max_connections_per_source",
                     "circuit_min_requests", "max_upstream_body_bytes", "rate_limit_clients",
                     "kv_events_hwm", "kv_events_max_message_bytes", "kv_index_max_blocks",
                     "kv_index_max_blocks_per_worker", "kv_predict_max_blocks", "engine_load_max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)!r}")
        if self.tokenizer is not None and not self.tokenizer.strip():
            raise ValueError("tokenizer: give the path of a tokenizer.json or of a model folder holding one")
        if self.rate_limit is not None and not (self.rate_limit[0] > 0 and self.rate_limit[1] >= 1):
            raise ValueError(f"rate_limit: needs requests a second > 0 and a burst >= 1, got {self.rate_limit!r}")
        if not 0.0 < self.circuit_failure_ratio <= 1.0:
            raise ValueError(f"circuit_failure_ratio: must be > 0 and <= 1, got {self.circuit_failure_ratio!r}")
        if self.max_upstream_head_bytes < 1024:
            raise ValueError(f"max_upstream_head_bytes: must be >= 1024, got {self.max_upstream_head_bytes!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold: must be between 0 and 1, got {self.cache_threshold!r}")
        if self.retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s: must be >= 0, got {self.retry_backoff_s!r}")
        if self.otlp_traces_endpoint is not None:
            problem = endpoint_problem(self.otlp_traces_endpoint)
            if problem:
                raise ValueError(f"otlp_traces_endpoint: {problem}, got {self.otlp_traces_endpoint!r}")
        for engine in (*self.static_prefill, *self.static_decode):
            if engine.tp_size is not None and engine.tp_size > self.max_tp_size:
                raise ValueError(f"{engine.url}: tp={engine.tp_size} exceeds max_tp_size {self.max_tp_size}")
            if engine.dp_size is not None and engine.dp_size > self.max_dp_size:
                raise ValueError(f"{engine.url}: dp={engine.dp_size} exceeds max_dp_size {self.max_dp_size}")

        if self.allowed_hosts is not None:
            if not self.allowed_hosts:
                raise ValueError("allowed_hosts: give at least one host name (or '*' for any)")
            for entry in self.allowed_hosts:
                problem = allowed_host_problem(entry)
                if problem:
                    raise ValueError(f"allowed_hosts: {entry!r} {problem}")
        if self.reuse_port and self.port == 0:
            raise ValueError("reuse_port: --reuse-port shares one fixed HTTP port between proxy processes; "
                             "name it with --port (0 would give each process a port of its own)")
        if (self.discovery and self.registration_token is None and not self.allow_open_registration
                and not is_loopback(self.discovery_bind_host)):
            raise ValueError(
                f"registration_token: discovery on {self.discovery_bind_host or 'every address'} (not loopback) "
                "would let anyone who reaches it register an engine and receive client requests: set "
                "--registration-token-file (the engines' auth_token), or --allow-open-registration to accept unsigned "
                "pings anyway, or --discovery-host 127.0.0.1")

    @property
    def registration_open(self) -> bool:
        """Whether discovery accepts unsigned pings (no token, and the operator allowed it)."""
        return self.discovery and self.registration_token is None and self.allow_open_registration

    @property
    def discovery_bind_host(self) -> str:
        """Where discovery listens: ``discovery_host``, else the HTTP ``host``."""
        return self.discovery_host if self.discovery_host is not None else self.host

    @property
    def wants_token_ids(self) -> bool:
        """Whether the relay looks up each prompt's token ids (kv_aware on a leg, or local prefill)."""
        return "kv_aware" in (self.policy_for("P"), self.policy_for("D")) or self.local_prefill_max_tokens > 0

    def policy_for(self, role: str) -> str:
        """The policy name of the prefill ("P") or decode ("D") pool."""
        chosen = self.prefill_policy if role == "P" else self.decode_policy
        return chosen if chosen is not None else self.policy


def endpoint_problem(url: str) -> str | None:
    """What is wrong with an OTLP/HTTP endpoint URL (None: nothing)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return ("must be an http:// or https:// URL of an OTLP/HTTP traces endpoint, "
                "e.g. http://collector:4318/v1/traces")
    return None
