"""Prometheus metrics of one proxy, in its own CollectorRegistry (never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ProxyMetrics:
    """Counters, gauges and histograms the proxy exports on ``/metrics``."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "atom_kv_proxy_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
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
        self.instances = Gauge("atom_kv_proxy_instances", "Live instances by role", ["role"], registry=r)
        self.evictions = Counter(
            "atom_kv_proxy_evictions", "Instances evicted for missing heartbeats", ["role"], registry=r
        )
        self.retries = Counter("atom_kv_proxy_retries", "Re-planned P/D pairs after an upstream failure", registry=r)
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
        self.client_disconnects = Counter(
            "atom_kv_proxy_client_disconnects", "Requests cancelled because the client went away", registry=r
        )
        for role in ("prefill", "decode"):
            self.instances.labels(role)
            self.evictions.labels(role)

    def render(self, counts: dict[str, int]) -> bytes:
        for role, n in counts.items():
            self.instances.labels(role).set(n)
        return generate_latest(self.registry)
