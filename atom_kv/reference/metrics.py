"""Prometheus metrics of one engine, on its own ``CollectorRegistry``."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from atom_kv.reference.engine import EngineCore

__all__ = ["EngineMetrics"]


class _EngineCollector:
    """Reads the engine's snapshot, counters and per-rank transfer stats at scrape time."""

    def __init__(self, engine: "EngineCore") -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        e = self._engine
        snap = e.snapshot()
        gauges = {
            "atom_kv_kv_blocks_total": ("KV cache blocks in the engine", snap["kv_total"]),
            "atom_kv_kv_blocks_free": ("KV cache blocks free", snap["kv_free"]),
            "atom_kv_kv_blocks_used": ("KV cache blocks allocated (including held)",
                                       snap["kv_total"] - snap["kv_free"]),
            "atom_kv_kv_blocks_held": ("KV blocks held for remote readers", snap["kv_held"]),
            "atom_kv_requests_running": ("requests running", snap["running"]),
            "atom_kv_requests_waiting": ("requests waiting for blocks or a slot", snap["waiting"]),
            "atom_kv_requests_waiting_remote_kv": ("requests waiting for remote KV", snap["waiting_remote"]),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value))
        counters = dict(e.counters)
        for key, doc in (
            ("prompt_tokens", "prompt tokens computed"),
            ("generation_tokens", "tokens generated"),
            ("requests_ok", "requests finished successfully"),
            ("requests_failed", "requests ended with an error"),
            ("requests_aborted", "requests aborted"),
            ("steps", "engine steps"),
        ):
            yield CounterMetricFamily(f"atom_kv_{key}", doc, value=float(counters.get(key, 0)))
        per_key: dict[str, GaugeMetricFamily] = {}
        for rank, stats in enumerate(list(e.worker_stats)):
            for key, value in stats.items():
                name = "atom_kv_transfer_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
                fam = per_key.get(name)
                if fam is None:
                    fam = per_key[name] = GaugeMetricFamily(
                        name, f"connector transfer stat `{key}` (cumulative, per TP rank)", labels=["rank"]
                    )
                fam.add_metric([str(rank)], float(value))
        yield from per_key.values()


class EngineMetrics:
    """Owns the engine's registry; ``render()`` gives the exposition text."""

    def __init__(self, engine: "EngineCore") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)
