"""ATOM's scheduler-side connector (``"kv_connector": "atom_kv"``).

ATOM's ``Scheduler`` builds it through ``KVConnectorFactory`` with the engine
``Config`` and calls it with ``Sequence`` objects (integer ``seq.id``,
``seq.kv_transfer_params`` in, ``seq.kv_transfer_params_output`` out). It
translates those calls onto atom-kv's :class:`~atom_kv.engine_hooks.SchedulerHooks`
and ATOM's aggregated :class:`KVConnectorOutput` back, once per poll, in
:meth:`AtomKVScheduler.process_completions`.

What ATOM main (ffdf3bb5d) does with each answer, and what this class does
about the rest:

- **Producer.** ATOM defers the blocks of *every* finished request of a
  producer until ``finished_sending`` names it. Requests that lend their
  blocks are named when every consumer rank has read them or their lease
  (``abort_timeout_s``) expired; every other finished request at the next poll.
- **Consumer, load done.** ``finished_recving`` names the request; ATOM
  schedules its first decode. With ATOM's KV cache events on
  (``kv_events_config``, ``ATOM_KV_EVENTS_*``) and its prefix cache on, ATOM
  itself then hashes the loaded prompt blocks and publishes those past the
  local prefix hit as ``BlockStored`` with medium ``REMOTE``
  (``Scheduler._update_waiting_for_remote_kv`` calls
  ``BlockManager.record_remote_store``). So the connector names a load there
  only once every rank has read it, and never calls ``record_remote_store``
  itself: the blocks would be published twice. With the prefix cache off,
  ATOM publishes no blocks at all (the connector says so at start).
- **Consumer, load failed.** ATOM answers ``failed_recving`` by admitting the
  request again, which asserts that it holds no blocks. So the connector
  gives the blocks back first, then: ``load_failure_policy: recompute``
  reports it failed (ATOM prefills it locally), ``fail`` ends it the way ATOM
  ends a request whose client went away (status ``ABORTED``; the response's
  finish reason is ``aborted``, the log says why).
- **Consumer, aborted while loading.** ATOM drops an aborted waiting request
  without freeing its blocks or telling the connector. The connector notices
  (``seq.status``) at the next call, cancels the load, and frees the blocks
  once no rank can still be writing them.
- **Consumer, ended while queued.** ATOM ends a waiting request that was
  aborted (or can never be scheduled) in ``schedule()`` and hands it to
  ``take_rejected()``, never to the connector, often before the connector
  ever saw it. The connector reads what ``take_rejected()`` returns and sends
  the producer its release at once, so the prefill's blocks do not wait for
  their lease.

Freeing a consumer's blocks needs ATOM's ``BlockManager``. Where ATOM passes
it (``block_manager=``, docs/atom-upstream.md), ATOM also reports what it
ends while queued through :meth:`AtomKVScheduler.request_finished`. ATOM main
passes nothing: a consumer then takes the ``Scheduler`` that constructs it
(the caller's ``self``; ATOM builds its connector inside
``Scheduler.__init__``), after :func:`~.contract.check_scheduler` found it as
verified, and watches its ``take_rejected()``.
"""

from __future__ import annotations

import logging
import math
import sys
import uuid
from collections.abc import Mapping
from typing import Any, Optional

from atom.kv_transfer.disaggregation.base import KVConnectorSchedulerBase
from atom.kv_transfer.disaggregation.types import KVConnectorOutput as AtomKVConnectorOutput
from atom.model_engine.sequence import SequenceStatus

from atom_kv import engine_hooks
from atom_kv.config import ConfigError
from atom_kv.engine_hooks.types import ConnectorMetadata, KVConnectorOutput
from atom_kv.integrations.atom.contract import check_scheduler, constructing_scheduler
from atom_kv.integrations.atom.metadata import AtomKVMetadata
from atom_kv.integrations.atom.sequences import SeqState, SequenceTable
from atom_kv.integrations.atom.settings import AtomEngine, advertised_host, require_completion_contract
from atom_kv.integrations.request_guard import asks, matched_tokens

