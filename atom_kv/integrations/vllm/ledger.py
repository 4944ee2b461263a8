"""Who owes vLLM which report: the bookkeeping between vLLM's connector contract
and atom-kv's engine hooks (no vLLM import, so it is tested without vLLM).

vLLM frees the blocks of a finished producer request, and releases a consumer
request that waits for remote KV, only once *every* worker rank has named the
request (in ``finished_sending`` / ``finished_recving``); its
``KVOutputAggregator`` counts each naming, so a rank naming a request twice
would release it early. Two ledgers keep the promise "each rank names each
request exactly once":

- :class:`SchedulerLedger` (vLLM's scheduler process) decides *when*: producer
  requests whose blocks vLLM holds for atom-kv and that may be freed now (every
  consumer rank read them, or the lease expired), and consumer requests vLLM
  waits on that atom-kv gave up on before any rank reported them (abandoned:
  every rank must still name them, with their blocks marked invalid).
- :class:`RankLedger` (one per worker rank) turns the scheduler's decisions and
  the rank's own finished loads into that rank's report, once each.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

from atom_kv.engine_hooks import KVConnectorOutput, LoadSpec

__all__ = ["RankLedger", "RankReport", "SchedulerLedger"]

logger = logging.getLogger(__name__)


class SchedulerLedger:
    """Owns the scheduler side's per-request promises to vLLM."""

    def __init__(self) -> None:
        self._held: dict[str, None] = {}  # producer: blocks vLLM keeps until we name the request
        self._free_next: list[str] = []
        self._waiting: dict[str, list[int]] = {}  # consumer: request -> local blocks its load writes
        self._abandon_next: dict[str, list[int]] = {}
        self._loaded: set[str] = set()  # consumer: one remote load per request, even after a preemption

    # --- producer -------------------------------------------------------
    def hold(self, request_id: str) -> None:
        """vLLM keeps the request's blocks until a later step names it."""
        self._held[request_id] = None

    def release(self, request_ids: Iterable[str]) -> None:
        """The hooks freed these requests' blocks: name them in the next step (held ones only, once)."""
        for rid in request_ids:
            if self._held.pop(rid, "absent") is None:
                self._free_next.append(rid)

    def frees_pending(self) -> bool:
        """True when the next step gives blocks back to vLLM."""
        return bool(self._free_next)

    # --- consumer -------------------------------------------------------
    def loaded_before(self, request_id: str) -> bool:
        return request_id in self._loaded

    def wait_for(self, request_id: str, block_ids: Sequence[int]) -> None:
        """vLLM now waits for every rank to report the request's load into ``block_ids``."""
        self._loaded.add(request_id)
        self._waiting[request_id] = [int(b) for b in block_ids]

    def reported(self, request_ids: Iterable[str]) -> None:
        """Every rank reported these loads (vLLM saw the same reports in the same step)."""
        for rid in request_ids:
            self._waiting.pop(rid, None)

    def give_up(self, request_ids: Iterable[str]) -> None:
        """The hooks ended these loads without the ranks' reports: make every rank name them."""
        for rid in request_ids:
            blocks = self._waiting.pop(rid, None)
            if blocks is not None:
                self._abandon_next[rid] = blocks

    def forget(self, request_id: str) -> None:
        """The request finished; vLLM will not admit it again."""
        self._loaded.discard(request_id)

    # --- per step -------------------------------------------------------
    def take_step(self) -> tuple[list[str], dict[str, list[int]]]:
        """``(requests every rank names in finished_sending, abandoned loads)`` for the next metadata."""
        free, self._free_next = self._free_next, []
        abandon, self._abandon_next = self._abandon_next, {}
        return free, abandon

    def num_held(self) -> int:
        return len(self._held)

    def num_waiting(self) -> int:
        return len(self._waiting)


class RankReport:
    """One step's report of one rank, in vLLM's terms."""

    __slots__ = ("finished_sending", "finished_recving", "failed_recving", "invalid_block_ids")

    def __init__(self) -> None:
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()  # failed loads whose blocks this rank does not know
        self.invalid_block_ids: set[int] = set()


class RankLedger:
    """Owns what one worker rank has yet to tell vLLM; names each request at most once."""

    def __init__(self, *, max_remembered: int = 65536) -> None:
        self._loads: dict[str, list[int]] = {}  # loads this rank started: request -> local blocks
        self._reported: OrderedDict[str, None] = OrderedDict()
        self._max_remembered = max_remembered
        self._report = RankReport()

    def step(self, loads: Sequence[LoadSpec], free_sending: Sequence[str], abandon: dict[str, list[int]]) -> None:
        """Take one step's metadata (call before the hooks see the loads)."""
        for spec in loads:
            self._loads[spec.request_id] = list(spec.block_ids)
        self._report.finished_sending.update(free_sending)
        for rid, blocks in abandon.items():
            if rid in self._loads or rid in self._reported:
                continue  # this rank reports (or reported) it itself
            self._name(rid, blocks)

    def finished(self, output: KVConnectorOutput) -> None:
        """Take the hooks' finished loads of this rank."""
        for rid in output.finished_recving:
            self._name(rid, None)
        for rid, reason in output.failed_recving.items():
            blocks = self._loads.get(rid)
            if blocks is None:
                logger.error("request %s: load failed (%s) but this rank never started it; "
                             "reporting the whole request as failed", rid, reason)
                self._report.failed_recving.add(rid)
            self._name(rid, blocks or ())

    def _name(self, rid: str, invalid: Optional[Sequence[int]]) -> None:
        if rid in self._reported:
            logger.warning("request %s: already reported to vLLM by this rank; not naming it twice", rid)
            return
        self._loads.pop(rid, None)
        self._reported[rid] = None
        if len(self._reported) > self._max_remembered:
            self._reported.popitem(last=False)
        self._report.finished_recving.add(rid)
        if invalid:
            self._report.invalid_block_ids.update(int(b) for b in invalid)

    def take(self) -> RankReport:
        """This step's report; the next one starts empty."""
        report, self._report = self._report, RankReport()
        return report

    def num_loading(self) -> int:
        return len(self._loads)
