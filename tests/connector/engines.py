"""A minimal engine driver for tests: one scheduler, an aggregator and N rank
handles, stepped exactly like an engine does (metadata -> every rank ->
get_finished -> aggregate -> update_connector_output)."""

from __future__ import annotations

import time
from typing import Callable, ClassVar, Optional, Protocol, Sequence

from atom_kv.connector.aggregator import KVOutputAggregator
from atom_kv.connector.scheduler import RoleScheduler
from atom_kv.connector.types import ConnectorMetadata, KVConnectorOutput, SchedulerEvents

from tests.connector.kvutil import BLOCK, BlockPool


class Rank(Protocol):
    def step(self, meta: ConnectorMetadata) -> KVConnectorOutput: ...


class LocalRank:
    """A worker in this process."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def step(self, meta: ConnectorMetadata) -> KVConnectorOutput:
        self.worker.start_load_kv(meta)
        return self.worker.get_finished()


class Engine:
    """Scheduler + aggregator + ranks + a block pool; records every event.

    Every Engine made during a test has its scheduler closed when the test
    ends (``tests/connector/conftest.py``): a consumer's scheduler owns the
    thread that sends releases."""

    made: ClassVar[list["Engine"]] = []  # test-only registry, emptied after every test

    def __init__(self, scheduler: RoleScheduler, ranks: Sequence[Rank], num_blocks: int) -> None:
        Engine.made.append(self)
        self.sched = scheduler
        self.ranks = list(ranks)
        self.agg = KVOutputAggregator(len(self.ranks))
        self.pool = BlockPool(num_blocks)
        self.ready: list[str] = []
        self.failed: dict[str, str] = {}
        self.recompute: list[str] = []
        self.freed: list[str] = []
        self.first_tokens: dict[str, list[int]] = {}  # the prefill's token, learned before the request was ready
        self.keepalive: list = []  # buffers registered outside the KV caches

    def step(self, now: Optional[float] = None) -> SchedulerEvents:
        meta = self.sched.build_connector_meta()
        out = self.agg.aggregate([r.step(meta) for r in self.ranks])
        ev = self.sched.update_connector_output(out, now)
        for rid, tokens in ev.first_tokens.items():
            assert rid not in self.ready and rid not in self.first_tokens, (rid, "a late or repeated first token")
            self.first_tokens[rid] = tokens
        self.ready += ev.ready
        self.recompute += ev.recompute
        self.failed.update(ev.failed)
        for rid in ev.failed:
            self.pool.free(rid)
        for rid in ev.free:
            self.freed.append(rid)
            self.pool.free(rid)
        return ev

    # producer side -------------------------------------------------------
    def prefill(self, rid: str, num_tokens: int) -> dict:
        """Admit, 'compute' and finish a do_remote_decode request; returns its kv_transfer_params."""
        assert self.sched.get_num_new_matched_tokens(rid, num_tokens, {"do_remote_decode": True}) == (0, False)
        blocks = self.pool.alloc(rid, -(-num_tokens // BLOCK))
        delay, params = self.sched.request_finished(rid, blocks)
        assert delay and params is not None and params["remote_block_ids"] == blocks
        return params

    # consumer side -------------------------------------------------------
    def admit(self, rid: str, num_tokens: int, params: dict, num_computed: int = 0) -> list[int]:
        """Admit a do_remote_prefill request whose first ``num_computed`` tokens
        are cached here; returns all its prompt blocks."""
        n, is_async = self.sched.get_num_new_matched_tokens(rid, num_tokens, params, num_computed)
        assert (n, is_async) == ((num_tokens - num_computed, True) if num_tokens > num_computed else (0, False))
        blocks = self.pool.alloc(rid, -(-num_tokens // BLOCK))
        self.sched.update_state_after_alloc(rid, blocks, n)
        return blocks

    def finish(self, rid: str, *, aborted: bool = False) -> None:
        delay, _ = self.sched.request_finished(rid, self.pool.held.get(rid, []), aborted=aborted)
        if not delay:
            self.pool.free(rid)


def run_until(engines: Sequence[Engine], done: Callable[[], bool], timeout_s: float = 20.0, tick_s: float = 0.005) -> None:
    """Step every engine until ``done()``; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        for e in engines:
            e.step()
        time.sleep(tick_s)
