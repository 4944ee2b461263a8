"""Combine the per-rank finished sets into "finished on every rank".

Rules (one :class:`KVOutputAggregator` per engine, fed once per step):

- an id is emitted once every one of the ``world_size`` ranks reported it;
  a rank reporting the same id twice counts once;
- a failure on any rank wins: once every rank reported the id as finished
  *or* failed, it is emitted in ``failed_recving`` (with the first reason)
  and not in ``finished_recving``. Waiting for all ranks (rather than failing
  on the first report) guarantees no rank is still writing into the request's
  blocks when the scheduler frees them;
- reports after an id was emitted are ignored; the memory of emitted ids is
  bounded (the oldest are forgotten past ``max_remembered``), and so is the
  set of partially reported ids (the oldest partial entries are dropped with a
  warning past ``max_pending``).
- ``first_tokens`` (the prefill's token a rank learned with the blocks) pass
  on as soon as any rank reports them (every rank learns the same token);
  the scheduler side takes each request's once.
- ``reached`` (a rank completed a handshake with the load's producer) is
  emitted with the request's finished or failed entry when any rank said so.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from atom_kv._lru import BoundedDict, BoundedSet
from atom_kv._plural import counted
from atom_kv.connector.types import KVConnectorOutput

__all__ = ["KVOutputAggregator"]

logger = logging.getLogger(__name__)


class _Tracker:
    """Per-family (sending or receiving) bookkeeping of partial reports."""

    __slots__ = ("world_size", "pending", "reasons", "emitted", "name")

    def __init__(self, name: str, world_size: int, max_remembered: int, max_pending: int) -> None:
        self.name = name
        self.world_size = world_size
        self.pending: BoundedDict[str, set[int]] = BoundedDict(max_pending, on_evict=self._drop_pending)
        self.reasons: dict[str, str] = {}
        self.emitted: BoundedSet[str] = BoundedSet(max_remembered)

    def _drop_pending(self, req_id: str, _ranks: set[int]) -> None:
        self.reasons.pop(req_id, None)
        logger.warning("aggregator: dropping incomplete %s report for %s (too many pending)", self.name, req_id)

    def report(self, rank: int, req_id: str, reason: Optional[str]) -> Optional[tuple[str, Optional[str]]]:
        """Record one rank's report; returns ``(id, failure reason or None)`` when complete."""
        if req_id in self.emitted:
            return None
        ranks = self.pending.get(req_id)
        if ranks is None:
            ranks = set()
            self.pending[req_id] = ranks
        ranks.add(rank)
        if reason is not None and req_id not in self.reasons:
            self.reasons[req_id] = f"rank {rank}: {reason}" if self.world_size > 1 else reason
        if len(ranks) < self.world_size:
            return None
        del self.pending[req_id]
        self.emitted.add(req_id)
        return req_id, self.reasons.pop(req_id, None)


class KVOutputAggregator:
    """Owns the partial finished/failed reports of all TP ranks of one engine."""

    def __init__(self, world_size: int, *, max_remembered: int = 65536, max_pending: int = 65536) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._send = _Tracker("sending", world_size, max_remembered, max_pending)
        self._recv = _Tracker("receiving", world_size, max_remembered, max_pending)
        self._reached: BoundedSet[str] = BoundedSet(max_pending)  # said by a rank, not emitted yet

    def aggregate(self, outputs: Sequence[Optional[KVConnectorOutput]]) -> KVConnectorOutput:
        """Fold one step's outputs (index = rank; ``None`` = nothing from that rank)."""
        if len(outputs) > self.world_size:
            raise ValueError(f"got {len(outputs)} outputs for a world of {counted(self.world_size, 'rank')}")
        sending: list[str] = []
        recving: list[str] = []
        failed: dict[str, str] = {}
        first: dict[str, list[int]] = {}
        for rank, out in enumerate(outputs):
            if out is None:
                continue
            for rid, tokens in out.first_tokens.items():
                first.setdefault(rid, tokens)
            for rid in out.reached:
                self._reached.add(rid)
            for tid in out.finished_sending:
                done = self._send.report(rank, tid, None)
                if done is not None:
                    sending.append(tid)
            for rid in out.finished_recving:
                self._collect(self._recv.report(rank, rid, None), recving, failed)
            for rid, reason in out.failed_recving.items():
                self._collect(self._recv.report(rank, rid, reason or "load failed"), recving, failed)
        reached = [rid for rid in [*recving, *failed] if self._reached.discard(rid)]
        return KVConnectorOutput(finished_sending=sending, finished_recving=recving, failed_recving=failed,
                                 first_tokens=first, reached=reached)

    @staticmethod
    def _collect(done: Optional[tuple[str, Optional[str]]], recving: list[str], failed: dict[str, str]) -> None:
        if done is None:
            return
        rid, reason = done
        if reason is None:
            recving.append(rid)
        else:
            failed[rid] = reason

    def pending_count(self) -> int:
        """Ids some but not all ranks reported (for tests and metrics)."""
        return len(self._send.pending) + len(self._recv.pending)
