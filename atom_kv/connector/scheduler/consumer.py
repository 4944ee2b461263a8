"""The decode engine's scheduler side: which requests read their prompt's KV from a prefill
engine, the loads the ranks start, their deadlines, and the release every end of one sends.

A request is a :class:`_Match` until its blocks are allocated, then a :class:`_Load`::

    get_num_new_matched_tokens(do_remote_prefill) -> matched (blocks cached
        locally, num_computed_tokens, are not read again)
    update_state_after_alloc -> QUEUED (LoadSpec in the next metadata), REFUSED (the
        allocation cannot take the load: it fails at the next update), or, when nothing
        will be read (the whole prompt was cached, or the engine loads none of the remote
        tokens), released
    build_connector_meta -> LOADING (deadline = now + load budget, plus
        :func:`~atom_kv.connector.scheduler.common.rendezvous_wait_s` for a rendezvous:
        params with ``remote_blocks_pending`` and no block ids; the workers learn them from
        the producer, :mod:`atom_kv.connector.rendezvous`)
    first_tokens (the rendezvous brought the prefill's sampled token, and the
        decode leg asked to continue from it: ``first_token_pending``) ->
        SchedulerEvents.first_tokens, while still loading
    finished_recving (reads done and confirmed by every producer rank read
        from) -> ready | failed_recving (incl. the producer's lease expired
        first, or no confirmation) / deadline -> failed or recompute
    abort while loading -> CANCELLED (metadata.cancelled) -> free once every
        rank reported (or the load deadline passed)

Every end of a remote prefill here (read, failed, timed out, aborted at any point, skipped,
params refused, request rejected by the engine) sends one release to the producer
(:class:`~atom_kv.connector.scheduler.common.Releases`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Optional, Sequence

from atom_kv.config import KVTransferConfig
from atom_kv.connector.params import ParamsIn, RequestParams
from atom_kv.connector.release import ReleaseSpec
from atom_kv.connector.scheduler.common import Deadlines, RoleScheduler, TimerKind, load_backstop_s, rendezvous_wait_s
from atom_kv.connector.types import ConnectorMetadata, KVConnectorOutput, LoadSpec, SchedulerEvents

__all__ = ["ConsumerScheduler", "LoadState"]

logger = logging.getLogger(__name__)


class LoadState(Enum):
    """Where a decode request's load stands once its blocks are allocated."""

    #: goes to the ranks in the next metadata
    QUEUED = "queued"
    #: the allocation cannot take the load (too few blocks, nothing left to read): fails at the next update
    REFUSED = "refused"
    #: the ranks read; a deadline runs
    LOADING = "loading"
    #: the request ended while the ranks read: its blocks are freed once every rank stopped (or the deadline)
    CANCELLED = "cancelled"


@dataclass
class _Match:
    """A consumer request whose remote KV will be read once blocks are allocated (its params parsed once)."""

    params: RequestParams
    num_prompt_tokens: int
    num_computed_tokens: int

    @property
    def remote_tokens(self) -> int:
        return max(0, self.num_prompt_tokens - self.num_computed_tokens)


@dataclass(eq=False)
class _Load:
    request_id: str
    spec: LoadSpec
    remote_tokens: int
    state: LoadState = LoadState.QUEUED
    deadline: float = 0.0
    started: float = 0.0
    #: the decode leg continues from the prefill's first token, which the rendezvous brings
    wants_first_token: bool = False
    #: why a REFUSED load fails
    failure: str = ""


