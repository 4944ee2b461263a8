"""atom-kv as a vLLM v1 KV connector (``KVConnectorBase_V1``), loaded by name::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "AtomKVConnector",
        "kv_connector_module_path": "atom_kv.integrations.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"handshake_port": 6301}}'

``kv_role`` is vLLM's (``kv_producer`` for prefill, ``kv_consumer`` for decode;
``kv_both`` is refused). ``kv_connector_extra_config`` holds atom-kv's own
``--kv-transfer-config`` keys (see docs/configuration.md), validated with the
same one-line errors, plus ``host_ip``: the address other engines dial to read
this engine's KV (default: vLLM's ``VLLM_HOST_IP`` / detected address).

vLLM builds one connector in its scheduler process and one in each worker
process (one per TP rank). The scheduler side wraps atom-kv's
:class:`~atom_kv.engine_hooks.SchedulerHooks`, each worker side one
:class:`~atom_kv.engine_hooks.WorkerHooks`. vLLM request ids are used towards
vLLM; the prefill's ``transfer_id`` is what crosses the wire. How the two
contracts meet is in docs/vllm.md ("How it maps onto vLLM"); the per-request
reporting promises live in :mod:`atom_kv.integrations.vllm_ledger`.

This is the only atom-kv module that imports vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
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
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVQuantMode,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from atom_kv import engine_hooks
from atom_kv.config import KV_ROLE_REQUIRED, ConfigError, KVTransferConfig
from atom_kv.engine_hooks import CompatInfo, ConnectorMetadata, KVConnectorOutput
from atom_kv.integrations.vllm_ledger import RankLedger, SchedulerLedger

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput as VllmKVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "AtomKVConnector",
    "AtomKVConnectorMetadata",
    "AtomKVConnectorStats",
    "AtomKVWorkerMetadata",
    "UnsupportedKVCache",
]

logger = logging.getLogger(__name__)

#: Finished statuses after which a producer hands its blocks to a decode engine
#: (like vLLM's NIXL connector: a length cap, the usual ``max_tokens=1``, or a stop).
_HANDOFF_STATUSES = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
_PLAIN_QUANT = (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR)


class UnsupportedKVCache(ValueError):
    """vLLM handed over a KV cache atom-kv cannot serve (one line saying why and what to do)."""


# ---------------------------------------------------------------------------
# values vLLM carries between its processes
# ---------------------------------------------------------------------------
@dataclass
class AtomKVConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> every worker, once per step.

    ``hooks`` is atom-kv's own per-step metadata; ``free_sending`` names the
    producer requests every rank reports in ``finished_sending`` this step
    (vLLM then frees their blocks); ``abandon`` names consumer loads atom-kv
    ended without any rank reporting them, with their local blocks.
    """

    hooks: ConnectorMetadata = field(default_factory=ConnectorMetadata)
    free_sending: list[str] = field(default_factory=list)
    abandon: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class AtomKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Every worker -> the scheduler side, once per step: each rank's own atom-kv output."""

    reports: list[tuple[int, KVConnectorOutput]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "AtomKVWorkerMetadata":
        if isinstance(other, AtomKVWorkerMetadata):
            self.reports.extend(other.reports)
        return self


@dataclass
class AtomKVConnectorStats(KVConnectorStats):
    """Transfer counters of one interval (worker ranks add up), as atom-kv's ``WorkerHooks.stats()`` names them."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "AtomKVConnectorStats":
        for key, value in (other.data or {}).items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        seconds = d.get("seconds", 0.0)
        nbytes = d.get("bytes", 0.0)
        return {
            "transfers": int(d.get("transfers", 0)),
            "MB": round(nbytes / 1e6, 3),
            "GB/s": round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0,
            "ranges": int(d.get("ranges", 0)),
            "retries": int(d.get("retries", 0)),
            "failures": int(d.get("failures", 0)),
            "handshakes": int(d.get("handshakes", 0)),
            "handshake_failures": int(d.get("handshake_failures", 0)),
            "peers_dropped": int(d.get("peers_dropped", 0)),
        }

    def is_empty(self) -> bool:
        return not any(self.data.values())


# ---------------------------------------------------------------------------
# configuration and KV layout
# ---------------------------------------------------------------------------
def parse_settings(vllm_config: VllmConfig) -> tuple[KVTransferConfig, Optional[str]]:
    """atom-kv's config from vLLM's ``kv_role`` and ``kv_connector_extra_config``, and ``host_ip``."""
    vkv = vllm_config.kv_transfer_config
    assert vkv is not None
    role = vkv.kv_role
    if role is None:
        raise ConfigError(KV_ROLE_REQUIRED)
    if role not in ("kv_producer", "kv_consumer"):
        raise ConfigError(
            f"kv-transfer-config: `kv_role` {role!r} is not supported by AtomKVConnector; run prefill "
            "instances with 'kv_producer' and decode instances with 'kv_consumer'"
        )
    extra = dict(vkv.kv_connector_extra_config or {})
    host = extra.pop("host_ip", None)
    if host is not None and (not isinstance(host, str) or not host.strip()):
        raise ConfigError(f"kv_connector_extra_config: `host_ip` must be a host name or IP address, got {host!r}")
    if "kv_role" in extra and extra["kv_role"] != role:
        raise ConfigError(
            f"kv_connector_extra_config: `kv_role` {extra['kv_role']!r} contradicts vLLM's kv_role {role!r}; "
            "set it once, as vLLM's kv_role"
        )
    extra["kv_role"] = role
    config = KVTransferConfig.from_dict(extra)
    if config.proxy_addresses and "http_port" not in extra:
        # atom-kv's default (ATOM's server port) says nothing about vLLM's --port
        raise ConfigError("kv_connector_extra_config: `http_port` is required with `proxy_ip` "
                          "(set it to vLLM's --port, where the proxy sends requests)")
    if "load_failure_policy" in extra:
        logger.warning("kv_connector_extra_config: `load_failure_policy` is ignored under vLLM; vLLM's own "
                       "kv_load_failure_policy (%s) decides what a failed load does", vkv.kv_load_failure_policy)
    return config, host


def attention_spec(kv_cache_config: KVCacheConfig) -> FullAttentionSpec:
    """The one full-attention (or MLA) spec atom-kv can serve, or :class:`UnsupportedKVCache`."""
    groups = kv_cache_config.kv_cache_groups
    kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
    if len(groups) != 1:
        raise UnsupportedKVCache(
            f"AtomKVConnector serves models whose layers share one KV cache group of full attention; "
            f"this model has {len(groups)} groups ({kinds}): hybrid models (sliding window + full "
            "attention, Mamba/SSM) are not supported"
        )
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or isinstance(spec, SinkFullAttentionSpec):
        raise UnsupportedKVCache(
            f"AtomKVConnector serves full-attention and MLA KV caches; this model's KV cache is {kinds}"
        )
    if spec.kv_quant_mode not in _PLAIN_QUANT:
        raise UnsupportedKVCache(
            f"AtomKVConnector cannot move KV caches quantized as {spec.kv_quant_mode.name} (their scales "
            "live outside the cache blocks); use --kv-cache-dtype auto or fp8"
        )
    packed = [name for name in ("page_size_padded", "num_head_slots", "state_content_bytes")
              if getattr(spec, name, None) is not None]
    if packed or spec.tokens_per_state != 1:
        raise UnsupportedKVCache(
            f"AtomKVConnector needs plain per-token KV pages; this model's are packed "
            f"({', '.join(packed) or 'tokens_per_state'} set)"
        )
    return spec


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class _Shape:
    """What both engines of a pair must agree on, derived from vLLM's config."""

    model_id: str
    spec: FullAttentionSpec
    is_mla: bool
    num_blocks: int
    block_size: int
    total_kv_heads: int
    local_kv_heads: int
    content: int  # elements per (head, token): K then V (or the MLA latent)


def kv_shape(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, tp_size: int) -> _Shape:
    spec = attention_spec(kv_cache_config)
    is_mla = isinstance(spec, MLAAttentionSpec)
    model = vllm_config.model_config
    served = model.served_model_name if model is not None else None
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    model_id = str(served or (model.model if model is not None else "unknown"))
    local = 1 if is_mla else spec.num_kv_heads
    total = 1 if is_mla else local * tp_size
    if not is_mla and model is not None:
        total = model.get_total_num_kv_heads()
        if total % tp_size or total // tp_size != local:
            raise UnsupportedKVCache(
                f"AtomKVConnector needs the KV heads split evenly over TP ranks; {total} KV heads over "
                f"TP {tp_size} gives {local} per rank (replicated heads are not supported): use a TP size "
                f"that divides {total}"
            )
    return _Shape(model_id=model_id, spec=spec, is_mla=is_mla, num_blocks=kv_cache_config.num_blocks,
                  block_size=spec.block_size, total_kv_heads=total, local_kv_heads=local,
                  content=spec.head_size + (0 if is_mla else spec.head_size_v))


#: How vLLM 0.32's attention backends read one (block, head) slice of a layer's
#: ``[num_blocks, kv_heads, block_size, C]`` cache, by backend class: which bytes
#: two engines exchange, hence the layout atom-kv names in the handshake
#: (:mod:`atom_kv.connector.cache_layouts`). The same shape holds K and V in
#: two orders, so a backend not listed here is refused rather than guessed.
_BACKEND_LAYOUTS = {
    "CPUAttentionBackend": "vllm-cpu",  # CPU_ATTN: the block's K rows, then its V rows
    "FlashAttentionBackend": "vllm-hnd",  # FLASH_ATTN: each token's K, then its V
    "FlexAttentionBackend": "vllm-hnd",  # FLEX_ATTENTION
    "TritonAttentionBackend": "vllm-hnd",  # TRITON_ATTN
    "AiterFlashAttentionBackend": "vllm-hnd",  # ROCM_AITER_FA (its shuffled cache is refused by attention_spec)
    "RocmAiterUnifiedAttentionBackend": "vllm-hnd",  # ROCM_AITER_UNIFIED_ATTN
}
_SERVED_BACKENDS = "CPU_ATTN, FLASH_ATTN, FLEX_ATTENTION, TRITON_ATTN, ROCM_AITER_FA, ROCM_AITER_UNIFIED_ATTN"


def _backend_layout(backend: type) -> Optional[str]:
    """The layout of ``backend``, or of the backend it specialises (vLLM derives per-layer-kind
    subclasses, e.g. for chunked local attention, that keep their base's KV cache)."""
    for cls in backend.__mro__:
        if cls.__name__ in _BACKEND_LAYOUTS:
            return _BACKEND_LAYOUTS[cls.__name__]
    return None


def kv_layout(vllm_config: VllmConfig, layer_names: list[str]) -> str:
    """The atom-kv layout of these layers' caches, from the attention backends vLLM chose for them.

    Raises :class:`UnsupportedKVCache` (one line) for a backend atom-kv does not
    know, for layers whose backends disagree, or when vLLM cannot say.
    """
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    try:
        backends = get_current_attn_backends(vllm_config, layer_names)
    except Exception as exc:  # vLLM's selector, when no model layer is registered
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise UnsupportedKVCache(
            f"AtomKVConnector cannot tell which attention backend reads this engine's KV cache ({reason}); "
            f"it serves {_SERVED_BACKENDS} (--attention-backend)"
        ) from None
    found = {f"{b.get_name()} ({b.__name__})": _backend_layout(b) for b in backends}
    unknown = sorted(name for name, layout in found.items() if layout is None)
    if unknown:
        raise UnsupportedKVCache(
            f"AtomKVConnector does not know how the {', '.join(unknown)} attention backend orders K and V "
            f"inside a KV block; it serves {_SERVED_BACKENDS}: choose one with --attention-backend"
        )
    layouts = set(found.values())
    if len(layouts) != 1:
        raise UnsupportedKVCache(
            f"AtomKVConnector needs one KV layout for every layer; this model's layers use attention backends "
            f"with different ones ({', '.join(f'{n}: {lay}' for n, lay in sorted(found.items()))})"
        )
    return layouts.pop()


def hooks_layers(shape: _Shape, kv_caches: dict[str, torch.Tensor], layer_names: list[str], *, layout: str,
                 resolved: str) -> tuple[list[Any], CompatInfo]:
    """vLLM's per-layer caches as atom-kv's ``register_kv_caches`` takes them, and the matching CompatInfo.

    vLLM keeps one tensor per layer, ``[num_blocks, kv_heads, block_size, C]`` in
    the HND layout, so one head's slice of a block is one contiguous run, as
    atom-kv's planner needs. ``layout`` (from :func:`kv_layout`: ``vllm-hnd`` or
    ``vllm-cpu``) says how K and V share that run; each layer registers once, as
    one ``kv`` tensor. MLA layers (one latent row per token) register as ``mla``.
    ``resolved`` is vLLM's own name for the layout it allocated, for errors.
    The CompatInfo carries ``layout``, so an engine with another one is refused
    at the handshake.
    """
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    want = [shape.num_blocks, shape.local_kv_heads, shape.block_size, shape.content]
    for name in layer_names:
        t = kv_caches.get(name)
        if t is None:
            raise UnsupportedKVCache(f"vLLM registered no KV cache tensor for layer {name}")
        if t.data_ptr() in seen:
            continue  # a layer that shares another layer's cache (cross-layer KV sharing)
        seen.add(t.data_ptr())
        if list(t.shape) != want or t.dtype != shape.spec.dtype:
            raise UnsupportedKVCache(
                f"layer {name}: KV cache is {list(t.shape)} {_dtype_name(t.dtype)}, AtomKVConnector expects "
                f"[num_blocks, kv_heads, block_size, K|V] = {want} {_dtype_name(shape.spec.dtype)} "
                "(a kernel block size other than --block-size is not supported)"
            )
        if not t.is_contiguous():
            raise UnsupportedKVCache(
                f"layer {name}: KV cache is not laid out head-major per block (vLLM resolved the "
                f"{resolved} layout); AtomKVConnector needs HND (LBHNC): unset VLLM_KV_CACHE_LAYOUT "
                "or set it to HND, with an attention backend that supports it"
            )
        tensors.append(t)
    if shape.is_mla:
        layout = "mla"
        layers: list[Any] = [t.view(shape.num_blocks, shape.block_size, shape.content) for t in tensors]
    else:
        layers = tensors
    compat = CompatInfo(model_id=shape.model_id, dtype=_dtype_name(shape.spec.dtype), num_layers=len(layers),
                        num_kv_heads=shape.total_kv_heads, head_dim=shape.content, block_size=shape.block_size,
                        is_mla=shape.is_mla, layout=layout)
    return layers, compat


@dataclass(frozen=True)
class _Place:
    """Where this engine (and, on a worker, this rank) sits."""

    engine_id: str
    host: str
    tp_size: int
    dp_rank: int
    dp_size: int


def _place(vllm_config: VllmConfig, config: KVTransferConfig, host: Optional[str]) -> _Place:
    pc = vllm_config.parallel_config
    for name, label in (("pipeline_parallel_size", "pipeline parallel"),
                        ("prefill_context_parallel_size", "prefill context parallel"),
                        ("decode_context_parallel_size", "decode context parallel")):
        size = getattr(pc, name, 1) or 1
        if size > 1:
            raise UnsupportedKVCache(f"AtomKVConnector does not support {label} (size {size}); use tensor "
                                     "and data parallelism")
    if host is None:
        from vllm.utils.network_utils import get_ip

        host = get_ip()
    vkv = vllm_config.kv_transfer_config
    assert vkv is not None
    return _Place(engine_id=str(config.engine_id or vkv.engine_id), host=host, tp_size=pc.tensor_parallel_size,
                  dp_rank=int(getattr(pc, "data_parallel_index", pc.data_parallel_rank)),
                  dp_size=pc.data_parallel_size)


def _log_with_vllm() -> None:
    """Show atom-kv's own log lines (handshakes, failed loads, transfer summaries) in vLLM's log.

    vLLM configures only its ``vllm`` logger; without this, atom-kv's INFO lines
    would be dropped in vLLM's processes. Done once per process, and only when
    nobody configured the ``atom_kv`` logger.
    """
    ours = logging.getLogger("atom_kv")
    if ours.handlers:
        return
    theirs = logging.getLogger("vllm")
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())


