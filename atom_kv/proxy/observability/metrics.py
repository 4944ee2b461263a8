"""Prometheus metrics of one proxy, in its own CollectorRegistry (never the global one)."""

from __future__ import annotations

import time
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

_SPAN_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                 30)

CLIENT_CLOSED = 499  # nginx's status for "the client went away first"


class ProxyMetrics:
    """Counters, gauges and histograms the proxy exports on ``/metrics``."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "atom_kv_proxy_requests", "HTTP requests by endpoint and status (499: client went away)",
            ["endpoint", "status"], registry=r,
        )
        self.duration = Histogram(
            "atom_kv_proxy_request_duration_seconds", "End-to-end request duration through the proxy",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.prefill_duration = Histogram(
            "atom_kv_proxy_prefill_duration_seconds", "Prefill leg duration", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ttfb = Histogram(
            "atom_kv_proxy_time_to_first_byte_seconds", "Time from request arrival to the first response byte",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.spans = Histogram(
            "atom_kv_proxy_span_seconds", "Time to first token, span by span (see atom_kv.proxy.observability.spans)",
            ["span"], buckets=_SPAN_BUCKETS, registry=r,
        )
        self.instances = Gauge("atom_kv_proxy_instances", "Usable instances by role", ["role"], registry=r)
        self.evictions = Counter(
            "atom_kv_proxy_evictions", "Instances evicted for missing heartbeats (or failed probes)", ["role"],
            registry=r,
        )
        self.marked_down = Counter(
            "atom_kv_proxy_marked_down", "Instances taken out of routing after a connection-level failure",
            ["role"], registry=r,
        )
        self.first_tokens_forwarded = Counter(
            "atom_kv_proxy_first_tokens_forwarded", "Streamed requests whose first token went to the client "
            "from the prefill's answer, before the decode leg answered", registry=r,
        )
        self.concurrent_dispatches = Counter(
            "atom_kv_proxy_concurrent_dispatches", "Requests whose decode leg went out with the prefill leg "
            "(the decode engine learnt the KV blocks from the prefill engine)", registry=r,
        )
        self.concurrent_skipped = Counter(
            "atom_kv_proxy_concurrent_skipped", "Requests of pairs that take concurrent dispatch whose legs went "
            "in turn because the prefill rank had more than --concurrent-max-queued-tokens queued", registry=r,
        )
        self.retries = Counter("atom_kv_proxy_retries", "Re-planned P/D pairs after an upstream failure", registry=r)
        self.abandoned_prefills = Counter(
            "atom_kv_proxy_abandoned_prefills", "Prefills whose KV no decode leg will read, by reason",
            ["reason"], registry=r,
        )
        self.releases = Counter(
            "atom_kv_proxy_releases", "Release messages to prefill ranks: sent (queued) or dropped (not queued), "
            "and abandoned prefills whose producer address was unknown (no_address)", ["outcome"], registry=r,
        )
        self.rejected_registrations = Counter(
            "atom_kv_proxy_rejected_registrations", "Registrations refused", ["reason"], registry=r
        )
        self.bad_discovery_messages = Counter(
            "atom_kv_proxy_bad_discovery_messages", "Discovery messages that failed to decode", registry=r
        )
        self.upstream_failures = Counter(
            "atom_kv_proxy_upstream_failures", "Upstream leg failures", ["role", "kind"], registry=r
        )
        self.circuit_opened = Counter(
            "atom_kv_proxy_circuit_opened", "Times an instance's circuit breaker opened", ["role"], registry=r
        )
        self.suspect_verdicts = Counter(
            "atom_kv_proxy_suspect_failures_judged",
            "Suspect upstream failures (500s, oversized answers) by whose fault they were judged: the instance's, "
            "the request's, or unresolved", ["role", "verdict"], registry=r,
        )
        self.circuit_fallbacks = Counter(
            "atom_kv_proxy_all_circuits_open_routed",
            "Legs sent to the least recently failed instance because every circuit of the role was open",
            ["role"], registry=r,
        )
        self.first_tokens_dropped = Counter(
            "atom_kv_proxy_first_tokens_dropped",
            "Prefill answers whose first_token_ids or first_token_text were out of bounds (the sequential path "
            "was taken)", registry=r,
        )
        self.local_prefills = Counter(
            "atom_kv_proxy_local_prefills", "Requests sent to the decode engine alone, without a prefill leg, "
            "because it already held all but at most --local-prefill-max-tokens of the prompt", registry=r,
        )
        self.route_token_ids = Counter(
            "atom_kv_proxy_route_token_ids", "Requests whose prompt token ids the proxy looked up for routing, by "
            "where they came from: body (a token-id prompt), tokenizer (--tokenizer), engine (its /tokenize), "
            "none (no source answered: kv_aware routed as cache_aware)", ["source"], registry=r,
        )
        self.bad_tokenize_answers = Counter(
            "atom_kv_proxy_bad_tokenize_answers", "Engine /tokenize answers that were not vLLM's JSON shape "
            "(ignored: the next engine is asked)", registry=r,
        )
        self.dp_routed = Counter(
            "atom_kv_proxy_dp_rank_requests", "Legs routed to each (instance, DP rank), by role",
            ["role", "instance", "dp_rank"], registry=r,
        )
        self.dp_outstanding_tokens = Gauge(
            "atom_kv_proxy_dp_rank_outstanding_tokens",
            "Estimated prompt tokens of the legs in flight on each (instance, DP rank)",
            ["role", "instance", "dp_rank"], registry=r,
        )
        self.dp_outstanding_requests = Gauge(
            "atom_kv_proxy_dp_rank_outstanding_requests", "Legs in flight on each (instance, DP rank)",
            ["role", "instance", "dp_rank"], registry=r,
        )
        # what the engines say they run (atom_kv.proxy.fleet.load), per (instance, DP rank) with a reading
        self.engine_reported_requests = Gauge(
            "atom_kv_proxy_engine_reported_requests", "Requests each (instance, DP rank) reports running or "
            "waiting, whoever sent them (its /health, or vLLM's /metrics), as last read",
            ["role", "instance", "dp_rank"], registry=r,
        )
        self.engine_reported_prompt_tokens = Gauge(
            "atom_kv_proxy_engine_reported_prompt_tokens", "Prompt tokens of the requests each (instance, DP "
            "rank) reports (0 where the engine does not say), as last read", ["role", "instance", "dp_rank"],
            registry=r,
        )
        self.engine_load_failures = Counter(
            "atom_kv_proxy_engine_load_failures", "Engine load readings that failed, by reason (unreachable, "
            "timeout, too_large, status, error, malformed, missing)", ["reason"], registry=r,
        )
        for reason in ("unreachable", "timeout", "too_large", "status", "error", "malformed", "missing"):
            self.engine_load_failures.labels(reason)
        self.client_disconnects = Counter(
            "atom_kv_proxy_client_disconnects", "Requests cancelled because the client went away", registry=r
        )
        self.client_stalls = Counter(
            "atom_kv_proxy_client_stalls", "Connections dropped because the client read nothing for "
            "--stall-timeout while an answer waited (its decode leg aborted, its prefill released)", registry=r
        )
        self.refused_requests = Counter(
            "atom_kv_proxy_refused_requests", "Requests answered before their route ran: a Host not in "
            "--allowed-hosts (host: 421) or a completion body not declared application/json (content_type: 415)",
            ["reason"], registry=r,
        )
        self.charge_underflows = Counter(
            "atom_kv_proxy_charge_underflows", "Legs' loads not given back because that would count them twice, "
            "by role and reason: a charge released again (double_release: a proxy bug) or an instance's counter "
            "already at 0 (below_zero: its DP size changed while the leg ran)", ["role", "reason"], registry=r,
        )
        # admission control (atom_kv.proxy.admission)
        self.admission_queue_depth = Gauge(
            "atom_kv_proxy_admission_queue_depth", "Requests waiting for an engine under --max-concurrent-per-engine",
            registry=r,
        )
        self.admission_wait = Histogram(
            "atom_kv_proxy_admission_wait_seconds", "Time requests waited in the admission queue (admitted or "
            "timed out)", buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.admission_rejections = Counter(
            "atom_kv_proxy_admission_rejections", "Requests refused by admission control: the queue full "
            "(queue_full: 429), --queue-timeout passed (queue_timeout: 503), over --rate-limit (rate_limited: 429)",
            ["reason"], registry=r,
        )
        for reason in ("queue_full", "queue_timeout", "rate_limited"):
            self.admission_rejections.labels(reason)
        for reason in ("host", "content_type"):
            self.refused_requests.labels(reason)
        for outcome in ("sent", "dropped", "no_address"):
            self.releases.labels(outcome)
        for role in ("prefill", "decode"):
            self.instances.labels(role)
            self.evictions.labels(role)
            self.marked_down.labels(role)
            for reason in ("double_release", "below_zero"):
                self.charge_underflows.labels(role, reason)
        self._children: dict[tuple[str, ...], Any] = {}  # labelled children, looked up once (hot path)

    def child(self, metric: Any, *labels: str) -> Any:
        key = (str(id(metric)), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def routed(self, role: str, instance: str, dp_rank: int) -> None:
        """One leg went to ``dp_rank`` of ``instance``."""
        self.child(self.dp_routed, "prefill" if role == "P" else "decode", instance, str(dp_rank)).inc()

    def render(self, counts: dict[str, int], instances: Iterable[Any] = ()) -> bytes:
        """The exposition text; ``instances`` (registry :class:`Instance` objects) give the
        per-(instance, DP rank) load gauges, rebuilt on every scrape so gone instances vanish."""
        for role, n in counts.items():
            self.instances.labels(role).set(n)
        self.dp_outstanding_tokens.clear()
        self.dp_outstanding_requests.clear()
        self.engine_reported_requests.clear()
        self.engine_reported_prompt_tokens.clear()
        for inst in instances:
            role = "prefill" if inst.role == "P" else "decode"
            for rank, (tokens, reqs) in enumerate(zip(inst.outstanding_tokens, inst.outstanding_requests,
                                                      strict=False)):
                self.dp_outstanding_tokens.labels(role, inst.base_url, str(rank)).set(tokens)
                self.dp_outstanding_requests.labels(role, inst.base_url, str(rank)).set(reqs)
            for rank, reported in enumerate(inst.reported_load):
                if reported is not None:
                    self.engine_reported_requests.labels(role, inst.base_url, str(rank)).set(reported.requests)
                    self.engine_reported_prompt_tokens.labels(role, inst.base_url, str(rank)).set(
                        reported.prompt_tokens)
        return generate_latest(self.registry)


class RequestRecord:
    """The one place a client request's outcome is counted: status, duration,
    time to first byte, and whether the client went away. Each method is
    idempotent: the first outcome wins."""

    __slots__ = ("_metrics", "endpoint", "t0", "_first_byte", "_done", "status")

    def __init__(self, metrics: ProxyMetrics, endpoint: str) -> None:
        self._metrics = metrics
        self.endpoint = endpoint
        self.t0 = time.perf_counter()
        self._first_byte = False
        self._done = False
        self.status = 0  # the outcome once known: the status, or CLIENT_CLOSED

    def first_byte(self) -> None:
        if not self._first_byte:
            self._first_byte = True
            self._metrics.child(self._metrics.ttfb, self.endpoint).observe(time.perf_counter() - self.t0)

    def finish(self, status: int) -> None:
        """The response is complete (or failed with ``status`` before it started)."""
        if self._done:
            return
        self._done = True
        self.status = status
        self.first_byte()
        m = self._metrics
        m.child(m.requests, self.endpoint, str(status)).inc()
        m.child(m.duration, self.endpoint).observe(time.perf_counter() - self.t0)

    def client_gone(self) -> None:
        """The client disconnected before the response was complete."""
        if self._done:
            return
        self._done = True
        self.status = CLIENT_CLOSED
        self._metrics.client_disconnects.inc()
        self._metrics.child(self._metrics.requests, self.endpoint, str(CLIENT_CLOSED)).inc()
