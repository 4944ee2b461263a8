"""One tensor-parallel rank: its model slice, its KV cache and its worker connector."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from atom_kv.engine_hooks import ConnectorMetadata, KVConnectorOutput, RouteReport
from atom_kv.reference.kv_cache import PagedKVCache
from atom_kv.reference.model import SeqChunk, TinyLlama
from atom_kv.reference.rank_io import ChunkTuple, RankSpec, StepResult

__all__ = ["ModelRunner", "host_all_reduce", "rank_device"]

log = logging.getLogger(__name__)


def rank_device(spec: RankSpec) -> torch.device:
    """The rank's device: the CPU, or for "cuda" GPU ``tp_rank`` modulo the
    GPUs visible (ranks share a GPU when there are fewer GPUs than ranks)."""
    if spec.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"--device {spec.device}: no GPU visible to torch {torch.__version__}; use --device cpu")
    device = torch.device("cuda", spec.tp_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False  # the same float32 math in P/D and colocated engines
    torch.backends.cudnn.allow_tf32 = False
    return device


def host_all_reduce(reduce: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``reduce`` (gloo's all-reduce, host tensors) for tensors on any device."""

    def all_reduce(t: torch.Tensor) -> None:
        if t.device.type == "cpu":
            reduce(t)
            return
        host = t.cpu()
        reduce(host)
        t.copy_(host)

    return all_reduce


class ModelRunner:
    """Owns one rank's :class:`TinyLlama` slice, :class:`PagedKVCache` and ``WorkerHooks``."""

    def __init__(self, spec: RankSpec, all_reduce: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        self.spec = spec
        cfg = spec.model
        self.device = rank_device(spec)
        self.model = TinyLlama(cfg, tp_rank=spec.tp_rank, tp_size=spec.tp_size, all_reduce=all_reduce,
                               device=self.device)
        self.cache = PagedKVCache(
            num_layers=cfg.num_layers,
            num_blocks=spec.num_blocks,
            kv_heads=cfg.num_kv_heads // spec.tp_size,
            block_size=spec.block_size,
            head_dim=cfg.head_dim,
            device=self.device,
        )
        self.hooks: Any = None
        self._routes_sent: Optional[RouteReport] = None
        self._checksums: Any = None
        if spec.kv_checksum_dir:
            from atom_kv.reference.kv_checksums import KVChecksums

            self._checksums = KVChecksums(spec.kv_checksum_dir, spec.engine_id, spec.dp_rank, spec.tp_rank,
                                          cfg.num_kv_heads // spec.tp_size)
        if spec.kv_config_json:
            from atom_kv import engine_hooks
            from atom_kv.config import KVTransferConfig
            from atom_kv.engine_hooks import CompatInfo

            config = KVTransferConfig.from_resolved(__import__("json").loads(spec.kv_config_json))
            compat = CompatInfo(
                model_id=spec.model_id,
                dtype="float32",
                num_layers=cfg.num_layers,
                num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                block_size=spec.block_size,
                is_mla=False,
            )
            self.hooks = engine_hooks.build_worker_hooks(
                config,
                engine_id=spec.engine_id,
                host=spec.host,
                bind_host=spec.bind_host,
                tp_rank=spec.tp_rank,
                tp_size=spec.tp_size,
                dp_rank=spec.dp_rank,
                dp_size=spec.dp_size,
                compat=compat,
            )
            self.hooks.register_kv_caches(self.cache.layers)
        log.info(
            "rank %d/%d ready on %s: %d KV blocks of %d tokens (%.1f MiB)",
            spec.tp_rank, spec.tp_size, self.device, spec.num_blocks, spec.block_size, self.cache.nbytes / 2**20,
        )

    def step(self, chunks: list[ChunkTuple], meta: Optional[ConnectorMetadata]) -> StepResult:
        """Start this step's KV loads, run the forward, and report finished transfers."""
        if self._checksums is not None and meta is not None:  # before the forward: lent blocks are final
            self._checksums.sent(self.cache.layers, meta.sends)
            self._checksums.loading(meta.loads)
            self._checksums.forget(meta.cancelled)
        if self.hooks is not None and meta is not None:
            self.hooks.start_load_kv(meta)
        logits = None
        if chunks:
            out = self.model.forward([SeqChunk(list(t), s, list(b)) for t, s, b in chunks], self.cache)
            if self.spec.tp_rank == 0:
                logits = out.cpu().numpy()
        if self.hooks is not None:
            finished = self.hooks.get_finished()
            if self._checksums is not None:  # loaded, and not yet decoded into
                self._checksums.loaded(self.cache.layers, finished.finished_recving)
                self._checksums.forget(finished.failed_recving)
            return StepResult(logits, finished, dict(self.hooks.stats()), self._changed_routes())
        return StepResult(logits, KVConnectorOutput(), {})

    def _changed_routes(self) -> Optional[RouteReport]:
        """The connector's routes when they changed since the last step (else None: nothing to send)."""
        report = self.hooks.routes()
        if report == self._routes_sent:
            return None
        self._routes_sent = report
        return report

    def set_waker(self, wake: Optional[Callable[[], None]]) -> None:
        """``wake()`` runs (on a connector thread) whenever this rank's connector has news for the engine."""
        if self.hooks is not None:
            self.hooks.set_waker(wake)

    def close(self) -> None:
        if self.hooks is not None:
            self.hooks.close()
            self.hooks = None
