"""Upstream health: the one owner of circuit breakers, failure counters, "down" marks and probes.

:class:`UpstreamHealth` is what the relay (and its decode streams) report
every upstream outcome to. :class:`HealthMonitor` is the task that evicts
silent instances and probes the ones whose health is not known from traffic:
static engines (they send no pings), newly discovered ones (before they get
traffic) and the ones marked down (to bring them back).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import msgspec

from atom_kv.logfmt import INSTANCE
from atom_kv.proxy.fleet.breaker import RequestOutcomes
from atom_kv.proxy.fleet.load import fleet_pool_limit
from atom_kv.proxy.fleet.registry import DOWN, PENDING, ROLE_NAMES, Instance, ProbeFailure, Registry
from atom_kv.proxy.http.upstream import (
    UpstreamConnectionError, UpstreamConnectTimeout, UpstreamError, UpstreamPool, UpstreamTimeout,
)
from atom_kv.proxy.observability.metrics import ProxyMetrics

logger = logging.getLogger(__name__)

_json = msgspec.json.Decoder()

# what engines report as their role in /health, per our role letter
_ROLE_WORDS = {
    "P": {"p", "prefill", "producer", "kv_producer"},
    "D": {"d", "decode", "consumer", "kv_consumer"},
}
MAX_CONCURRENT_PROBES = 32


def is_connection_failure(exc: BaseException) -> bool:
    """Refused, reset or dropped before an answer: the engine process (or its host) is not there."""
    return isinstance(exc, ConnectionError)


class UpstreamHealth:
    """Records the outcome of every upstream exchange: breaker, counters, down marks.

    Suspect failures (a 500 and the like, an answer over the size bounds: what one request's
    content can cause) of a request that reports with a :class:`RequestOutcomes` wait in it until
    :meth:`settle` judges them (see :mod:`atom_kv.proxy.fleet.breaker`)."""

    def __init__(self, registry: Registry, metrics: ProxyMetrics) -> None:
        self.registry = registry
        self.metrics = metrics

    def succeeded(self, inst: Instance, request: RequestOutcomes | None = None) -> None:
        inst.breaker.record_success(time.monotonic())
        if request is not None:
            request.served.add(inst.key)

    def failed(self, inst: Instance, kind: str, exc: BaseException | None = None,
               request: RequestOutcomes | None = None, suspect: bool = False) -> None:
        """One failed exchange (``kind`` labels the counter) of ``request`` (the breaker counts
        one request once); a connection-level failure also takes the instance out of routing
        until a probe reaches it. A ``suspect`` failure waits for the request's verdict."""
        name = ROLE_NAMES[inst.role]
        self.metrics.upstream_failures.labels(name, kind).inc()
        if suspect:
            if request is None:  # nobody to judge it with: unresolved at once
                if inst.breaker.record_unresolved(time.monotonic()):
                    self._opened(inst)
                return
            request.suspects.append((inst.role, inst.key, inst))
            if request.settled:  # reported after the request's end: judged on what is known
                self._judge(request, inst)
            return
        self._count(inst, request.key if request is not None else None)
        if exc is not None and is_connection_failure(exc):
            self.mark_down(inst, f"{kind}: {exc or type(exc).__name__}")

    def settle(self, request: RequestOutcomes) -> None:
        """The request has its answer (or gave up): judge its suspect failures, one per instance."""
        if request.settled:
            return
        request.settled = True
        judged: set[tuple[str, str]] = set()
        for _, key, inst in request.suspects:
            if key not in judged:
                judged.add(key)
                assert isinstance(inst, Instance)  # RequestOutcomes (breaker.py) holds them as objects
                self._judge(request, inst)

    def _judge(self, request: RequestOutcomes, inst: Instance) -> None:
        verdict = request.verdict(inst.role, inst.key)
        self.metrics.suspect_verdicts.labels(ROLE_NAMES[inst.role], verdict).inc()
        if verdict == "instance":
            self._count(inst, request.key)
        elif verdict == "unresolved" and inst.breaker.record_unresolved(time.monotonic()):
            self._opened(inst)

    def _count(self, inst: Instance, key: object) -> None:
        if inst.breaker.record_failure(time.monotonic(), key):
            self._opened(inst)

    def _opened(self, inst: Instance) -> None:
        name = ROLE_NAMES[inst.role]
        self.metrics.circuit_opened.labels(name).inc()
        logger.warning("circuit opened for %s instance %s after %s", name, inst.base_url, inst.breaker.trip_reason)

    def mark_down(self, inst: Instance, reason: str, failure: ProbeFailure | None = None) -> None:
        if self.registry.mark_down(inst, reason, failure):
            self.metrics.marked_down.labels(ROLE_NAMES[inst.role]).inc()


