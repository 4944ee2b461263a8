"""Live engine instances: registration, liveness expiry, load counters, circuit state."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

from yarl import URL

logger = logging.getLogger(__name__)

Role = Literal["P", "D"]
ROLE_NAMES = {"P": "prefill", "D": "decode"}


class CircuitBreaker:
    """Per-instance breaker: open after ``threshold`` consecutive failures,
    half-open after ``cooldown_s`` (one trial request at a time; a trial whose
    outcome never arrives, e.g. the client left, frees the slot after another
    ``cooldown_s``), closed again on a success."""

    def __init__(self, threshold: int, cooldown_s: float) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.failures = 0
        self.opened_at = 0.0
        self._open = False
        self._trial_started: float | None = None

    def state(self, now: float | None = None) -> str:
        if not self._open:
            return "closed"
        now = time.monotonic() if now is None else now
        if now - self.opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    def allows(self, now: float) -> bool:
        state = self.state(now)
        if state == "closed":
            return True
        if state == "open":
            return False
        return self._trial_started is None or now - self._trial_started >= self.cooldown_s

    def on_dispatch(self, now: float) -> None:
        if self.state(now) == "half_open":
            self._trial_started = now

    def record_success(self) -> None:
        self.failures = 0
        self._open = False
        self._trial_started = None

    def record_failure(self, now: float) -> bool:
        """Count a failure; returns True when this failure (re)opened the circuit."""
        self.failures += 1
        if self._trial_started is not None or self.failures >= self.threshold:
            self._open = True
            self.opened_at = now
            self._trial_started = None
            return True
        return False


@dataclass
class Instance:
    """One registered engine (rank 0 of a P or D deployment) and its live load."""

    role: Role
    base_url: str
    host: str
    http_port: int
    handshake_port: int
    dp_size: int
    tp_size: int
    breaker: CircuitBreaker
    index: str = "0"
    engine_id: str | None = None
    model: str | None = None
    notify_port: int | None = None
    source: str = "atom"
    last_seen: float = 0.0
    last_seen_wall: float = 0.0
    inflight: int = 0
    outstanding_tokens: list[int] = field(default_factory=list)
    dp_counter: int = 0
    _urls: dict[str, URL] = field(default_factory=dict, repr=False)

    def url(self, path: str) -> URL:
        """The upstream URL for ``path`` (parsed once, not on every request)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.base_url + path)
        return url

    @property
    def key(self) -> tuple[str, str]:
        return (self.role, self.base_url)

    def next_dp_rank(self) -> int:
        """Cycle through every DP rank of this instance (no aliasing across instances)."""
        rank = self.dp_counter % self.dp_size
        self.dp_counter += 1
        return rank

    def charge(self, dp_rank: int, tokens: int) -> None:
        self.inflight += 1
        if dp_rank < len(self.outstanding_tokens):  # dp_size may change on re-registration
            self.outstanding_tokens[dp_rank] += tokens

    def credit(self, dp_rank: int, tokens: int) -> None:
        self.inflight = max(0, self.inflight - 1)
        if dp_rank < len(self.outstanding_tokens):
            self.outstanding_tokens[dp_rank] = max(0, self.outstanding_tokens[dp_rank] - tokens)

    def describe(self, now: float) -> dict:
        return {
            "role": self.role,
            "address": self.base_url,
            "host": self.host,
            "port": self.http_port,
            "handshake_port": self.handshake_port,
            "notify_port": self.notify_port,
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "index": self.index,
            "engine_id": self.engine_id,
            "model": self.model,
            "source": self.source,
            "last_seen": self.last_seen_wall,
            "last_seen_age_s": round(now - self.last_seen, 3),
            "inflight": self.inflight,
            "outstanding_tokens": list(self.outstanding_tokens),
            "circuit": self.breaker.state(now),
        }


