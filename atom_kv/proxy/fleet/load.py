"""Engine-reported load: the task that fills each up instance's ``reported_load`` at an interval.

Every ``interval_s`` (``--engine-load-interval``) :class:`LoadReader` reads each up instance once, off
the request path (its own tasks on the loop, its own bounded :class:`UpstreamPool`):

- ``GET /health`` first: the reference engine (and ATOM-style engines) report per DP rank
  ``requests`` and ``load`` there (:func:`~atom_kv.proxy.fleet.load_parse.parse_health`). A static
  engine's health probe already fetches that body, and :meth:`LoadReader.take_health` reads it from the
  probe: no second request while the probe's reading is fresh.
- an engine whose ``/health`` says nothing (vLLM: an empty 200) is read from ``GET /metrics`` from then
  on (:func:`~atom_kv.proxy.fleet.load_parse.parse_vllm_metrics`); one with neither is asked again
  every ``RECHECK_INTERVALS`` intervals.

Every answer is bounded (``max_bytes``, the pool's body bound; ``timeout_s`` for the whole exchange),
and every failure (not reached, timed out, too large, not 200, malformed, gauges missing) is logged
(rate-limited), counted in ``atom_kv_proxy_engine_load_failures{reason}`` and survived: the last reading
stays, with its age (``ReportedLoad.at``) for the consumer to judge.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from enum import Enum

from atom_kv._ratelimit import RateLimitedLog
from atom_kv.proxy.fleet.load_parse import LoadParseError, Reading, parse_health, parse_vllm_metrics
from atom_kv.proxy.fleet.registry import DOWN, UP, Instance, Registry, ReportedLoad
from atom_kv.proxy.http.upstream import UpstreamPool
from atom_kv.proxy.http.upstream_answer import (
    AnswerLimits, UpstreamConnectionError, UpstreamConnectTimeout, UpstreamError, UpstreamTimeout,
    UpstreamTooLarge,
)
from atom_kv.proxy.observability.metrics import ProxyMetrics

logger = logging.getLogger(__name__)

MAX_CONCURRENT_READS = 32
RECHECK_INTERVALS = 10  # an engine that reports no load anywhere is asked again after this many intervals


def fleet_pool_limit(engines: int, concurrent: int) -> int:
    """The open-connection cap of a pool that reads every engine once an interval: one kept-alive connection
    per engine, plus ``concurrent`` in flight. A cap below the fleet's size closes an idle connection for
    almost every reading, and the next reading of that engine opens a new one (``bench fleet``: most of the
    idle CPU at 1,000 engines). The fleet is bounded (``--max-instances``), so this is too."""
    return engines + concurrent


class LoadSource(Enum):
    """Where an instance's load is read from."""

    UNKNOWN = "unknown"  # not read yet: /health first
    HEALTH = "health"  # its /health reports load
    METRICS = "metrics"  # its /health says nothing: vLLM's gauges in /metrics
    NONE = "none"  # neither says anything: asked again every RECHECK_INTERVALS


@dataclass
class _Follow:
    """The reader's record of one instance."""

    inst: Instance
    source: LoadSource = LoadSource.UNKNOWN
    next_at: float = 0.0
    task: asyncio.Task | None = None


