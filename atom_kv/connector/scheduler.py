"""Scheduler-side connector: which requests need remote KV, per-step
metadata, producer leases (delayed frees) and consumer load timeouts.

State machine per request (all transitions happen on the scheduler thread):

Producer (``kv_producer``)::

    get_num_new_matched_tokens(do_remote_decode) -> transfer id assigned (the
        request's own transfer_id when usable, else minted)
    request_finished -> lease(blocks, deadline = now + abort_timeout_s)
    finished_sending(tid) | deadline -> SchedulerEvents.free (once), metadata.released
        (the workers record released ids and tell a consumer that reads one
        afterwards that its read is invalid: its load fails)

Consumer (``kv_consumer``)::

    get_num_new_matched_tokens(do_remote_prefill) -> matched (blocks cached
        locally, num_computed_tokens, are not read again)
    update_state_after_alloc -> queued (LoadSpec in the next metadata), or,
        when nothing will be read (the whole prompt was cached, or the engine
        loads none of the remote tokens), released
    build_connector_meta -> loading (deadline = now + load budget, plus
        :func:`rendezvous_wait_s` for a rendezvous: params with
        ``remote_blocks_pending`` and no block ids; the workers learn them from
        the producer, :mod:`atom_kv.connector.rendezvous`)
    first_tokens (the rendezvous brought the prefill's sampled token, and the
        decode leg asked to continue from it: ``first_token_pending``) ->
        SchedulerEvents.first_tokens, while still loading
    finished_recving (reads done and confirmed by every producer rank read
        from) -> ready | failed_recving (incl. the producer's lease expired
        first, or no confirmation) / deadline -> failed or recompute
    abort while loading -> cancelled (metadata.cancelled) -> free once every
        rank reported (or the load deadline passed)

    Every end of a remote prefill here (read, failed, timed out, aborted at
    any point, skipped, params refused, request rejected by the engine:
    ``request_rejected``) sends one release to every producer rank
    (:mod:`atom_kv.connector.release`), so the producer frees the blocks at
    once instead of at its lease's end: to every rank of a producer a rank of
    this engine completed a handshake with, to the first rank only of any
    other (:mod:`atom_kv.connector.known_producers`). Releases are idempotent.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from atom_kv._lru import BoundedDict, BoundedSet
from atom_kv.addresses import kv_addresses
from atom_kv.config import KVTransferConfig
from atom_kv.connector.base import SchedulerHooks
from atom_kv.connector.known_producers import KnownProducers
from atom_kv.connector.params import ParamsIn, RequestParams
from atom_kv.connector.release import NoticeSender, ReleaseSpec, engine_sender
from atom_kv.connector.types import ConnectorMetadata, KVConnectorOutput, LoadSpec, SchedulerEvents, SendSpec
from atom_kv.wire import MAX_TRANSFER_ID_CHARS, KVTransferParams

__all__ = ["ConnectorScheduler", "load_backstop_s", "load_budget_s", "rendezvous_wait_s"]

logger = logging.getLogger(__name__)

#: Extra seconds the scheduler waits past a worker's own load budget (and
#: the time its last failed read may take to settle), so a worker always
#: gives up and stops writing into the blocks before the scheduler tells the
#: engine to free them.
SCHEDULER_SLACK_S = 2.0

_QUEUED, _LOADING, _CANCELLED = "queued", "loading", "cancelled"

#: finished-sending reports remembered until their lease exists
MAX_EARLY_DONE = 4096
#: transfer ids remembered after their lease ended (the workers remember as
#: many), so a request cannot adopt an id whose done-notices are still about
MAX_RECENT_TRANSFERS = 65536


def load_budget_s(config: KVTransferConfig) -> float:
    """Longest a worker spends on one load: handshake plus every read attempt and backoff."""
    attempts = config.transfer_retries + 1
    backoff = sum(config.transfer_retry_backoff_ms * (2**i) for i in range(config.transfer_retries)) / 1000.0
    return config.handshake_timeout_s + attempts * config.transfer_timeout_s + backoff


def rendezvous_wait_s(config: KVTransferConfig) -> float:
    """Longest a rendezvous load waits for its block ids: ``prefill_queue_timeout_s`` while the
    producer answers "still coming", at least one ``prefill_wait_timeout_s``."""
    return max(config.prefill_wait_timeout_s, config.prefill_queue_timeout_s)


def load_backstop_s(config: KVTransferConfig) -> float:
    """How long the scheduler waits for a load no rank reported: the workers' budget, plus one
    ``transfer_timeout_s`` for a read failed at its deadline to settle (backends stop writing
    within their I/O timeout), plus one ``handshake_timeout_s`` for the producer's confirmation
    of a finished read, plus slack."""
    return load_budget_s(config) + config.transfer_timeout_s + config.handshake_timeout_s + SCHEDULER_SLACK_S


@dataclass
class _Lease:
    request_id: str
    transfer_id: str
    block_ids: list[int]
    deadline: float


@dataclass
class _Match:
    """A consumer request whose remote KV will be read once blocks are allocated (its params parsed once)."""

    params: RequestParams
    num_prompt_tokens: int
    num_computed_tokens: int

    @property
    def remote_tokens(self) -> int:
        return max(0, self.num_prompt_tokens - self.num_computed_tokens)


@dataclass
class _Load:
    request_id: str
    spec: LoadSpec
    remote_tokens: int
    state: str = _QUEUED
    deadline: float = 0.0
    started: float = 0.0
    #: the decode leg continues from the prefill's first token, which the rendezvous brings
    wants_first_token: bool = False


@dataclass(order=True)
class _Timer:
    deadline: float
    seq: int
    kind: str = field(compare=False)
    key: str = field(compare=False)


class ConnectorScheduler(SchedulerHooks):
    """Owns per-request transfer state, producer leases and load timeouts for one
    engine, and (consumer) the sender of its releases.

    A request's ``kv_transfer_params`` enter at ``get_num_new_matched_tokens``
    (or ``request_rejected``) and are parsed there once into a
    :class:`~atom_kv.connector.params.RequestParams`, which every later step
    takes (an engine may pass one it parsed itself).

    ``release_sender(spec, reason)`` replaces the built-in
    :class:`~atom_kv.connector.release.NoticeSender` (started on the first
    release) when given. ``announce_sends`` (producer): also tell the engine's
    own ranks at once which blocks each transfer lent (an
    :class:`~atom_kv.wire.Issued` notice), for engines that pass the step's
    metadata to their ranks only with their next batch (ATOM): a rank confirms
    reads only of transfers it knows."""

    def __init__(
        self,
        config: KVTransferConfig,
        *,
        engine_id: str,
        host: str,
        tp_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        pp_size: int = 1,
        block_size: int,
        release_sender: Optional[Callable[[ReleaseSpec, str], None]] = None,
        announce_sends: bool = False,
    ) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.config = config
        self.engine_id = engine_id
        self.host = kv_addresses(config, host)[0]  # what prefill responses name as `remote_host`
        self.tp_size = tp_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.pp_size = pp_size
        self.block_size = block_size
        self._budget = load_backstop_s(config)
        # producer
        self._decode_tids: dict[str, str] = {}  # request id -> transfer id, until request_finished
        self._tid_owner: dict[str, str] = {}    # the same, by transfer id
        self._leases: dict[str, _Lease] = {}
        self._lease_by_req: dict[str, str] = {}
        self._early_done: BoundedDict[str, float] = BoundedDict(MAX_EARLY_DONE)  # tid -> when reported
        self._recent_tids: BoundedSet[str] = BoundedSet(MAX_RECENT_TRANSFERS)
        self._pending_sends: list[SendSpec] = []
        self._released: list[str] = []
        self._coming: list[str] = []   # admitted this step: the ranks answer "still coming" for them
        self._dropped: list[str] = []  # admitted, then ended without lending blocks
        # consumer
        self._matched: dict[str, _Match] = {}
        self._loads: dict[str, _Load] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        self._cancelled_out: list[str] = []
        self._failed_now: dict[str, str] = {}
        self._release_to = release_sender
        self._announce_sends = announce_sends
        self._sender: Optional[NoticeSender] = None
        self._releases_sent: BoundedSet[tuple[str, str, int]] = BoundedSet(MAX_RECENT_TRANSFERS)
        self._known = KnownProducers()  # how far a release fans out
        # timers (lazy deletion: a timer fires only if its state still matches)
        self._timers: list[_Timer] = []
        self._seq = itertools.count()

    # ------------------------------------------------------------------
    # admission
    # ------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self,
        request_id: str,
        num_prompt_tokens: int,
        kv_transfer_params: ParamsIn,
        num_computed_tokens: int = 0,
    ) -> tuple[int, bool]:
        # The one entry of a request's kv_transfer_params: parsed here, once (asked again about a
        # matched request, as ATOM does after its allocation, the match's params are used)
        if num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
        if self.config.is_producer:
            if kv_transfer_params and request_id not in self._decode_tids:
                self._register_send(request_id, RequestParams.of(kv_transfer_params))
            return 0, False
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
            self._release_params(params, "the decode engine refused its kv_transfer_params")
            return None
        if not params.wire.do_remote_prefill:
            return None
        missing = params.wire.missing_for_load()
        if missing is not None:
            logger.warning("request %s: ignoring kv_transfer_params (missing `%s`); prefilling locally",
                           request_id, missing)
            self._release_params(params, f"kv_transfer_params lack `{missing}`")
            return None
        return params

    def _register_send(self, request_id: str, params: RequestParams) -> None:
        if params.send_refusal is not None:
            logger.warning("request %s: ignoring kv_transfer_params (%s); its KV will not be kept for a remote "
                           "decode", request_id, params.send_refusal)
            return
        if not params.wire.do_remote_decode:
            return
        tid = self._transfer_id(request_id, params)
        self._decode_tids[request_id] = tid
        self._tid_owner[tid] = request_id
        self._coming.append(tid)

    def _transfer_id(self, request_id: str, params: RequestParams) -> str:
        """The request's own transfer id when it is usable here, else one minted from ours."""
        offered = params.offered_transfer_id
        if offered is not None:
            tid = params.adoptable_transfer_id
            if tid is not None and not self._transfer_id_taken(tid):
                return tid
            why = ("in use by another transfer" if tid is not None
                   else f"not 1..{MAX_TRANSFER_ID_CHARS} printable ASCII characters")
            logger.warning("request %s: not adopting transfer_id %.160r (%s); minting one", request_id, offered, why)
        return f"{self.engine_id}-{request_id}"

    def _transfer_id_taken(self, tid: str) -> bool:
        return tid in self._tid_owner or tid in self._leases or tid in self._recent_tids

    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        match = self._matched.pop(request_id, None)
        if match is None:
            return
        if match.remote_tokens == 0:
            self._skip_load(request_id, match)
            return
        if num_external_tokens <= 0:
            # the engine computes the prompt itself (vLLM does for prompt-logprobs requests)
            self._release_params(match.params, "the decode engine loads none of the remote tokens")
            return
        cached = match.num_computed_tokens // self.block_size
        if match.params.wire.remote_blocks_pending and not match.params.wire.remote_block_ids:
            self._queue_rendezvous(request_id, match, block_ids, cached)
            return
        remote_blocks = match.params.wire.remote_block_ids or []
        spec = self._load_spec(request_id, match, [int(b) for b in block_ids[cached: len(remote_blocks)]],
                               remote_blocks[cached:])
        self._loads[request_id] = _Load(request_id, spec, match.remote_tokens)
        if len(block_ids) < len(remote_blocks):
            self._failed_now[request_id] = (
                f"allocated {len(block_ids)} blocks but the producer sent {len(remote_blocks)}"
            )
            return
        if not spec.remote_block_ids:
            self._failed_now[request_id] = (
                f"the producer sent {len(remote_blocks)} blocks, all within the "
                f"{match.num_computed_tokens} tokens cached here, but {match.remote_tokens} tokens are missing"
            )
            return
        self._pending_loads[request_id] = spec

    def _queue_rendezvous(self, request_id: str, match: _Match, block_ids: Sequence[int], cached: int) -> None:
        """A load whose block ids the workers learn from the producer (the decode leg came before the
        prefill finished): the prompt's blocks past the cached ones are read."""
        needed = -(-match.num_prompt_tokens // self.block_size)
        spec = self._load_spec(request_id, match, [int(b) for b in block_ids[cached:needed]], [])
        spec.await_blocks = True
        self._loads[request_id] = _Load(request_id, spec, match.remote_tokens,
                                        wants_first_token=bool(match.params.wire.first_token_pending))
        if len(block_ids) < needed:
            self._failed_now[request_id] = f"allocated {len(block_ids)} blocks for a prompt of {needed}"
            return
        self._pending_loads[request_id] = spec

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
        self._release_params(match.params, "the whole prompt was cached on the decode engine")

    # ------------------------------------------------------------------
    # releases (consumer)
    # ------------------------------------------------------------------
    def _release_params(self, params: RequestParams, reason: str) -> None:
        spec = params.release_spec
        if spec is not None:
            self._release(spec, reason)

    def _release(self, spec: Optional[ReleaseSpec], reason: str) -> None:
        """Tell the producer ranks of ``spec`` that this engine will not read it (once): every
        rank of a producer a rank of this engine completed a handshake with, else the first rank only."""
        if spec is None:
            return
        key = (spec.transfer_id, spec.host, spec.handshake_port)
        if not spec.transfer_id or not spec.host or not spec.handshake_port or key in self._releases_sent:
            return
        self._releases_sent.add(key)
        spec = self._known.reach(spec)
        if self._release_to is not None:
            self._release_to(spec, reason)
            return
        self._notices().release(spec, reason)

    def _notices(self) -> NoticeSender:
        if self._sender is None:
            role = "prefill" if self.config.is_producer else "decode"
            self._sender = NoticeSender(auth_token=self.config.auth_token, sender=engine_sender(role, self.engine_id),
                                        proof_timeout_s=self.config.handshake_timeout_s,
                                        close_wait_s=self.config.release_close_wait_s)
        return self._sender

    def request_rejected(self, kv_transfer_params: ParamsIn) -> None:
        self._release_params(RequestParams.of(kv_transfer_params), "the decode engine rejected the request")

    # ------------------------------------------------------------------
    # per step
    # ------------------------------------------------------------------
    def build_connector_meta(self) -> ConnectorMetadata:
        now = time.monotonic()
        loads = list(self._pending_loads.values())
        for spec in loads:
            load = self._loads[spec.request_id]
            load.state = _LOADING
            load.started = now
            load.deadline = now + self._budget + (rendezvous_wait_s(self.config) if spec.await_blocks else 0.0)
            self._add_timer(load.deadline, "load", spec.request_id)
            logger.debug("request %s: loading %d blocks of %s", spec.request_id, len(spec.block_ids), spec.transfer_id)
        meta = ConnectorMetadata(
            loads=loads,
            sends=self._pending_sends,
            released=self._released,
            cancelled=self._cancelled_out,
            coming=self._coming,
            dropped=self._dropped,
        )
        self._pending_loads = {}
        self._pending_sends = []
        self._released = []
        self._cancelled_out = []
        self._coming = []
        self._dropped = []
        return meta

    def has_metadata(self) -> bool:
        return bool(self._pending_loads or self._pending_sends or self._released or self._cancelled_out
                    or self._coming or self._dropped)

    def update_connector_output(self, output: KVConnectorOutput, now: Optional[float] = None) -> SchedulerEvents:
        now = time.monotonic() if now is None else now
        events = SchedulerEvents()
        for tid in output.finished_sending:
            if tid in self._leases:
                self._free_lease(tid, events, "all consumer ranks finished reading")
            else:
                # reported before request_finished created the lease (or late): remember a bounded few
                self._early_done[tid] = now
        for rid, tokens in output.first_tokens.items():
            load = self._loads.get(rid)
            if load is not None and load.state == _LOADING and load.wants_first_token:
                load.wants_first_token = False  # once
                events.first_tokens[rid] = list(tokens)
        for rid in output.finished_recving:
            load = self._ended_load(rid, events, None)
            if load is not None:
                events.ready.append(rid)
                logger.debug("request %s: remote KV loaded in %.3f s", rid, now - load.started)
                self._answered(load.spec)  # every rank read from answered its handshake
                self._release(ReleaseSpec.from_load(load.spec), "read")
        reached = set(output.reached)
        for rid, reason in output.failed_recving.items():
            load = self._ended_load(rid, events, reason)
            if load is not None:
                if rid in reached:  # a rank completed a handshake with the producer: its ranks are known
                    self._answered(load.spec)
                self._apply_policy(rid, reason, events, load)
        for rid, reason in self._failed_now.items():
            load = self._loads.pop(rid, None)
            if load is not None:
                self._apply_policy(rid, reason, events, load)
        self._failed_now.clear()
        self._expire(now, events)
        return events

    def _answered(self, spec: LoadSpec) -> None:
        """A rank completed a handshake with the producer ``spec`` reads from: releases go to all its ranks."""
        producer = ReleaseSpec.from_load(spec)
        if producer is not None:
            self._known.answered(producer)

    def _ended_load(self, rid: str, events: SchedulerEvents, failure: Optional[str]) -> Optional[_Load]:
        """The ranks reported the request's load ended (``failure``: why it failed): the load is
        forgotten, and an aborted one's blocks freed. Returns it when the request still waits for it."""
        load = self._loads.get(rid)
        if load is None or load.state == _QUEUED:
            return None
        del self._loads[rid]
        if load.state != _CANCELLED:
            return load
        events.free.append(rid)
        why = f" ({failure})" if failure is not None else ""
        logger.info("request %s: aborted load drained%s; freeing its blocks", rid, why)
        return None

    def _expire(self, now: float, events: SchedulerEvents) -> None:
        early = []
        for tid, at in self._early_done.items():  # oldest first
            if now - at <= self.config.abort_timeout_s:
                break
            early.append(tid)
        for tid in early:  # a report whose lease never came: forgotten after one lease time
            del self._early_done[tid]
        while self._timers and self._timers[0].deadline <= now:
            timer = heapq.heappop(self._timers)
            if timer.kind == "lease":
                lease = self._leases.get(timer.key)
                if lease is not None and lease.deadline == timer.deadline:
                    logger.warning(
                        "request %s: lease on %d blocks of transfer %s expired after %.1f s without all "
                        "consumers reading; freeing them",
                        lease.request_id, len(lease.block_ids), lease.transfer_id, self.config.abort_timeout_s,
                    )
                    self._free_lease(lease.transfer_id, events, None)
                continue
            load = self._loads.get(timer.key)
            if load is None or load.deadline != timer.deadline:
                continue
            del self._loads[timer.key]
            self._cancelled_out.append(timer.key)
            if load.state == _CANCELLED:
                logger.warning("request %s: aborted load never drained; freeing its blocks after timeout", timer.key)
                events.free.append(timer.key)
            else:
                self._apply_policy(
                    timer.key,
                    f"timed out after {now - load.started:.1f} s waiting for remote KV of transfer "
                    f"{load.spec.transfer_id} from {load.spec.remote_host}:{load.spec.remote_handshake_port}",
                    events,
                    load,
                )

    def _apply_policy(self, rid: str, reason: str, events: SchedulerEvents, load: _Load) -> None:
        self._release(ReleaseSpec.from_load(load.spec), f"the load failed: {reason}"[:200])
        if self.config.load_failure_policy == "recompute":
            logger.warning("request %s: remote KV load failed (%s); recomputing the prefill locally", rid, reason)
            events.recompute.append(rid)
        else:
            logger.warning("request %s: remote KV load failed: %s", rid, reason)
            events.failed[rid] = f"remote KV load failed: {reason}"

    def _free_lease(self, tid: str, events: SchedulerEvents, why: Optional[str]) -> None:
        lease = self._leases.pop(tid)
        self._lease_by_req.pop(lease.request_id, None)
        self._recent_tids.add(tid)
        events.free.append(lease.request_id)
        self._released.append(tid)
        if why:
            logger.debug("request %s: freeing %d blocks of transfer %s (%s)", lease.request_id, len(lease.block_ids), tid, why)

    def _add_timer(self, deadline: float, kind: str, key: str) -> None:
        heapq.heappush(self._timers, _Timer(deadline, next(self._seq), kind, key))

    # ------------------------------------------------------------------
    # end of a request
    # ------------------------------------------------------------------
    def request_finished(
        self, request_id: str, block_ids: Sequence[int], *, aborted: bool = False,
        first_token_ids: Sequence[int] = (),
    ) -> tuple[bool, Optional[dict]]:
        if self.config.is_producer:
            return self._producer_finished(request_id, block_ids, aborted, first_token_ids)
        return self._consumer_finished(request_id, aborted)

    def _producer_finished(self, rid: str, block_ids: Sequence[int], aborted: bool,
                           first_token_ids: Sequence[int]) -> tuple[bool, Optional[dict]]:
        if rid in self._lease_by_req:
            return True, None  # already leased; the consumer may be reading
        tid = self._decode_tids.pop(rid, None)
        if tid is not None:
            del self._tid_owner[tid]
        if tid is None:
            return False, None
        if aborted or not block_ids:
            self._dropped.append(tid)  # a rank holding a rendezvous question on it answers at once
        if aborted:
            return False, None
        blocks = [int(b) for b in block_ids]
        params = KVTransferParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=blocks,
            remote_engine_id=self.engine_id,
            remote_host=self.host,
            remote_port=self.config.handshake_port,
            remote_handshake_port=self.config.handshake_port,
            remote_tp_size=self.tp_size,
            remote_dp_rank=self.dp_rank,
            tp_size=self.tp_size,
            dp_rank=self.dp_rank,
            remote_dp_size=self.dp_size if self.dp_size > 1 else None,
            remote_pp_size=self.pp_size if self.pp_size > 1 else None,
            transfer_id=tid,
        ).to_dict()
        first = [int(t) for t in first_token_ids]
        if first:
            params["first_token_ids"] = first
        if not blocks:
            return False, params
        deadline = time.monotonic() + self.config.abort_timeout_s
        self._leases[tid] = _Lease(rid, tid, blocks, deadline)
        self._lease_by_req[rid] = tid
        self._pending_sends.append(SendSpec(transfer_id=tid, block_ids=blocks, first_token_ids=first))
        if self._announce_sends:  # the ranks may see this step's metadata only with the next batch
            own = ReleaseSpec.bounded(tid, self.host, self.config.handshake_port, self.tp_size, self.dp_rank,
                                      self.pp_size, self.dp_size)
            if own is not None:  # None: an OS-assigned handshake port (tests), where no notice can go
                self._notices().issue(own, blocks)
        self._add_timer(deadline, "lease", tid)
        if self._early_done.pop(tid, None) is not None:
            self._leases[tid].deadline = 0.0  # already read or released: free on the next update
            self._add_timer(0.0, "lease", tid)
        logger.debug("request %s: holding %d blocks for transfer %s", rid, len(blocks), tid)
        return True, params

    def _consumer_finished(self, rid: str, aborted: bool) -> tuple[bool, Optional[dict]]:
        match = self._matched.pop(rid, None)
        if match is not None:
            if match.remote_tokens == 0:
                self._skip_load(rid, match)  # served from the local cache; the engine never allocated through us
            else:
                self._release_params(match.params, "the request ended before its blocks were allocated")
        load = self._loads.get(rid)
        if load is None:
            return False, None
        if load.state == _QUEUED:
            del self._loads[rid]
            self._pending_loads.pop(rid, None)
            self._failed_now.pop(rid, None)
            logger.info("request %s: aborted before its load started", rid)
            self._release(ReleaseSpec.from_load(load.spec), "the request was aborted before its load started")
            return False, None
        if load.state == _LOADING:
            load.state = _CANCELLED
            self._cancelled_out.append(rid)
            logger.info("request %s: %s while loading remote KV; blocks held until every rank stops",
                        rid, "aborted" if aborted else "finished")
            self._release(ReleaseSpec.from_load(load.spec), "the request was aborted while loading")
        return True, None

    # ------------------------------------------------------------------
    def has_pending(self) -> bool:
        return bool(self._leases or self._loads or self._pending_sends or self._released or self._cancelled_out)

    def num_leases(self) -> int:
        return len(self._leases)

    def num_loads(self) -> int:
        return len(self._loads)

    def close(self) -> None:
        if self._leases or self._loads:
            logger.info("scheduler hooks closing with %d leases and %d loads outstanding",
                        len(self._leases), len(self._loads))
        self._leases.clear()
        self._lease_by_req.clear()
        self._decode_tids.clear()
        self._tid_owner.clear()
        self._loads.clear()
        self._pending_loads.clear()
        self._matched.clear()
        self._timers.clear()
        if self._sender is not None:
            self._sender.close()