def _tp_rank(vllm_config: VllmConfig, tp_size: int) -> int:
    """This worker's TP rank: vLLM's TP group when initialised, else ``parallel_config.rank``."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return vllm_config.parallel_config.rank % tp_size


# ---------------------------------------------------------------------------
# the two sides
# ---------------------------------------------------------------------------
class _SchedulerSide:
    """Owns the engine's SchedulerHooks, the aggregator of the ranks' own outputs, and the pinger."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: KVTransferConfig,
                 place: _Place) -> None:
        self.config = config
        self.place = place
        self.block_size = vllm_config.cache_config.block_size
        shape = kv_shape(vllm_config, kv_cache_config, place.tp_size)
        self.hooks = engine_hooks.build_scheduler_hooks(
            config, engine_id=place.engine_id, host=place.host, tp_size=place.tp_size, dp_rank=place.dp_rank,
            block_size=self.block_size,
        )
        self.aggregator = engine_hooks.KVOutputAggregator(place.tp_size)
        self.ledger = SchedulerLedger()
        self._local_hits: dict[str, int] = {}
        self.pinger = None
        if config.proxy_addresses and place.dp_rank == 0:
            self.pinger = engine_hooks.build_registration_pinger(
                config, role="P" if config.is_producer else "D", index=str(place.dp_rank), http_host=place.host,
                http_port=config.http_port, tp_size=place.tp_size, dp_size=place.dp_size,
                engine_id=place.engine_id, model=shape.model_id, wait_until_serving=True,
            )
            self.pinger.start()  # pings once vLLM's API server accepts connections on host_ip:http_port

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
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

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if self.config.is_producer:
            return
        rid = request.request_id
        block_ids = blocks.get_block_ids()[0]
        self.hooks.update_state_after_alloc(rid, block_ids, num_external_tokens)
        local_hit = self._local_hits.pop(rid, 0)
        if num_external_tokens > 0:
            self.ledger.wait_for(rid, block_ids[local_hit // self.block_size:])

    def build_connector_meta(self) -> AtomKVConnectorMetadata:
        self._apply(self.hooks.update_connector_output(KVConnectorOutput()))  # leases and load deadlines
        hooks_meta = self.hooks.build_connector_meta()
        free, abandon = self.ledger.take_step()
        return AtomKVConnectorMetadata(hooks=hooks_meta, free_sending=free, abandon=abandon)

    def update_connector_output(self, output: "VllmKVConnectorOutput") -> None:
        per_rank: list[Optional[KVConnectorOutput]] = [None] * self.place.tp_size
        meta = output.kv_connector_worker_meta
        if isinstance(meta, AtomKVWorkerMetadata):
            for rank, out in meta.reports:
                per_rank[rank] = out if per_rank[rank] is None else _merge(per_rank[rank], out)
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
        if self.pinger is not None:
            self.pinger.close()
        self.hooks.close()


def _merge(a: KVConnectorOutput, b: KVConnectorOutput) -> KVConnectorOutput:
    return KVConnectorOutput(finished_sending=a.finished_sending + b.finished_sending,
                             finished_recving=a.finished_recving + b.finished_recving,
                             failed_recving={**a.failed_recving, **b.failed_recving})


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

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        shape = kv_shape(self.vllm_config, self.kv_cache_config, self.place.tp_size)
        resolved = self.vllm_config.cache_config.kv_cache_layout or "unresolved"
        names = list(self.kv_cache_config.kv_cache_groups[0].layer_names)
        layout = "mla" if shape.is_mla else kv_layout(self.vllm_config, names)
        layers, compat = hooks_layers(shape, kv_caches, names, layout=layout, resolved=resolved)
        hooks = engine_hooks.build_worker_hooks(
            self.config, engine_id=self.place.engine_id, host=self.place.host, tp_rank=self.tp_rank,
            tp_size=self.place.tp_size, dp_rank=self.place.dp_rank, compat=compat,
        )
        try:
            hooks.register_kv_caches(layers)
        except BaseException:
            hooks.close()
            raise
        self.hooks = hooks
        logger.info("AtomKVConnector rank %d/%d of engine %s: %d KV layers registered, layout %s", self.tp_rank,
                    self.place.tp_size, self.place.engine_id, len(layers), compat.layout)

    def start_load_kv(self, meta: AtomKVConnectorMetadata) -> None:
        self.ledger.step(meta.hooks.loads, meta.free_sending, meta.abandon)
        if self.hooks is not None:
            self.hooks.start_load_kv(meta.hooks)

    def get_transfer_results(self) -> KVConnectorTransferResults:
        if self.hooks is not None:
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


# ---------------------------------------------------------------------------
# the connector vLLM loads
# ---------------------------------------------------------------------------
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
        return self.scheduler_side.build_connector_meta()

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
        """Stop threads and close sockets on either side."""
        if self.worker_side is not None:
            self.worker_side.close()
        if self.scheduler_side is not None:
            self.scheduler_side.close()
