"""Every knob of the proxy, in one immutable object built from the CLI or by tests."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("round_robin", "random", "power_of_two", "least_loaded", "prefix_hash")


@dataclass(frozen=True)
class ProxySettings:
    """Proxy configuration. Timeouts are seconds; every network wait uses one of them."""

    host: str = "0.0.0.0"
    port: int = 10001
    discovery_host: str = "0.0.0.0"
    discovery_port: int = 36367
    heartbeat_timeout: float = 15.0
    policy: str = "round_robin"
    registration_token: str | None = None
    prefix_chars: int = 256
    max_retries: int = 2
    retry_backoff_s: float = 0.05
    connect_timeout: float = 5.0
    prefill_timeout: float = 300.0
    decode_timeout: float = 300.0
    models_timeout: float = 10.0
    circuit_failures: int = 3
    circuit_cooldown_s: float = 10.0
    discovery_poll_s: float = 0.5
    max_upstream_connections: int = 4096
    shutdown_timeout: float = 5.0
    backlog: int = 4096
    keep_alive_timeout: float = 60.0
    max_request_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        positive = (
            "heartbeat_timeout", "connect_timeout", "prefill_timeout", "decode_timeout",
            "models_timeout", "circuit_cooldown_s", "discovery_poll_s", "shutdown_timeout",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        for name in ("max_retries", "prefix_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")
        if self.circuit_failures < 1:
            raise ValueError(f"circuit_failures: must be >= 1, got {self.circuit_failures!r}")
        if self.retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s: must be >= 0, got {self.retry_backoff_s!r}")
