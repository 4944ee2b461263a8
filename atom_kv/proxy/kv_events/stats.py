"""The counters of KV event ingestion, in one record, and their Prometheus collector.

:class:`KvEventStats` is written by one thread (the subscriber's, or a bench's) and read by ``/metrics``:
plain ints and dicts of ints, so a read is a snapshot of each counter (no locks, nothing on the
request path). :class:`KvEventsCollector` turns it, with the index's per-worker block counts, into
the ``atom_kv_proxy_kv_*`` families of one proxy's own registry.
"""

from __future__ import annotations

from typing import Hashable, Iterator, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

__all__ = ["EVENT_KINDS", "LAG_BUCKETS_S", "KvEventStats", "KvEventsCollector", "REPLAY_OUTCOMES", "RESET_REASONS", "SKIP_REASONS"]

EVENT_KINDS = ("BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockTransferred")
#: why a BlockStored run was not indexed
SKIP_REASONS = ("block_size", "unknown_parent", "medium", "group")
#: how a replay ended: every missed batch came back, it did not reach back far enough, it timed out,
#: live batches piled up past the bound while it ran, or the publisher has no replay endpoint
REPLAY_OUTCOMES = ("complete", "short", "timeout", "overflow", "unavailable")
#: why a worker's entries were cleared
RESET_REASONS = ("restart", "cleared", "health", "left", "replay_short", "replay_timeout", "replay_overflow",
                 "no_replay")
DECODE_REASONS = ("frames", "seq", "oversize", "msgpack", "schema", "event")
#: upper bounds (seconds) of the event-lag histogram's buckets: from a batch's ``ts`` (the publisher's wall
#: clock when it sent it) to its events applied here; across hosts it carries the two clocks' skew
LAG_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class KvEventStats:
    """Every counter of one ingestion pipeline (one writer thread; readers take snapshots)."""

    __slots__ = ("events", "batches", "decode_failures", "skipped_runs", "gaps", "replays", "resets",
                 "evicted_blocks", "duplicates", "connect_failures", "lag_counts", "lag_sum_s")

    def __init__(self) -> None:
        self.events = dict.fromkeys(EVENT_KINDS, 0)
        self.batches = 0
        self.decode_failures = dict.fromkeys(DECODE_REASONS, 0)
        self.skipped_runs = dict.fromkeys(SKIP_REASONS, 0)
        self.gaps = 0
        self.replays = dict.fromkeys(REPLAY_OUTCOMES, 0)
        self.resets = dict.fromkeys(RESET_REASONS, 0)
        self.evicted_blocks = 0  # entries dropped by the memory caps
        self.duplicates = 0  # batches seen twice (seq at or below the last applied), dropped
        self.connect_failures = 0  # refused connects to a publisher (it is not there, or it does not bind)
        self.lag_counts = [0] * (len(LAG_BUCKETS_S) + 1)  # live batches per lag bucket (the last: above them all)
        self.lag_sum_s = 0.0

    def observe_lag(self, lag_s: float) -> None:
        """One live batch applied ``lag_s`` after its publisher stamped it (a negative lag, clock skew, is 0)."""
        lag_s = max(0.0, lag_s)
        self.lag_sum_s += lag_s
        for i, bound in enumerate(LAG_BUCKETS_S):
            if lag_s <= bound:
                self.lag_counts[i] += 1
                return
        self.lag_counts[-1] += 1

    def lag_quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the ``q`` quantile of the lags seen (inf past the last
        bucket; None: none seen)."""
        counts = list(self.lag_counts)
        total = sum(counts)
        if not total:
            return None
        seen = 0
        for bound, n in zip((*LAG_BUCKETS_S, float("inf")), counts):
            seen += n
            if seen >= q * total:
                return bound
        return float("inf")


def _role(instance: object) -> tuple[str, str]:
    if isinstance(instance, tuple) and len(instance) == 2:
        role, address = instance
        return ("prefill" if role == "P" else "decode" if role == "D" else str(role)), str(address)
    return "", str(instance)


class IndexCounts(Protocol):
    """What the collector reads of an index (:class:`atom_kv.proxy.kv_events.index.KvIndex`)."""

    entries: int

    @property
    def predicted_entries(self) -> int: ...

    def block_counts(self) -> dict[tuple[Hashable, int], int]: ...


class KvEventsCollector:
    """A Prometheus collector over one :class:`KvEventStats` and its index."""

    def __init__(self, stats: KvEventStats, index: IndexCounts) -> None:
        self._stats = stats
        self._index = index

    def describe(self) -> list:
        return []  # families are built at scrape time (their labels come and go with the workers)

    def collect(self) -> Iterator:
        s = self._stats
        blocks = GaugeMetricFamily("atom_kv_proxy_kv_indexed_blocks",
                                   "Blocks the KV event index holds for each (instance, DP rank)",
                                   labels=["role", "instance", "dp_rank"])
        for (instance, rank), count in self._index.block_counts().items():
            blocks.add_metric([*_role(instance), str(rank)], count)
        yield blocks
        yield GaugeMetricFamily("atom_kv_proxy_kv_index_entries",
                                "(block, instance) entries in the KV event index, all workers together "
                                "(bounded by --kv-index-max-blocks)", value=self._index.entries)
        yield GaugeMetricFamily("atom_kv_proxy_kv_predicted_blocks",
                                "(block, instance) predictions of recent routing decisions not yet expired",
                                value=self._index.predicted_entries)
        yield _counter("atom_kv_proxy_kv_events", "KV cache events applied, by kind", "kind", s.events)
        yield _counter("atom_kv_proxy_kv_event_decode_failures",
                       "KV event messages (or single events) that failed to decode, by reason", "reason",
                       s.decode_failures)
        yield _counter("atom_kv_proxy_kv_skipped_runs",
                       "BlockStored runs not indexed: block_size (len(token_ids) / len(block_hashes) is not the "
                       "engine's block size), unknown_parent, medium (not on the device), group (not KV cache "
                       "group 0)", "reason", s.skipped_runs)
        yield CounterMetricFamily("atom_kv_proxy_kv_event_gaps", "Sequence gaps seen on KV event feeds",
                                  value=s.gaps)
        yield _counter("atom_kv_proxy_kv_event_replays", "Replays of missed KV event batches, by outcome", "outcome",
                       s.replays)
        yield _counter("atom_kv_proxy_kv_index_resets", "Times a worker's index entries were cleared, by reason",
                       "reason", s.resets)
        yield CounterMetricFamily("atom_kv_proxy_kv_index_evicted_blocks",
                                  "Index entries dropped by the memory caps (--kv-index-max-blocks*)",
                                  value=s.evicted_blocks)
        counts, seen, buckets = list(s.lag_counts), 0, []
        for bound, n in zip((*(repr(b) for b in LAG_BUCKETS_S), "+Inf"), counts):
            seen += n
            buckets.append((bound, seen))
        yield HistogramMetricFamily("atom_kv_proxy_kv_event_lag_seconds",
                                    "From a live KV event batch's timestamp (the publisher's clock) to its events "
                                    "applied to the index", buckets=buckets, sum_value=s.lag_sum_s)
        yield CounterMetricFamily("atom_kv_proxy_kv_event_connect_failures",
                                  "Refused connects to a KV event publisher (none there, or it does not bind)",
                                  value=s.connect_failures)


def _counter(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in values.copy().items():
        family.add_metric([key], value)
    return family
