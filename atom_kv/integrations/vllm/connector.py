"""The connector vLLM loads (``AtomKVConnector``): forwards each of vLLM's calls to its scheduler side or
this rank's worker side."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from atom_kv.integrations.vllm.metadata import AtomKVConnectorMetadata, AtomKVConnectorStats
from atom_kv.integrations.vllm.scheduler import _SchedulerSide
from atom_kv.integrations.vllm.settings import _log_with_vllm, _place, parse_settings
from atom_kv.integrations.vllm.worker import _WorkerSide

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput as VllmKVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["AtomKVConnector"]

logger = logging.getLogger(__name__)


class AtomKVConnector(KVConnectorBase_V1):
    """vLLM's view of atom-kv: forwards each hook to the scheduler side or this rank's worker side."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_with_vllm()
        config, host = parse_settings(vllm_config)
        place = _place(vllm_config, config, host)
        self.config = config
        self.scheduler_side: Optional[_SchedulerSide] = None
        self.worker_side: Optional[_WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = _SchedulerSide(vllm_config, kv_cache_config, config, place)
        else:
            self.worker_side = _WorkerSide(vllm_config, kv_cache_config, config, place)
        logger.info("AtomKVConnector %s side of engine %s: %s, backend %s, handshake port %d, host %s",
                    role.name.lower(), place.engine_id, config.kv_role, config.backend, config.handshake_port,
                    place.host)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> Optional[str]:
        """HND: block-major, then head, so one head's slice of a block is one contiguous run (MLA: any)."""
        model = vllm_config.model_config
        if model is not None and model.use_mla:
            return None
        return "HND"

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> Optional[KVConnectorStats]:
        return AtomKVConnectorStats(data=dict(data or {}))

    # --- scheduler side -------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Consumer: prompt tokens past the local prefix hit that will load from the prefill engine, async."""
        assert self.scheduler_side is not None
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """Consumer: the request's blocks are allocated; its load goes out with the next metadata."""
        assert self.scheduler_side is not None
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's loads, releases, cancellations and frees for every rank."""
        assert self.scheduler_side is not None
        return self.scheduler_side.build_connector_meta(scheduler_output.total_num_scheduled_tokens)

    def update_connector_output(self, connector_output: "VllmKVConnectorOutput") -> None:
        """Every rank's own atom-kv output for this step, aggregated, into the hooks."""
        assert self.scheduler_side is not None
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """Producer: hold the blocks for the decode engine and return its kv_transfer_params."""
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        """True when the next step gives producer blocks back (vLLM waits for them instead of preempting)."""
        return self.scheduler_side is not None and self.scheduler_side.has_pending_block_frees()

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        """A load restores the request's own blocks in every transferable group."""
        return self._kv_cache_config.transfer_group_ids

    # --- worker side ----------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register this rank's KV tensors (refuses layouts atom-kv cannot serve) and start the handshake server."""
        assert self.worker_side is not None
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Start this step's reads in the background and record releases, cancellations and frees."""
        assert self.worker_side is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, AtomKVConnectorMetadata)
        self.worker_side.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        """Decode engines read the prefill's blocks in place: nothing to save."""

    def wait_for_save(self) -> None:
        """Nothing is saved."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """This rank's finished loads (failed ones too) and the producer requests to free, each named once."""
        assert self.worker_side is not None
        return self.worker_side.get_transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """``(finished sending, finished receiving)`` of this rank (see ``get_transfer_results``)."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local blocks of this rank's failed loads; vLLM's kv_load_failure_policy decides what follows."""
        return self.worker_side.take_invalid_blocks() if self.worker_side is not None else set()

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        """Transfer counters since the last call (bytes, seconds, ranges, retries, failures, handshakes)."""
        return self.worker_side.stats() if self.worker_side is not None else None

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        """This rank's own atom-kv output, for the scheduler side's hooks."""
        return self.worker_side.take_worker_meta() if self.worker_side is not None else None

    def shutdown(self) -> None:
        """Stop this instance's threads and close its sockets, whichever side it is (idempotent).

        vLLM calls it on every instance it made: each worker's, and the scheduler's from
        ``Scheduler.shutdown()``; the scheduler side owns the registration pinger and the release
        sender, so it is closed here too, as vLLM's NixlConnector closes both of its sides."""
        if self.worker_side is not None:
            self.worker_side.close()
        if self.scheduler_side is not None:
            self.scheduler_side.close()
