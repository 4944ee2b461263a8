"""The values vLLM carries between its processes for atom-kv: scheduler -> workers metadata, workers ->
scheduler reports, and the transfer counters vLLM's stats logger sums."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from atom_kv.engine_hooks import ConnectorMetadata, KVConnectorOutput

__all__ = ["AtomKVConnectorMetadata", "AtomKVConnectorStats", "AtomKVWorkerMetadata"]


@dataclass
class AtomKVConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> every worker, once per step.

    ``hooks`` is atom-kv's own per-step metadata; ``free_sending`` names the
    producer requests every rank reports in ``finished_sending`` this step
    (vLLM then frees their blocks); ``abandon`` names consumer loads atom-kv
    ended without any rank reporting them, with their local blocks; ``idle``:
    the step computes nothing while transfers are outstanding, so a rank may
    wait (bounded) for their news before it reports.
    """

    hooks: ConnectorMetadata = field(default_factory=ConnectorMetadata)
    free_sending: list[str] = field(default_factory=list)
    abandon: dict[str, list[int]] = field(default_factory=dict)
    idle: bool = False


@dataclass
class AtomKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Every worker -> the scheduler side, once per step: each rank's own atom-kv output."""

    reports: list[tuple[int, KVConnectorOutput]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "AtomKVWorkerMetadata":
        if isinstance(other, AtomKVWorkerMetadata):
            self.reports.extend(other.reports)
        return self


@dataclass
class AtomKVConnectorStats(KVConnectorStats):
    """Transfer counters of one interval (worker ranks add up), as atom-kv's ``WorkerHooks.stats()`` names them."""

    def reset(self) -> None:
        self.data: dict[str, float] = {}

    def aggregate(self, other: KVConnectorStats) -> "AtomKVConnectorStats":
        for key, value in (other.data or {}).items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        seconds = d.get("seconds", 0.0)
        nbytes = d.get("bytes", 0.0)
        return {
            "transfers": int(d.get("transfers", 0)),
            "MB": round(nbytes / 1e6, 3),
            "GB/s": round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0,
            "ranges": int(d.get("ranges", 0)),
            "retries": int(d.get("retries", 0)),
            "failures": int(d.get("failures", 0)),
            "handshakes": int(d.get("handshakes", 0)),
            "handshake_failures": int(d.get("handshake_failures", 0)),
            "peers_dropped": int(d.get("peers_dropped", 0)),
        }

    def is_empty(self) -> bool:
        return not any(self.data.values())
