"""The worker side of the vLLM connector: one TP rank's atom-kv WorkerHooks in a vLLM worker process."""

from __future__ import annotations

import logging
import threading
from typing import Optional

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.v1.kv_cache_interface import KVCacheConfig

from atom_kv import engine_hooks
from atom_kv.config import KVTransferConfig
from atom_kv.integrations.vllm.layout import hooks_layers, kv_layout, kv_shape
from atom_kv.integrations.vllm.ledger import RankLedger
from atom_kv.integrations.vllm.metadata import AtomKVConnectorMetadata, AtomKVConnectorStats, AtomKVWorkerMetadata
from atom_kv.integrations.vllm.settings import _Place, _tp_rank, idle_wait_s

logger = logging.getLogger(__name__)


class _WorkerSide:
    """Owns one TP rank's WorkerHooks (built at ``register_kv_caches``) and its ledger."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: KVTransferConfig,
                 place: _Place) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.config = config
        self.place = place
        self.tp_rank = _tp_rank(vllm_config, place.tp_size)
        self.hooks: Optional[engine_hooks.WorkerHooks] = None
        self.ledger = RankLedger()
        self._invalid: set[int] = set()
        self._meta_out: Optional[AtomKVWorkerMetadata] = None
        self._last_stats: dict[str, float] = {}
        self._news = threading.Event()  # set by the hooks' threads when get_finished has news
        self._idle = False
        self._idle_wait_s = idle_wait_s(vllm_config)  # settings.DEFAULT_IDLE_WAIT_MS says why

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        shape = kv_shape(self.vllm_config, self.kv_cache_config, self.place.tp_size)
        resolved = self.vllm_config.cache_config.kv_cache_layout or "unresolved"
        names = list(self.kv_cache_config.kv_cache_groups[0].layer_names)
        layout = "mla" if shape.is_mla else kv_layout(self.vllm_config, names)
        layers, compat = hooks_layers(shape, kv_caches, names, layout=layout, resolved=resolved)
        hooks = engine_hooks.build_worker_hooks(
            self.config, engine_id=self.place.engine_id, host=self.place.host, tp_rank=self.tp_rank,
            tp_size=self.place.tp_size, dp_rank=self.place.dp_rank,
            dp_size=max(self.place.dp_size, self.place.dp_rank + 1), compat=compat,
        )
        try:
            hooks.register_kv_caches(layers)
        except BaseException:
            hooks.close()
            raise
        self.hooks = hooks
        hooks.set_waker(self._news.set)
        logger.info("AtomKVConnector rank %d/%d of engine %s: %d KV layers registered, layout %s", self.tp_rank,
                    self.place.tp_size, self.place.engine_id, len(layers), compat.layout)

    def start_load_kv(self, meta: AtomKVConnectorMetadata) -> None:
        self.ledger.step(meta.hooks.loads, meta.free_sending, meta.abandon)
        self._idle = meta.idle
        if self.hooks is not None:
            self.hooks.start_load_kv(meta.hooks)

    def get_transfer_results(self) -> KVConnectorTransferResults:
        if self.hooks is not None:
            if self._idle:
                self._idle = False
                self._news.wait(self._idle_wait_s)  # returns at once when news came since the last report
            self._news.clear()  # news from here on is in this get_finished, or sets it for the next step
            out = self.hooks.get_finished()
            self.ledger.finished(out)
            if not out.is_empty():
                self._meta_out = AtomKVWorkerMetadata(reports=[(self.tp_rank, out)])
        report = self.ledger.take()
        self._invalid |= report.invalid_block_ids
        return KVConnectorTransferResults(finished_sending=report.finished_sending,
                                          finished_recving=report.finished_recving,
                                          failed_recving=report.failed_recving)

    def take_invalid_blocks(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def take_worker_meta(self) -> Optional[AtomKVWorkerMetadata]:
        meta, self._meta_out = self._meta_out, None
        return meta

    def stats(self) -> Optional[AtomKVConnectorStats]:
        if self.hooks is None:
            return None
        now = self.hooks.stats()
        delta = {k: v - self._last_stats.get(k, 0.0) for k, v in now.items()}
        self._last_stats = now
        if not any(delta.values()):
            return None
        return AtomKVConnectorStats(data=delta)

    def close(self) -> None:
        if self.hooks is not None:
            self.hooks.close()