class HealthMonitor:
    """Owns the periodic task: evicts silent instances and probes static, new and down ones.

    A probe is ``GET /health``: connection refused/reset or a 5xx marks the
    instance down, except one never reached yet, which is still *starting*
    (it may register before its server listens: no "down" for that); any other answer (a 404 too: the server is there) marks it
    up, and fills in what the engine reports (``engine_id``, ``tp_size``,
    ``dp_size``, ``role``), and hands the body to ``on_health`` (the engine load it reports);
    ``GET /v1/models`` is asked once for ``max_model_len``.
    A probe that times out (no connection within the connect timeout: a
    firewall dropping packets; or no answer within ``timeout_s``) is the
    ``down_reason`` of a pending or down instance ("health probe timed out
    after N s", one WARNING per change, see :meth:`Registry.not_reached`), and
    the engine hears it in its registration answer; it does not take an up
    instance out of routing (a static engine then goes silent and is evicted
    after the heartbeat timeout, like a discovered one).
    """

    def __init__(self, registry: Registry, health: UpstreamHealth, *,
                 interval_s: float, timeout_s: float, connect_timeout: float, tick_s: float,
                 max_dp_size: int = 512, on_health: Callable[[Instance, bytes], object] | None = None) -> None:
        self.registry = registry
        self._on_health = on_health  # every 200 /health body (the engine load reader reads its load from it)
        self.max_dp_size = max_dp_size  # bound on a dp_size a static engine's /health reports
        self.health = health
        self.interval_s = interval_s
        self.tick_s = tick_s
        self._timeout_s = timeout_s
        self._connect_timeout = min(connect_timeout, timeout_s)
        self._pool: UpstreamPool | None = None
        self._task: asyncio.Task | None = None
        self._probing: dict[tuple[str, str], asyncio.Task] = {}
        self._next_probe: dict[tuple[str, str], float] = {}
        self._limit = asyncio.Semaphore(MAX_CONCURRENT_PROBES)

    async def start(self) -> None:
        if self._task is None:
            # idle connections close after 4 s, below uvicorn's 5 s keep-alive (vLLM's server)
            self._pool = UpstreamPool(connect_timeout=self._connect_timeout, keepalive_s=4.0,
                                      limit=MAX_CONCURRENT_PROBES)
            self._task = asyncio.create_task(self._run(), name="atom-kv-proxy-health")

    async def close(self) -> None:
        task, self._task = self._task, None
        probes = list(self._probing.values())
        for t in ([task] if task else []) + probes:
            t.cancel()
        await asyncio.gather(*([task] if task else []), *probes, return_exceptions=True)
        self._probing.clear()
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def _run(self) -> None:
        registry = self.registry
        while True:
            try:
                await asyncio.wait_for(registry.wakeup.wait(), self.tick_s)
            except asyncio.TimeoutError:
                pass
            registry.wakeup.clear()
            try:
                self.tick(time.monotonic())
            except Exception:  # keep health monitoring alive whatever one instance does
                logger.exception("unexpected error in the health monitor")

    def tick(self, now: float) -> None:
        """Evict silent instances and start the probes that are due."""
        for inst in self.registry.evict_expired(now):  # counted by the registry's on_evict owner
            self._next_probe.pop(inst.key, None)
        self.registry.flush_logs()
        if self._pool is not None:  # a fleet of static engines is probed every interval: one connection each
            self._pool.limit = fleet_pool_limit(len(self.registry), MAX_CONCURRENT_PROBES)
        for inst in self.registry.to_probe():  # static, pending and down ones, not every up engine
            key = inst.key
            if key in self._probing or now < self._next_probe.get(key, 0.0):
                continue
            self._next_probe[key] = now + self.interval_s
            self._probing[key] = asyncio.create_task(self._probe_one(inst))
        if len(self._next_probe) > 2 * len(self.registry) + 64:  # forget instances that left
            known = {i.key for r in ("P", "D") for i in self.registry.known(r)}
            self._next_probe = {k: v for k, v in self._next_probe.items() if k in known}

    async def _probe_one(self, inst: Instance) -> None:
        INSTANCE.set(inst.base_url)  # this probe's task: its log lines name the instance
        try:
            async with self._limit:
                await self.probe(inst)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("probe of %s failed unexpectedly", inst.base_url)
        finally:
            self._probing.pop(inst.key, None)

    async def probe(self, inst: Instance) -> None:
        """Probe ``inst`` once and apply the outcome."""
        assert self._pool is not None
        try:
            status, _, raw = await self._pool.fetch(inst.host, inst.http_port, b"GET", b"/health",
                                                    total_timeout=self._timeout_s)
        except UpstreamConnectionError as exc:
            self._not_serving(inst, f"health probe: {exc or type(exc).__name__}", ProbeFailure.REFUSED)
            return
        except UpstreamConnectTimeout as exc:
            self._timed_out(inst, f"health probe timed out after {self._connect_timeout:g} s: {exc}")
            return
        except UpstreamTimeout:
            self._timed_out(inst, f"health probe timed out after {self._timeout_s:g} s: connected to "
                                  f"{inst.host}:{inst.http_port}, but GET /health was not answered")
            return
        except UpstreamError as exc:  # e.g. an answer over the size bounds: the server is there, changes nothing
            logger.debug("health probe of %s failed: %s", inst.base_url, exc)
            return
        if status >= 500:
            self._not_serving(inst, f"health probe answered {status}", ProbeFailure.ERROR)
            return
        if status == 200 and self._on_health is not None:
            self._on_health(inst, raw)
        info = self._decode(raw) if status == 200 else None
        if info is not None and not self._apply(inst, info):
            return
        if inst.max_model_len is None:
            await self._learn_model(inst)  # before it is routable: the first request is checked too
        self.registry.mark_up(inst)

    def _not_serving(self, inst: Instance, reason: str, failure: ProbeFailure) -> None:
        """A probe that found no serving engine: down, unless no probe ever reached it (then still starting)."""
        if inst.state in (PENDING, DOWN):
            self.registry.not_reached(inst, reason, failure)
        else:
            self.health.mark_down(inst, reason, failure)

    def _timed_out(self, inst: Instance, reason: str) -> None:
        """A probe that timed out: the reason of a pending or down instance; an up one stays up (one slow
        answer is no proof; a static engine that stays silent is evicted after the heartbeat timeout)."""
        if inst.state in (PENDING, DOWN):
            self.registry.not_reached(inst, reason, ProbeFailure.TIMED_OUT)
        else:
            logger.debug("health probe of %s: %s", inst.base_url, reason)

    @staticmethod
    def _decode(raw: bytes) -> dict[str, Any] | None:
        try:
            value = _json.decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return None
        return value if isinstance(value, dict) else None

    def _apply(self, inst: Instance, info: dict[str, Any]) -> bool:
        """Take what a static engine reports; False (and down) if it says it is the other role."""
        role = info.get("role")
        if isinstance(role, str) and role.lower() not in _ROLE_WORDS[inst.role] and role.lower() in (
                _ROLE_WORDS["P"] | _ROLE_WORDS["D"]):
            self.health.mark_down(inst, f"the engine reports role {role!r}, registered as {ROLE_NAMES[inst.role]}")
            return False
        features = info.get("kv_features")
        if isinstance(features, list):
            inst.learn(features=frozenset(f for f in features[:32] if isinstance(f, str) and len(f) <= 64))
        if not inst.static:
            return True
        engine_id = info.get("engine_id")
        if "engine_id" not in inst.pinned and isinstance(engine_id, str) and engine_id:
            inst.learn(engine_id=engine_id)
        tp = info.get("tp_size")
        if "tp_size" not in inst.pinned and isinstance(tp, int) and not isinstance(tp, bool) and 1 <= tp <= 4096:
            inst.learn(tp_size=tp)
        dp = info.get("dp_size")
        if isinstance(dp, int) and not isinstance(dp, bool) and dp != inst.health_dp_size:
            inst.health_dp_size = dp  # acted on (and logged) once per value it reports
            self._take_dp_size(inst, dp)
        return True

    def _take_dp_size(self, inst: Instance, dp: int) -> None:
        """A static engine's ``/health`` names its DP size: it wins over the spec's ``dp=`` (routing to a
        rank the engine lacks fails every request sent there). One line per value reported: a warning
        when the spec disagrees or the value is out of bounds."""
        role = ROLE_NAMES[inst.role]
        if not 1 <= dp <= self.max_dp_size:
            logger.warning("static %s engine %s: its /health reports dp_size=%d, outside 1..%d (--max-dp-size); "
                           "keeping dp_size=%d", role, inst.base_url, dp, self.max_dp_size, inst.dp_size)
            return
        given = inst.spec_dp_size
        if given is not None and given != dp:
            logger.warning("static %s engine %s: its /health reports dp_size=%d but its --%s spec says dp=%d; "
                           "using dp_size=%d from /health (correct or drop dp= in the spec)",
                           role, inst.base_url, dp, role, given, dp)
        elif dp != inst.dp_size:
            logger.info("static %s engine %s: dp_size=%d from its /health", role, inst.base_url, dp)
        inst.resize_dp(dp)

    async def _learn_model(self, inst: Instance) -> None:
        assert self._pool is not None
        try:
            status, _, raw = await self._pool.fetch(inst.host, inst.http_port, b"GET", b"/v1/models",
                                                    total_timeout=self._timeout_s)
        except UpstreamError:
            return
        if status != 200:
            return
        info = self._decode(raw)
        data = info.get("data") if info else None
        if not isinstance(data, list) or not data or not isinstance(data[0], dict):
            return
        first = data[0]
        length = first.get("max_model_len")
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            inst.max_model_len = length
        if inst.model is None and isinstance(first.get("id"), str):
            inst.learn(model=first["id"])