class LoadReader:
    """Owns the load-reading task, its connection pool and its per-instance records (see the module doc)."""

    def __init__(self, registry: Registry, metrics: ProxyMetrics, *, interval_s: float, timeout_s: float,
                 connect_timeout: float, max_bytes: int, log_interval_s: float = 10.0) -> None:
        self.registry = registry
        self.metrics = metrics
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._connect_timeout = min(connect_timeout, timeout_s)
        self._pool: UpstreamPool | None = None
        self._task: asyncio.Task | None = None
        self._follows: dict[tuple[str, str], _Follow] = {}
        self._limit = asyncio.Semaphore(MAX_CONCURRENT_READS)
        self._warn = RateLimitedLog(logger, "failed engine load readings", interval_s=log_interval_s, burst=4)

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    async def start(self) -> None:
        if self._task is None and self.enabled:
            self._pool = UpstreamPool(connect_timeout=self._connect_timeout, keepalive_s=4.0,
                                      limit=MAX_CONCURRENT_READS, limits=AnswerLimits(body=self.max_bytes))
            self._task = asyncio.create_task(self._run(), name="atom-kv-proxy-engine-load")

    async def close(self) -> None:
        task, self._task = self._task, None
        reads = [f.task for f in self._follows.values() if f.task is not None]
        for t in ([task] if task else []) + reads:
            t.cancel()
        await asyncio.gather(*([task] if task else []), *reads, return_exceptions=True)
        self._follows.clear()
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def _run(self) -> None:
        while True:
            try:
                self.tick(time.monotonic())
            except Exception:  # keep reading whatever one instance does
                logger.exception("unexpected error in the engine load reader")
            await asyncio.sleep(self.interval_s / 2)

    def tick(self, now: float) -> None:
        """Start the reads that are due; forget the instances that left."""
        known = {i.key: i for role in ("P", "D") for i in self.registry.known(role)}
        if self._pool is not None:  # one kept-alive connection per engine, plus the reads in flight
            self._pool.limit = fleet_pool_limit(len(known), MAX_CONCURRENT_READS)
        for key in [k for k, f in self._follows.items() if known.get(k) is not f.inst]:
            gone = self._follows.pop(key)
            if gone.task is not None:
                gone.task.cancel()
        for key, inst in known.items():
            if inst.state != UP:
                continue
            follow = self._follows.get(key)
            if follow is None:
                follow = self._follows[key] = _Follow(inst)
            if follow.task is not None or now < follow.next_at:
                continue
            if follow.source is LoadSource.HEALTH and self._fresh(inst, now):
                continue  # its health probe read it
            follow.next_at = now + self.interval_s * (RECHECK_INTERVALS if follow.source is LoadSource.NONE else 1)
            follow.task = asyncio.create_task(self._read_one(follow), name="atom-kv-proxy-engine-load-read")

    def _fresh(self, inst: Instance, now: float) -> bool:
        ats = [r.at for r in inst.reported_load if r is not None]
        return bool(ats) and now - min(ats) < self.interval_s

    async def _read_one(self, follow: _Follow) -> None:
        try:
            async with self._limit:
                await self.read(follow)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("engine load reading of %s failed unexpectedly", follow.inst.base_url)
        finally:
            follow.task = None

    async def read(self, follow: _Follow) -> None:
        """Read ``follow``'s instance once, from the source it is known to report on."""
        inst = follow.inst
        if follow.source in (LoadSource.UNKNOWN, LoadSource.HEALTH, LoadSource.NONE):
            raw = await self._fetch(inst, b"/health")
            if raw is None:
                return
            if self.take_health(inst, raw):
                follow.source = LoadSource.HEALTH
                return
            if follow.source is LoadSource.HEALTH:  # it stopped saying: look again from the start
                follow.source = LoadSource.UNKNOWN
                return
        raw = await self._fetch(inst, b"/metrics")
        if raw is None:
            return
        try:
            reading = parse_vllm_metrics(raw, inst.dp_size)
        except LoadParseError as exc:
            self._failed(inst, exc.reason, str(exc))
            return
        if reading is None:
            follow.source = LoadSource.NONE
            self._failed(inst, "missing", "neither /health nor /metrics (vllm:num_requests_running, "
                                          "vllm:num_requests_waiting) reports its load")
            return
        follow.source = LoadSource.METRICS
        self.apply(inst, reading)

    def take_health(self, inst: Instance, raw: bytes) -> bool:
        """Read the load from a ``/health`` body (the reader's or a health probe's); True when it had one."""
        if not self.enabled:
            return False
        if len(raw) > self.max_bytes:
            self._failed(inst, "too_large", f"/health answer of {len(raw)} bytes is over --engine-load-max-bytes "
                                            f"({self.max_bytes})")
            return False
        try:
            reading = parse_health(raw)
        except LoadParseError as exc:
            self._failed(inst, exc.reason, str(exc))
            return False
        if reading is None:
            return False
        self.apply(inst, reading)
        return True

    def apply(self, inst: Instance, reading: Reading, now: float | None = None) -> None:
        """``reading`` becomes ``inst.reported_load``: one entry per DP rank, None for a rank it does not name
        (ranks beyond the instance's DP size are dropped)."""
        now = time.monotonic() if now is None else now
        if self.registry.get(inst.role, inst.base_url) is not inst or inst.state == DOWN:
            return  # it left, or went down, while we read: nothing of it is to be trusted now
        inst.reported_load = [
            None if (value := reading.get(rank)) is None else ReportedLoad(value[0], value[1], now)
            for rank in range(inst.dp_size)]

    async def _fetch(self, inst: Instance, path: bytes) -> bytes | None:
        assert self._pool is not None
        what = path.decode()
        try:
            status, _, raw = await self._pool.fetch(inst.host, inst.http_port, b"GET", path,
                                                    total_timeout=self.timeout_s)
        except UpstreamTooLarge as exc:
            self._failed(inst, "too_large", f"{what}: {exc} (--engine-load-max-bytes)")
            return None
        except (UpstreamConnectionError, UpstreamConnectTimeout) as exc:
            self._failed(inst, "unreachable", f"{what}: {exc or type(exc).__name__}")
            return None
        except UpstreamTimeout:
            self._failed(inst, "timeout", f"{what} not answered within {self.timeout_s:g} s "
                                          "(--engine-load-timeout)")
            return None
        except UpstreamError as exc:
            self._failed(inst, "error", f"{what}: {exc}")
            return None
        if status != 200:
            self._failed(inst, "status", f"{what} answered {status}")
            return None
        return raw

    def _failed(self, inst: Instance, reason: str, message: str) -> None:
        self.metrics.engine_load_failures.labels(reason).inc()
        self._warn.event(reason, f"engine load of {inst.base_url}: {message}; its last reading is kept")