__all__ = ["AtomKVScheduler"]

logger = logging.getLogger(__name__)

_GONE = (SequenceStatus.ABORTED, SequenceStatus.FINISHED)
_REMEMBERED = 65536  # ids of sequences that never load again (SeqState.LOCAL), kept for later calls
#: consumer states of a request the connector still acts for (matched, loading, loaded or draining)
_TRACKED = (SeqState.MATCHED, SeqState.LOADING, SeqState.LOADED, SeqState.DRAINING)
_PRODUCER_FINISHED = (SeqState.LENT, SeqState.FREE_NOW)
#: ATOM's aggregated output has no reasons; each rank's worker logs its own.
_RANK_FAILURE = "a TP rank could not load it (that rank's log names the cause)"


class AtomKVScheduler(KVConnectorSchedulerBase):
    """Owns the translation between ATOM's ``Sequence`` calls and atom-kv's
    scheduler hooks, one record per sequence it tracks (:class:`~.sequences.SequenceTable`:
    parked for a remote load, lent, draining, ...), and the blocks ATOM leaves the
    connector to free. Called only from ATOM's scheduler thread."""

    is_offload = False

    def __init__(self, config: Any, *, host: Optional[str] = None, block_manager: Any = None) -> None:
        require_completion_contract(AtomKVConnectorOutput)
        engine = AtomEngine.from_config(config)
        kv = engine.kv
        self.is_producer = kv.is_producer
        self.engine_id = kv.engine_id or f"atom-{uuid.uuid4().hex[:12]}"
        self.host = host or kv.advertise_host or advertised_host()
        self.block_size = engine.block_size
        self._engine = engine
        self._block_manager = block_manager
        if not self.is_producer and _kv_events_on(config) and not getattr(config, "enable_prefix_caching", False):
            logger.warning("atom_kv: ATOM's KV cache events are on but its prefix caching is off, so ATOM publishes "
                           "none of the blocks this decode engine computes or loads from a producer (medium "
                           "REMOTE) and a router following its events learns nothing; turn prefix caching on")
        if block_manager is None and not self.is_producer:
            owner = constructing_scheduler(sys._getframe(1))
            if owner is None:
                raise RuntimeError(
                    "atom_kv: a kv_consumer needs the BlockManager of the ATOM Scheduler that builds it (to free "
                    "the blocks of failed and aborted loads), and none was found on the call stack; this ATOM builds "
                    "its connector differently from ATOM main ffdf3bb5d (see docs/atom-upstream.md)"
                )
            check_scheduler(owner)
            self._block_manager = owner.block_manager
            _watch_rejections(owner, self._ended_while_queued)
        # ATOM hands metadata to its ranks only with a batch: an idle producer's ranks hear of
        # a finished prefill's transfer directly, so they can confirm its read in time
        self._hooks = engine_hooks.build_scheduler_hooks(
            kv, engine_id=self.engine_id, host=self.host, tp_size=engine.tp_size, dp_rank=engine.dp_rank,
            dp_size=engine.dp_size, pp_size=engine.pp_size, block_size=engine.block_size,
            announce_sends=kv.is_producer,
        )
        self._seqs = SequenceTable(_REMEMBERED)  # every sequence the connector tracks, in one SeqState each
        self._held: Optional[ConnectorMetadata] = None  # metadata built while idle, sent with the next batch
        self._announcer: Optional[_Announcer] = None
        if kv.proxy_addresses and engine.dp_rank == 0 and engine.pp_rank == 0:  # ATOM's head stage schedules
            self._announcer = _Announcer(self, engine, _announced_events(config, engine))
        logger.info("atom_kv %s connector for engine %s (TP %d, DP rank %d, block %d) advertises %s",
                    kv.kv_role, self.engine_id, engine.tp_size, engine.dp_rank, engine.block_size, self.host)

    # ------------------------------------------------------------------
    # admission
    # ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Any) -> tuple[int, bool]:
        """``(prompt tokens that arrive from the producer, True)`` for a consumer
        request with ``do_remote_prefill``; ``(0, False)`` otherwise (producer:
        registers a request with ``do_remote_decode``). ``kv_transfer_params``
        that are not an object, or that the connector refuses, cost the request
        its KV transfer only (one logged line), never ATOM's scheduler."""
        return matched_tokens("ATOM seq", seq.id, lambda: self._matched_tokens(seq), on_error=lambda: self._drop(seq))

    def _matched_tokens(self, seq: Any) -> tuple[int, bool]:
        sid = seq.id
        params = seq.kv_transfer_params
        if self.is_producer:
            self._hooks.get_num_new_matched_tokens(str(sid), seq.num_prompt_tokens, params)
            if asks(params, "do_remote_decode") and self._seqs.state(sid) in (None, SeqState.MATCHED):
                self._seqs.put(sid, seq, SeqState.MATCHED)  # until allocated: an abort before that must unregister it
            return 0, False
        if not params or (isinstance(params, Mapping) and not params.get("do_remote_prefill")):
            return 0, False  # not a remote prefill (params that are not an object: the connector says why)
        if self._seqs.state(sid) not in (None, SeqState.MATCHED):
            return 0, False  # loaded, failed or preempted before: its KV is computed here from now on
        n, is_async = self._hooks.get_num_new_matched_tokens(str(sid), seq.num_prompt_tokens, params)
        if is_async:
            self._seqs.put(sid, seq, SeqState.MATCHED)
        return n, is_async

    def _drop(self, seq: Any) -> None:
        """The connector raised on ``seq``: forget it, and have the connector drop (and release) what it holds."""
        self._seqs.take(seq.id, SeqState.MATCHED)
        self._hooks.request_finished(str(seq.id), [], aborted=True)

    def update_state_after_alloc(self, seq: Any) -> None:
        """ATOM allocated the request's blocks: queue the load into ``seq.block_table``.

        ATOM looks its prefix cache up after asking the connector, so only
        here is the local hit (``seq.num_cached_tokens``) known: the request
        is matched again with it, and only blocks past the hit are read.
        """
        sid = seq.id
        if self._seqs.take(sid, SeqState.MATCHED) is None or self.is_producer:
            return
        rid, cached = str(sid), int(seq.num_cached_tokens or 0)

        def queue_load() -> tuple[int, bool]:
            remote, is_async = self._hooks.get_num_new_matched_tokens(rid, seq.num_prompt_tokens,
                                                                      seq.kv_transfer_params,
                                                                      num_computed_tokens=cached)
            self._hooks.update_state_after_alloc(rid, list(seq.block_table), remote)
            return remote, is_async

        _, is_async = matched_tokens("ATOM seq", sid, queue_load, on_error=lambda: self._drop(seq))
        if is_async:
            self._seqs.put(sid, seq, SeqState.LOADING)

    def should_park_for_load_after_alloc(self, seq: Any) -> bool:
        """ATOM parks the request (``WAITING_FOR_REMOTE_KVS``) while its load runs."""
        return self._seqs.state(seq.id) is SeqState.LOADING

    # ------------------------------------------------------------------
    # every step
    # ------------------------------------------------------------------
    def build_connector_meta(self) -> AtomKVMetadata:
        """This step's metadata for every TP rank (ATOM sends it before the forward), with
        whatever was held back while ATOM was idle."""
        self._reconcile()
        step = self._hooks.build_connector_meta()
        if self._held is not None:
            step, self._held = _merged(self._held, step), None
        return AtomKVMetadata(self.engine_id, step)

    def process_completions(self, output: AtomKVConnectorOutput) -> AtomKVConnectorOutput:
        """ATOM's aggregated worker output in, what ATOM's scheduler must act on out (ATOM's sequence ids).

        Also where leases and load deadlines expire: ATOM polls every step and,
        while any connector work is pending, when idle. Last, it holds what the
        ranks must hear for the next batch (:meth:`hold_rank_notices`).
        """
        self._reconcile()
        events = self._hooks.update_connector_output(KVConnectorOutput(
            finished_sending=[str(x) for x in output.finished_sending or ()],
            finished_recving=[str(x) for x in output.finished_recving or ()],
            failed_recving={str(x): _RANK_FAILURE for x in getattr(output, "failed_recving", None) or ()},
        ))
        out = self._producer_completions(events) if self.is_producer else self._consumer_completions(events)
        self.hold_rank_notices()
        return out

    def _producer_completions(self, events: engine_hooks.SchedulerEvents) -> AtomKVConnectorOutput:
        out = AtomKVConnectorOutput()
        freed = [sid for sid, _ in self._seqs.each(SeqState.FREE_NOW)] + [int(rid) for rid in events.free]
        for sid in freed:
            self._seqs.take(sid, *_PRODUCER_FINISHED)
        out.finished_sending = set(freed)
        return out

    def _consumer_completions(self, events: engine_hooks.SchedulerEvents) -> AtomKVConnectorOutput:
        out = AtomKVConnectorOutput()
        for rid in events.ready:
            seq = self._seqs.take(int(rid), SeqState.LOADING)
            if seq is None:
                continue
            self._seqs.put(seq.id, seq, SeqState.LOADED)  # and never loads again
            out.finished_recving.add(seq.id)
        for rid in events.recompute:
            seq = self._give_back(int(rid))
            if seq is not None:
                out.failed_recving.add(seq.id)
        for rid, reason in events.failed.items():
            seq = self._give_back(int(rid))
            if seq is not None:
                logger.error("ATOM seq %s (request %s): %s; ending it (load_failure_policy: fail)", rid,
                             getattr(seq, "external_request_id", None), reason)
                seq.status = SequenceStatus.ABORTED  # ATOM's own abort path ends it at the next schedule
        for rid in events.free:
            seq = self._seqs.take(int(rid), SeqState.DRAINING)
            if seq is not None:
                self._deallocate(seq)
        return out

    def hold_rank_notices(self) -> None:
        """Take what the ranks must hear (released and cancelled transfers, sends) out of the hooks now, and
        send it with the next batch's metadata.

        ATOM sends metadata only with a batch, and keeps polling an idle engine while
        :meth:`has_pending_work` says so: notices held here wait for the next batch instead
        of keeping ATOM polling. That is safe because every forward, the only thing that
        overwrites blocks, follows its batch's metadata. :meth:`process_completions` calls it
        after every poll.
        """
        if self._hooks.has_pending() or self._hooks.has_metadata():
            step = self._hooks.build_connector_meta()
            self._held = step if self._held is None else _merged(self._held, step)

    def has_pending_work(self) -> bool:
        """True while a load, lease or block release is outstanding (ATOM keeps polling while idle).

        A query only: ATOM asks it when idle, as often as it likes; what would keep
        it polling for nothing (notices for the ranks) the next poll holds
        (:meth:`hold_rank_notices`)."""
        return self._hooks.has_pending() or self._seqs.has_pending()

    # ------------------------------------------------------------------
    # end of a request
    # ------------------------------------------------------------------
    def request_finished(self, seq: Any) -> None:
        """A request finished or was aborted while running. A producer puts the
        decode leg's parameters in ``seq.kv_transfer_params_output`` and keeps
        the prompt's blocks while consumers read them."""
        sid = seq.id
        aborted = seq.status == SequenceStatus.ABORTED or getattr(seq, "leave_reason", None) == "aborted"
        was_matched = self._seqs.take(sid, SeqState.MATCHED) is not None
        if self.is_producer:
            if self._seqs.state(sid) in _PRODUCER_FINISHED:
                return  # ATOM calls twice for a streamed request (stream output, then the finish loop)
            prompt_blocks = math.ceil(seq.num_prompt_tokens / self.block_size)
            delay, params = self._hooks.request_finished(str(sid), list(seq.block_table[:prompt_blocks]),
                                                         aborted=aborted)
            if params is not None:
                seq.kv_transfer_params_output = _decode_leg_params(seq, params)
            self._seqs.put(sid, seq, SeqState.LENT if delay else SeqState.FREE_NOW)
            return
        state = self._seqs.state(sid)
        if not was_matched and not seq.block_table and state not in _TRACKED:
            self._release_unloaded(seq)  # ended while queued (ATOM with docs/atom-upstream.md reports it here)
            return
        if state in (SeqState.LOADED, SeqState.LOCAL):
            self._seqs.take(sid)  # a loaded request is LOCAL once it runs
        delay, _ = self._hooks.request_finished(str(sid), list(seq.block_table), aborted=aborted)
        if state is SeqState.LOADED:
            self._deallocate(seq)  # ended while queued after its load: ATOM frees only what ran
            return
        if delay and state is SeqState.LOADING:
            self._seqs.put(sid, seq, SeqState.DRAINING)

    def should_defer_free(self, seq: Any) -> bool:
        """True while a rank may still write the request's blocks (a consumer) or
        a consumer may still read them (a producer); ATOM then keeps them."""
        if self.is_producer:
            return self._seqs.state(seq.id) in _PRODUCER_FINISHED
        return self._seqs.state(seq.id) is SeqState.DRAINING

    def _ended_while_queued(self, seqs: list) -> None:
        """What ATOM's ``take_rejected()`` returned: requests it ended in ``schedule()`` while they
        waited (aborted, or unschedulable), without telling the connector."""
        for seq in seqs:
            if self._seqs.state(seq.id) not in _TRACKED and not seq.block_table:
                self._release_unloaded(seq)
        self._reconcile()  # the ones it knew (matched, loading, loaded) are FINISHED now

    def _release_unloaded(self, seq: Any) -> None:
        """A remote-prefill request that ends before its load was queued: the producer frees its blocks now,
        not when their lease expires."""
        params = seq.kv_transfer_params
        if isinstance(params, dict) and params.get("do_remote_prefill"):
            logger.info("ATOM seq %s (request %s) ended before its KV load (%s); releasing the prefill's blocks",
                        seq.id, getattr(seq, "external_request_id", None), getattr(seq, "leave_reason", None))
            self._hooks.request_rejected(params)

    # ------------------------------------------------------------------
    def _reconcile(self) -> None:
        """Catch up with requests ATOM dropped without telling the connector
        (an abort while matched, parked or loaded sets ``seq.status``)."""
        for sid, seq in self._seqs.each(SeqState.MATCHED):
            if seq.status in _GONE:
                self._seqs.take(sid)
                self._hooks.request_finished(str(sid), [], aborted=True)
        if self.is_producer:
            return
        for sid, seq in self._seqs.each(SeqState.LOADING):
            if seq.status in _GONE:
                delay, _ = self._hooks.request_finished(str(sid), list(seq.block_table), aborted=True)
                if delay:
                    self._seqs.put(sid, seq, SeqState.DRAINING)  # freed when every rank stopped (events.free)
                else:
                    self._seqs.take(sid)
                    self._deallocate(seq)
        for sid, seq in self._seqs.each(SeqState.LOADED):
            if seq.status in _GONE:
                self._seqs.put(sid, seq, SeqState.LOCAL)
                self._deallocate(seq)  # loaded, then aborted before its first decode
            elif seq.status == SequenceStatus.RUNNING:
                self._seqs.put(sid, seq, SeqState.LOCAL)  # ATOM owns it now

    def _give_back(self, sid: int) -> Any:
        """A failed load: free its blocks so ATOM may admit the request again (never to load again)."""
        seq = self._seqs.take(sid, SeqState.LOADING)
        if seq is None:
            return None
        self._deallocate(seq)
        self._seqs.put(sid, seq, SeqState.LOCAL)
        return seq

    def _deallocate(self, seq: Any) -> None:
        if seq.block_table:
            logger.debug("ATOM seq %s: freeing %d blocks", seq.id, len(seq.block_table))
            self._block_manager.deallocate(seq)

    def close(self) -> None:
        """Stop announcing the engine and release the scheduler hooks' state."""
        if self._announcer is not None:
            self._announcer.close()
        self._hooks.close()