@dataclass(frozen=True)
class Registration:
    """What a valid ping says about an instance (format-independent)."""

    role: Role
    base_url: str
    host: str
    http_port: int
    handshake_port: int
    dp_size: int
    tp_size: int
    index: str = "0"
    engine_id: str | None = None
    model: str | None = None
    notify_port: int | None = None
    source: str = "atom"


class Registry:
    """The set of live instances. Written by the discovery thread, read by the
    event loop; membership is guarded by a lock, load counters are loop-only."""

    def __init__(
        self,
        heartbeat_timeout: float,
        circuit_failures: int,
        circuit_cooldown_s: float,
        on_evict: Callable[[Instance], None] | None = None,
    ) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self._circuit_failures = circuit_failures
        self._circuit_cooldown_s = circuit_cooldown_s
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._instances: dict[tuple[str, str], Instance] = {}

    def upsert(self, reg: Registration, now: float | None = None) -> bool:
        """Add or refresh an instance; returns True when it is new."""
        now = time.monotonic() if now is None else now
        with self._lock:
            key = (reg.role, reg.base_url)
            inst = self._instances.get(key)
            new = inst is None
            if inst is None:
                inst = Instance(
                    role=reg.role, base_url=reg.base_url, host=reg.host, http_port=reg.http_port,
                    handshake_port=reg.handshake_port, dp_size=reg.dp_size, tp_size=reg.tp_size,
                    breaker=CircuitBreaker(self._circuit_failures, self._circuit_cooldown_s),
                    outstanding_tokens=[0] * reg.dp_size,
                )
                self._instances[key] = inst
            inst.handshake_port = reg.handshake_port
            inst.tp_size = reg.tp_size
            if inst.dp_size != reg.dp_size:
                inst.dp_size = reg.dp_size
                inst.outstanding_tokens = (inst.outstanding_tokens + [0] * reg.dp_size)[: reg.dp_size]
            inst.index = reg.index
            inst.engine_id = reg.engine_id
            inst.model = reg.model
            inst.notify_port = reg.notify_port
            inst.source = reg.source
            inst.last_seen = now
            inst.last_seen_wall = time.time()
            if new:
                self._changed.notify_all()
        if new:
            logger.info(
                "registered %s instance %s (tp=%d dp=%d handshake_port=%d, %s ping)",
                ROLE_NAMES[reg.role], reg.base_url, reg.tp_size, reg.dp_size, reg.handshake_port, reg.source,
            )
        return new

    def _alive(self, inst: Instance, now: float) -> bool:
        return now - inst.last_seen <= self.heartbeat_timeout

    def evict_expired(self, now: float | None = None) -> list[Instance]:
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [i for i in self._instances.values() if not self._alive(i, now)]
            for inst in gone:
                del self._instances[inst.key]
            if gone:
                self._changed.notify_all()
        for inst in gone:
            logger.warning(
                "evicted %s instance %s: not heard from for %.1fs (heartbeat timeout %.1fs)",
                ROLE_NAMES[inst.role], inst.base_url, now - inst.last_seen, self.heartbeat_timeout,
            )
            if self._on_evict is not None:
                self._on_evict(inst)
        return gone

    def live(self, role: Role, now: float | None = None) -> list[Instance]:
        """Live instances of ``role``, in a stable (address) order."""
        now = time.monotonic() if now is None else now
        with self._lock:
            found = [i for i in self._instances.values() if i.role == role and self._alive(i, now)]
        found.sort(key=lambda i: i.base_url)
        return found

    def counts(self, now: float | None = None) -> dict[str, int]:
        return {"prefill": len(self.live("P", now)), "decode": len(self.live("D", now))}

    def snapshot(self, now: float | None = None) -> list[dict]:
        now = time.monotonic() if now is None else now
        return [i.describe(now) for role in ("P", "D") for i in self.live(role, now)]

    def wait_for(self, predicate: Callable[["Registry"], bool], timeout: float) -> bool:
        """Block (not busy-wait) until ``predicate(self)`` holds or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            if predicate(self):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self._changed:
                self._changed.wait(min(remaining, 0.1))
