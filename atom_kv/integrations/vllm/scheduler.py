"""The scheduler side of the vLLM connector: atom-kv's SchedulerHooks in vLLM's scheduler process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import RequestStatus

from atom_kv import engine_hooks
from atom_kv.config import KVTransferConfig
from atom_kv.engine_hooks import KVConnectorOutput
from atom_kv.integrations.vllm.layout import kv_shape
from atom_kv.integrations.vllm.ledger import SchedulerLedger
from atom_kv.integrations.vllm.metadata import AtomKVConnectorMetadata, AtomKVWorkerMetadata
from atom_kv.integrations.request_guard import matched_tokens
from atom_kv.integrations.vllm.settings import _Place, announced_kv_events
from atom_kv.wire import KV_FEATURE_RENDEZVOUS

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput as VllmKVConnectorOutput
    from vllm.v1.request import Request

#: Finished statuses after which a producer hands its blocks to a decode engine
#: (like vLLM's NIXL connector: a length cap, the usual ``max_tokens=1``, or a stop).
_HANDOFF_STATUSES = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


class _SchedulerSide:
    """Owns the engine's SchedulerHooks (and so their release sender), the aggregator of the ranks' own
    outputs, and the registration pinger; :meth:`close` stops both threads, once."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: KVTransferConfig,
                 place: _Place) -> None:
        self.config = config
        self.place = place
        self.block_size = vllm_config.cache_config.block_size
        shape = kv_shape(vllm_config, kv_cache_config, place.tp_size)
        # an idle vLLM engine takes no step, so its ranks would hear of a finished prefill's transfer only with
        # the next request, too late to confirm a decode engine's read of it: tell them directly as well
        self.hooks = engine_hooks.build_scheduler_hooks(
            config, engine_id=place.engine_id, host=place.host, tp_size=place.tp_size, dp_rank=place.dp_rank,
            block_size=self.block_size, announce_sends=config.is_producer,
        )
        self.aggregator = engine_hooks.KVOutputAggregator(place.tp_size)
        self.ledger = SchedulerLedger()
        self._local_hits: dict[str, int] = {}
        self._closed = False
        self.pinger = None
        if config.proxy_addresses and place.dp_rank == 0:
            assert config.http_port is not None  # parse_settings refuses proxy_ip without it
            events, replay = announced_kv_events(vllm_config)  # DP rank N's at port + N, as the proxy expects
            self.pinger = engine_hooks.build_registration_pinger(
                config, role="P" if config.is_producer else "D", index=str(place.dp_rank), http_host=place.host,
                http_port=config.http_port, tp_size=place.tp_size, dp_size=place.dp_size,
                engine_id=place.engine_id, model=shape.model_id, wait_until_serving=True,
                # vLLM's /health has no body to announce it in: a proxy may send a pair's legs at once
                kv_features=(KV_FEATURE_RENDEZVOUS,), kv_events_endpoint=events, kv_events_replay_endpoint=replay,
            )
            self.pinger.start()  # pings once vLLM's API server accepts connections on host_ip:http_port

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Where a request's ``kv_transfer_params`` enter: any the connector refuses, or fails on, cost the
        request its KV transfer (logged), never vLLM's engine core."""
        return matched_tokens("vLLM", request.request_id,
                              lambda: self._matched_tokens(request, num_computed_tokens),
                              on_error=lambda: self._drop(request.request_id))

    def _matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        params = request.kv_transfer_params
        if self.config.is_producer:
            self.hooks.get_num_new_matched_tokens(rid, request.num_prompt_tokens, params)
            return 0, False
        if self.ledger.loaded_before(rid):
            return 0, False  # one remote load per request: after a preemption it recomputes locally
        count, is_async = self.hooks.get_num_new_matched_tokens(rid, request.num_prompt_tokens, params,
                                                                num_computed_tokens=num_computed_tokens)
        if count <= 0:
            return 0, False
        self._local_hits[rid] = num_computed_tokens
        return count, is_async

    def _drop(self, rid: str) -> None:
        """The connector raised on ``rid``: have it drop (and release) what it holds for it."""
        self._local_hits.pop(rid, None)
        self.hooks.request_finished(rid, [], aborted=True)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if self.config.is_producer:
            return
        rid = request.request_id
        block_ids = blocks.get_block_ids()[0]
        self.hooks.update_state_after_alloc(rid, block_ids, num_external_tokens)
        local_hit = self._local_hits.pop(rid, 0)
        if num_external_tokens > 0:
            self.ledger.wait_for(rid, block_ids[local_hit // self.block_size:])

    def build_connector_meta(self, scheduled_tokens: int) -> AtomKVConnectorMetadata:
        self._apply(self.hooks.update_connector_output(KVConnectorOutput()))  # leases and load deadlines
        hooks_meta = self.hooks.build_connector_meta()
        free, abandon = self.ledger.take_step()
        # a step that computes nothing while transfers are out: vLLM steps again at once (its engine loop
        # spins while a request waits for remote KV or a producer holds blocks), so the ranks may instead
        # wait, bounded, for the transfers' news (settings.DEFAULT_IDLE_WAIT_MS)
        idle = scheduled_tokens == 0 and not free and not abandon and self.hooks.has_pending()
        return AtomKVConnectorMetadata(hooks=hooks_meta, free_sending=free, abandon=abandon, idle=idle)

    def update_connector_output(self, output: "VllmKVConnectorOutput") -> None:
        per_rank: list[Optional[KVConnectorOutput]] = [None] * self.place.tp_size
        meta = output.kv_connector_worker_meta
        if isinstance(meta, AtomKVWorkerMetadata):
            for rank, out in meta.reports:
                earlier = per_rank[rank]
                per_rank[rank] = out if earlier is None else _merge(earlier, out)
        agg = self.aggregator.aggregate(per_rank)
        self.ledger.reported(list(agg.finished_recving) + list(agg.failed_recving))
        self._apply(self.hooks.update_connector_output(agg))

    def _apply(self, events: engine_hooks.SchedulerEvents) -> None:
        if self.config.is_producer:
            self.ledger.release(events.free)
            return
        # vLLM acts on loads itself through the ranks' reports; loads the hooks ended
        # without any (a deadline, or a request that could not be served) still need them
        self.ledger.give_up(list(events.failed) + events.recompute + events.free)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        rid = request.request_id
        self._local_hits.pop(rid, None)
        self.ledger.forget(rid)
        aborted = request.status not in _HANDOFF_STATUSES
        delay_free, params = self.hooks.request_finished(rid, block_ids, aborted=aborted)
        if not self.config.is_producer:
            # vLLM holds a request that still waits for remote KV until every rank reported it
            return False, params
        if delay_free:
            self.ledger.hold(rid)
        if params is not None:
            params = dict(params, remote_request_id=rid)
        return delay_free, params

    def has_pending_block_frees(self) -> bool:
        return self.ledger.frees_pending()

    def close(self) -> None:
        """Stop the pinger (after a draining ping) and the hooks' release sender; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self.pinger is not None:
            # vLLM tells the connector nothing before it stops: its shutdown is the first word; a draining
            # ping still takes the engine out of routing now instead of at the proxy's heartbeat timeout
            self.pinger.leave(min(1.0, self.pinger.answer_timeout_s))
            self.pinger.close()
        self.hooks.close()


def _merge(a: KVConnectorOutput, b: KVConnectorOutput) -> KVConnectorOutput:
    return KVConnectorOutput(finished_sending=a.finished_sending + b.finished_sending,
                             finished_recving=a.finished_recving + b.finished_recving,
                             failed_recving={**a.failed_recving, **b.failed_recving})