def _kv_events_on(config: Any) -> bool:
    """Whether ATOM publishes KV cache events (its ``Config.kv_events_config``, from ``ATOM_KV_EVENTS_*``)."""
    events = getattr(config, "kv_events_config", None)
    return bool(getattr(events, "enable", False)) and getattr(events, "publisher", "zmq") != "null"


def _announced_events(config: Any, engine: AtomEngine) -> Optional[str]:
    """ATOM's KV event publisher, for the registration ping (proxies then follow it): its endpoint where ATOM's
    events are on and a proxy can follow them, else None (with one line saying why not)."""
    if not _kv_events_on(config):
        return None
    endpoint = str(getattr(config.kv_events_config, "endpoint", "") or "")
    if engine.dp_size > 1:
        logger.warning("atom_kv: ATOM's KV cache events are on with data_parallel_size %d, but ATOM publishes "
                       "every DP rank on the one endpoint %s while proxies follow DP rank N at its port + N: the "
                       "registration ping does not announce them", engine.dp_size, endpoint)
        return None
    if not endpoint.startswith("tcp://"):
        logger.warning("atom_kv: ATOM's KV event endpoint %r is not tcp://HOST:PORT, which is all a proxy "
                       "follows: the registration ping does not announce it", endpoint)
        return None
    return endpoint


