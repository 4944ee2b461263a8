"""Prometheus metrics of one engine (all its DP ranks), on its own ``CollectorRegistry``."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from atom_kv.reference.dp import DataParallelEngine

__all__ = ["EngineMetrics"]


class _EngineCollector:
    """Reads each DP rank's snapshot, counters and per-TP-rank transfer stats at scrape time
    (every series carries a ``dp_rank`` label)."""

    def __init__(self, engine: "DataParallelEngine") -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        e = self._engine
        snaps = e.snapshots()
        gauges = {
            "atom_kv_kv_blocks_total": ("KV cache blocks of the DP rank", lambda s: s["kv_total"]),
            "atom_kv_kv_blocks_free": ("KV cache blocks free", lambda s: s["kv_free"]),
            "atom_kv_kv_blocks_used": ("KV cache blocks allocated (including held)",
                                       lambda s: s["kv_total"] - s["kv_free"]),
            "atom_kv_kv_blocks_held": ("KV blocks held for remote readers", lambda s: s["kv_held"]),
            "atom_kv_kv_blocks_cached": ("KV blocks in the prefix cache (held by requests or not)",
                                         lambda s: s["kv_cached"]),
            "atom_kv_requests_running": ("requests running", lambda s: s["running"]),
            "atom_kv_requests_waiting": ("requests waiting for blocks or a slot", lambda s: s["waiting"]),
            "atom_kv_requests_waiting_remote_kv": ("requests waiting for remote KV", lambda s: s["waiting_remote"]),
            "atom_kv_load_requests": ("requests given to the DP rank and not yet answered",
                                      lambda s: s["load_requests"]),
            "atom_kv_load_prompt_tokens": ("prompt tokens of the requests given to the DP rank and not yet answered",
                                           lambda s: s["load_prompt_tokens"]),
        }
        for name, (doc, read) in gauges.items():
            gauge = GaugeMetricFamily(name, doc, labels=["dp_rank"])
            for rank, snap in enumerate(snaps):
                gauge.add_metric([str(rank)], float(read(snap)))
            yield gauge
        for key, doc in (
            ("prompt_tokens", "prompt tokens computed"),
            ("generation_tokens", "tokens generated"),
            ("requests_ok", "requests finished successfully"),
            ("requests_failed", "requests ended with an error"),
            ("requests_aborted", "requests aborted"),
            ("steps", "engine steps"),
        ):
            counter = CounterMetricFamily(f"atom_kv_{key}", doc, labels=["dp_rank"])
            for rank, core in enumerate(e.cores):
                counter.add_metric([str(rank)], float(dict(core.counters).get(key, 0)))
            yield counter
        yield from _cache_metrics(e)
        per_key: dict[str, GaugeMetricFamily] = {}
        for dp_rank, core in enumerate(e.cores):
            for rank, stats in enumerate(list(core.worker_stats)):
                for key, value in stats.items():
                    name = "atom_kv_transfer_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
                    fam = per_key.get(name)
                    if fam is None:
                        fam = per_key[name] = GaugeMetricFamily(
                            name, f"connector transfer stat `{key}` (cumulative, per TP rank)",
                            labels=["dp_rank", "rank"])
                    fam.add_metric([str(dp_rank), str(rank)], float(value))
        yield from per_key.values()
        yield from _route_metrics(e)


def _cache_metrics(e: "DataParallelEngine") -> Iterator[Metric]:
    """The prefix cache's queries and hits (in tokens, as vLLM counts them), the blocks read from
    producers, and the KV event publisher's counters (only where events are on)."""
    for name, doc, value in (
        ("prefix_cache_queries", "prompt tokens looked up in the prefix cache", lambda st: st.queries),
        ("prefix_cache_hits", "prompt tokens found in the prefix cache", lambda st: st.hits),
        ("kv_load_blocks", "prompt blocks read from a producer (blocks cached here are not read)",
         lambda st: st.loaded_blocks),
    ):
        fam = CounterMetricFamily(f"atom_kv_{name}", doc, labels=["dp_rank"])
        for rank, core in enumerate(e.cores):
            fam.add_metric([str(rank)], float(value(core.scheduler.stats)))
        yield fam
    stats = [(rank, st) for rank, st in ((rank, core.event_stats()) for rank, core in enumerate(e.cores))
             if st is not None]
    if not stats:
        return
    for key, doc in (
        ("batches_published", "KV event batches sent"),
        ("events_published", "KV events sent"),
        ("batches_dropped", "KV event batches dropped because the sender's queue was full (their seq is a gap)"),
        ("events_dropped", "KV events dropped with their batches"),
        ("replay_requests", "KV event replay requests served"),
        ("replayed_batches", "KV event batches sent again by replays"),
        ("bad_replay_requests", "malformed KV event replay requests ignored"),
        ("replays_cut", "KV event replays cut short (the peer's queue was full, or it left)"),
    ):
        fam = CounterMetricFamily(f"atom_kv_kv_events_{key}", doc, labels=["dp_rank"])
        for rank, st in stats:
            fam.add_metric([str(rank)], float(st[key]))
        yield fam


def _route_metrics(e: "DataParallelEngine") -> Iterator[Metric]:
    """Each decode rank's chosen backend per producer rank (1 per route shown),
    the routes it has but does not show, and the backends' fallbacks by reason."""
    ranks = ["dp_rank", "rank"]
    route = GaugeMetricFamily("atom_kv_route", "the transfer backend a rank reads a producer rank with "
                              "(value 1; the most recent peers, see atom_kv_routes_hidden)",
                              labels=[*ranks, "peer", "peer_dp_rank", "peer_rank", "memory", "backend"])
    hidden = GaugeMetricFamily("atom_kv_routes_hidden", "peers of the rank beyond the routes shown", labels=ranks)
    fallbacks = CounterMetricFamily("atom_kv_route_fallbacks", "peers not read over the route their memory and "
                                    "hosts call for, and backends dropped, by backend and reason",
                                    labels=[*ranks, "backend", "reason"])
    for dp_rank, core in enumerate(e.cores):
        for rank, report in sorted(list(core.worker_routes.items())):
            at = [str(dp_rank), str(rank)]
            for r in report.routes:
                route.add_metric([*at, r.peer, str(r.peer_dp_rank), str(r.peer_rank), r.memory, r.backend], 1.0)
            hidden.add_metric(at, float(report.hidden))
            for backend, reason, count in report.fallbacks:
                fallbacks.add_metric([*at, backend, reason], float(count))
    yield from (route, hidden, fallbacks)


class EngineMetrics:
    """Owns the engine's registry; ``render()`` gives the exposition text."""

    def __init__(self, engine: "DataParallelEngine") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)