class ConsumerScheduler(RoleScheduler):
    """The scheduler side of a decode engine (``kv_consumer``): owns its matched requests,
    their loads (one record each, with a :class:`LoadState`), the loads' deadlines, and the
    releases it sends the producers."""

    notice_role = "decode"
    kv_role = "kv_consumer"

    def __init__(self, config: KVTransferConfig, *, engine_id: str, host: str, tp_size: int, dp_rank: int = 0,
                 dp_size: int = 1, pp_size: int = 1, block_size: int,
                 release_sender: Optional[Callable[[ReleaseSpec, str], None]] = None) -> None:
        super().__init__(config, engine_id=engine_id, host=host, tp_size=tp_size, dp_rank=dp_rank, dp_size=dp_size,
                         pp_size=pp_size, block_size=block_size, release_sender=release_sender)
        self._budget = load_backstop_s(config)
        self._matched: dict[str, _Match] = {}
        self._loads: dict[str, _Load] = {}
        # this step's outboxes: the records stay in _loads, these say what the next step does with them
        self._to_start: dict[str, _Load] = {}
        self._to_fail: dict[str, _Load] = {}
        self._cancelled_out: list[str] = []
        self._timers = Deadlines(TimerKind.LOAD)

    # ------------------------------------------------------------------
    # admission
    # ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request_id: str, num_prompt_tokens: int, kv_transfer_params: ParamsIn,
                                   num_computed_tokens: int = 0) -> tuple[int, bool]:
        """How many prompt tokens the ranks will read from the producer, and whether the
        request waits for them: ``(num_prompt_tokens - num_computed_tokens, True)`` for params
        that ask for a remote prefill this engine can load, else ``(0, False)``.

        The one entry of a request's ``kv_transfer_params``: parsed here, once (a request
        asked about again keeps the params of its first match). Side effects, unlike vLLM's
        contract for this hook, which calls it side-effect free: the request is remembered
        as matched, and params refused here (malformed, or missing a key a load needs) send
        the producer they name a release, so it frees its blocks now.

        Idempotent: the engine may call it any number of times for a request (ATOM calls it
        again after its allocation, vLLM while the request waits); each call answers as
        the first did for the same token counts, a loading request answers its load's count,
        and no release goes out twice. Called by the engine's scheduler, on its thread, for
        each request it considers scheduling."""
        if num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
        load = self._loads.get(request_id)
        if load is not None:
            return load.remote_tokens, True
        if not kv_transfer_params or num_prompt_tokens <= 0:
            return 0, False
        known = self._matched.get(request_id)
        params = known.params if known is not None else self._loadable(request_id, RequestParams.of(kv_transfer_params))
        if params is None:
            return 0, False
        match = self._matched[request_id] = _Match(params, num_prompt_tokens, num_computed_tokens)
        if match.remote_tokens == 0:
            return 0, False  # all cached here; update_state_after_alloc or request_finished lets the producer go
        return match.remote_tokens, True

    def _loadable(self, request_id: str, params: RequestParams) -> Optional[RequestParams]:
        """``params`` when they ask for a remote prefill this engine can load, else None (and the
        producer they name, if any, is released)."""
        if params.refusal is not None:
            logger.warning("request %s: ignoring kv_transfer_params (%s); prefilling locally", request_id,
                           params.refusal)
            self._releases.of_params(params, "the decode engine refused its kv_transfer_params")
            return None
        if not params.wire.do_remote_prefill:
            return None
        missing = params.wire.missing_for_load()
        if missing is not None:
            logger.warning("request %s: ignoring kv_transfer_params (missing `%s`); prefilling locally",
                           request_id, missing)
            self._releases.of_params(params, f"kv_transfer_params lack `{missing}`")
            return None
        return params

    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """The matched request's blocks are allocated (``block_ids``: all its prompt blocks,
        locally cached ones included): its load is queued for the next metadata, or refused
        (too few blocks; it fails at the next update), or, when nothing will be read, the
        producer is released. Idempotent: only the first call after a match acts; a request
        not matched is ignored. Called by the engine's scheduler after each allocation for
        a request, on its thread."""
        match = self._matched.pop(request_id, None)
        if match is None:
            return
        if match.remote_tokens == 0:
            self._skip_load(request_id, match)
            return
        if num_external_tokens <= 0:
            # the engine computes the prompt itself (vLLM does for prompt-logprobs requests)
            self._releases.of_params(match.params, "the decode engine loads none of the remote tokens")
            return
        cached = match.num_computed_tokens // self.block_size
        if match.params.wire.remote_blocks_pending and not match.params.wire.remote_block_ids:
            needed = -(-match.num_prompt_tokens // self.block_size)
            spec = self._load_spec(request_id, match, [int(b) for b in block_ids[cached:needed]], [])
            spec.await_blocks = True  # the workers learn the block ids from the producer
            load = self._loads[request_id] = _Load(request_id, spec, match.remote_tokens,
                                                   wants_first_token=bool(match.params.wire.first_token_pending))
            if len(block_ids) < needed:
                self._refuse(load, f"allocated {len(block_ids)} blocks for a prompt of {needed}")
            else:
                self._to_start[request_id] = load
            return
        remote_blocks = match.params.wire.remote_block_ids or []
        spec = self._load_spec(request_id, match, [int(b) for b in block_ids[cached: len(remote_blocks)]],
                               remote_blocks[cached:])
        load = self._loads[request_id] = _Load(request_id, spec, match.remote_tokens)
        if len(block_ids) < len(remote_blocks):
            self._refuse(load, f"allocated {len(block_ids)} blocks but the producer sent {len(remote_blocks)}")
        elif not spec.remote_block_ids:
            self._refuse(load, f"the producer sent {len(remote_blocks)} blocks, all within the "
                               f"{match.num_computed_tokens} tokens cached here, but {match.remote_tokens} "
                               f"tokens are missing")
        else:
            self._to_start[request_id] = load

    def _refuse(self, load: _Load, failure: str) -> None:
        load.state, load.failure = LoadState.REFUSED, failure
        self._to_fail[load.request_id] = load

    def _load_spec(self, request_id: str, match: _Match, block_ids: list[int], remote_block_ids: list[int]) -> LoadSpec:
        p = match.params.wire
        return LoadSpec(
            request_id=request_id,
            transfer_id=p.transfer_id or "",
            block_ids=block_ids,
            remote_block_ids=list(remote_block_ids),
            num_tokens=match.num_prompt_tokens,
            remote_engine_id=p.remote_engine_id or "",
            remote_host=p.remote_host or "",
            remote_handshake_port=p.producer_handshake_port or 0,
            remote_tp_size=p.producer_tp_size,
            remote_dp_rank=p.producer_dp_rank,
            remote_block_offset=match.num_computed_tokens // self.block_size,
            remote_pp_size=p.remote_pp_size or 1,
            remote_dp_size=max(p.remote_dp_size or 1, p.producer_dp_rank + 1),
        )

    def _skip_load(self, request_id: str, match: _Match) -> None:
        """Nothing to read (the whole prompt is cached here): the producer may free the blocks now."""
        logger.debug("request %s: all %d prompt tokens cached locally; releasing transfer %s",
                     request_id, match.num_prompt_tokens, match.params.wire.transfer_id)
        self._releases.of_params(match.params, "the whole prompt was cached on the decode engine")

    # ------------------------------------------------------------------
    # per step
    # ------------------------------------------------------------------
    def build_connector_meta(self) -> ConnectorMetadata:
        """This step's news for every rank: loads to start (their deadlines start now) and
        loads cancelled. Not idempotent: it hands the news over and resets it, so call it
        exactly once per engine step, on the scheduler thread, and give its result to every
        rank's ``start_load_kv``."""
        now = time.monotonic()
        loads = []
        for load in self._to_start.values():
            load.state = LoadState.LOADING
            load.started = now
            load.deadline = now + self._budget + (rendezvous_wait_s(self.config) if load.spec.await_blocks else 0.0)
            self._timers.add(load.deadline, load.request_id)
            loads.append(load.spec)
            logger.debug("request %s: loading %d blocks of %s", load.request_id, len(load.spec.block_ids),
                         load.spec.transfer_id)
        cancelled, self._to_start, self._cancelled_out = self._cancelled_out, {}, []
        return ConnectorMetadata(loads=loads, sends=[], released=[], cancelled=cancelled, coming=[], dropped=[])

    def has_metadata(self) -> bool:
        """Whether the next metadata carries news. No side effect; any number of calls."""
        return bool(self._to_start or self._cancelled_out)

    def update_connector_output(self, output: KVConnectorOutput, now: Optional[float] = None) -> SchedulerEvents:
        """Turns the ranks' reports (aggregated over this engine's ranks) and the loads past
        their deadline into what the engine must do: ``ready``, ``failed`` or ``recompute``
        (``load_failure_policy``), ``free`` for aborted loads every rank stopped, and
        ``first_tokens``. Each load ends once: a report on a load already ended, or not
        started, changes nothing. Side effect: every end of a load sends its producer a
        release. Call once per engine step (empty output is fine), and at least every
        second while :meth:`has_pending`, on the scheduler thread."""
        now = time.monotonic() if now is None else now
        events = SchedulerEvents()
        for rid, tokens in output.first_tokens.items():
            load = self._loads.get(rid)
            if load is not None and load.state is LoadState.LOADING and load.wants_first_token:
                load.wants_first_token = False  # once
                events.first_tokens[rid] = list(tokens)
        for rid in output.finished_recving:
            load = self._ended(rid, events, None)
            if load is not None:
                events.ready.append(rid)
                logger.debug("request %s: remote KV loaded in %.3f s", rid, now - load.started)
                self._releases.answered(load.spec)  # every rank read from answered its handshake
                self._releases.of_load(load.spec, "read")
        reached = set(output.reached)
        for rid, reason in output.failed_recving.items():
            load = self._ended(rid, events, reason)
            if load is not None:
                if rid in reached:  # a rank completed a handshake with the producer: its ranks are known
                    self._releases.answered(load.spec)
                self._fail(load, reason, events)
        refused, self._to_fail = self._to_fail, {}
        for rid, load in refused.items():
            if self._loads.get(rid) is load:
                del self._loads[rid]
                self._fail(load, load.failure, events)
        self._expire(now, events)
        return events

    def _ended(self, rid: str, events: SchedulerEvents, failure: Optional[str]) -> Optional[_Load]:
        """The ranks reported the request's load ended (``failure``: why it failed): the load is
        forgotten, and an aborted one's blocks freed. Returns it when the request still waits for it."""
        load = self._loads.get(rid)
        if load is None or load.state not in (LoadState.LOADING, LoadState.CANCELLED):
            return None
        del self._loads[rid]
        if load.state is not LoadState.CANCELLED:
            return load
        events.free.append(rid)
        why = f" ({failure})" if failure is not None else ""
        logger.info("request %s: aborted load drained%s; freeing its blocks", rid, why)
        return None

    def _expire(self, now: float, events: SchedulerEvents) -> None:
        for timer in self._timers.due(now):
            rid = timer.key
            load = self._loads.get(rid)
            if load is None or load.state not in (LoadState.LOADING, LoadState.CANCELLED) \
                    or load.deadline != timer.deadline:
                continue
            del self._loads[rid]
            self._cancelled_out.append(rid)
            if load.state is LoadState.CANCELLED:
                logger.warning("request %s: aborted load never drained; freeing its blocks after timeout", rid)
                events.free.append(rid)
            else:
                self._fail(load, f"timed out after {now - load.started:.1f} s waiting for remote KV of transfer "
                                 f"{load.spec.transfer_id} from {load.spec.remote_host}:"
                                 f"{load.spec.remote_handshake_port}", events)

    def _fail(self, load: _Load, reason: str, events: SchedulerEvents) -> None:
        rid = load.request_id
        self._releases.of_load(load.spec, f"the load failed: {reason}"[:200])
        if self.config.load_failure_policy == "recompute":
            logger.warning("request %s: remote KV load failed (%s); recomputing the prefill locally", rid, reason)
            events.recompute.append(rid)
        else:
            logger.warning("request %s: remote KV load failed: %s", rid, reason)
            events.failed[rid] = f"remote KV load failed: {reason}"

    # ------------------------------------------------------------------
    # end of a request
    # ------------------------------------------------------------------
    def request_finished(self, request_id: str, block_ids: Sequence[int], *, aborted: bool = False,
                         first_token_ids: Sequence[int] = ()) -> tuple[bool, Optional[dict]]:
        """The request ended (finished or aborted) at any point: ``(True, None)`` while the
        ranks still read into its blocks (the load is cancelled; a later
        ``SchedulerEvents.free`` names it), else ``(False, None)``. Side effect: a request
        whose remote KV was not read yet releases its producer. Idempotent: calling it again
        answers the same and sends nothing more. Called by the engine's scheduler for every
        request it saw, whatever its state, on its thread."""
        match = self._matched.pop(request_id, None)
        if match is not None:
            if match.remote_tokens == 0:
                self._skip_load(request_id, match)  # served from the local cache; the engine never allocated through us
            else:
                self._releases.of_params(match.params, "the request ended before its blocks were allocated")
        load = self._loads.get(request_id)
        if load is None:
            return False, None
        if load.state in (LoadState.QUEUED, LoadState.REFUSED):
            del self._loads[request_id]
            self._to_start.pop(request_id, None)
            self._to_fail.pop(request_id, None)
            logger.info("request %s: aborted before its load started", request_id)
            self._releases.of_load(load.spec, "the request was aborted before its load started")
            return False, None
        if load.state is LoadState.LOADING:
            load.state = LoadState.CANCELLED
            self._cancelled_out.append(request_id)
            logger.info("request %s: %s while loading remote KV; blocks held until every rank stops",
                        request_id, "aborted" if aborted else "finished")
            self._releases.of_load(load.spec, "the request was aborted while loading")
        return True, None

    # ------------------------------------------------------------------
    def has_pending(self) -> bool:
        """True while a load is outstanding or the ranks have yet to hear of a cancelled one.
        No side effect; any number of calls."""
        return bool(self._loads or self._cancelled_out)

    def num_loads(self) -> int:
        return len(self._loads)

    def close(self) -> None:
        """Forgets every load and stops the release sender. Idempotent; called once by the
        engine's shutdown, after its last step."""
        if self._loads:
            logger.info("scheduler hooks closing with %d loads outstanding", len(self._loads))
        self._loads.clear()
        self._to_start.clear()
        self._to_fail.clear()
        self._matched.clear()
        self._timers.clear()
        self._close_sender()