def _merged(first: ConnectorMetadata, then: ConnectorMetadata) -> ConnectorMetadata:
    """Two steps' metadata as one (every field is a list of things to do)."""
    return ConnectorMetadata(**{f: getattr(first, f) + getattr(then, f) for f in ConnectorMetadata.__struct_fields__})


def _decode_leg_params(seq: Any, params: dict) -> dict:
    """The producer's ``kv_transfer_params`` plus what ATOM's decode side uses:
    the first sampled token (and drafts), which it appends before the first decode."""
    out = dict(params)
    out["first_token_id"] = int(seq.output_tokens[0]) if getattr(seq, "output_tokens", None) else None
    drafts = getattr(seq, "spec_token_ids", None)
    out["draft_token_ids"] = [int(t) for t in drafts] if drafts is not None and len(drafts) else []
    out["prefix_cache_hit_tokens"] = int(getattr(seq, "prefix_cache_hit_tokens", 0) or 0)
    return out


def _watch_rejections(scheduler: Any, ended: Any) -> None:
    """Route what ATOM's ``take_rejected()`` returns through ``ended`` too (ATOM's engine core calls it after
    every ``schedule()``); checked by :func:`~.contract.check_scheduler` first."""
    take = scheduler.take_rejected

    def take_rejected() -> list:
        seqs = take()
        if seqs:
            try:
                ended(seqs)
            except Exception:  # never break ATOM's engine step; the prefill's lease frees its blocks instead
                logger.exception("atom_kv: could not release the prefill blocks of requests ATOM ended while queued")
        return seqs

    scheduler.take_rejected = take_rejected


class _Announcer:
    """Registers the engine with atom-kv's proxies once ATOM's HTTP server accepts connections.

    ATOM builds its scheduler before its HTTP server listens; pinging earlier
    would have the proxy probe a port nobody answers yet.
    """

    def __init__(self, owner: AtomKVScheduler, engine: AtomEngine, kv_events: Optional[str] = None) -> None:
        kv = engine.kv
        if kv.http_port is None:
            raise ConfigError("kv-transfer-config: `http_port` must be ATOM's --server-port to register with a proxy "
                              "(`proxy_ip` is set), got null")
        self.http_port = kv.http_port
        self.host = owner.host
        self._pinger = engine_hooks.build_registration_pinger(
            kv, role="P" if kv.is_producer else "D", index=str(self.http_port), http_host=owner.host,
            http_port=self.http_port, tp_size=engine.tp_size, dp_size=engine.dp_size, engine_id=owner.engine_id,
            model=engine.model, wait_until_serving=True, kv_events_endpoint=kv_events,
        ).start()

    def close(self) -> None:
        # ATOM tells the connector nothing before it stops: its close is the first word; a draining ping
        # still takes the engine out of routing now instead of at the proxy's heartbeat timeout
        self._pinger.leave(min(1.0, self._pinger.answer_timeout_s))
        self._pinger.close()
