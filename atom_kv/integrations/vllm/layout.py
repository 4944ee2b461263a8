"""What vLLM's KV cache looks like to atom-kv: the attention spec it can serve, the shape both engines of a
pair must agree on, the layout of the attention backend vLLM chose, and the tensors to register."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVQuantMode,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
)

from atom_kv.engine_hooks import CompatInfo

__all__ = ["UnsupportedKVCache", "attention_spec", "hooks_layers", "kv_layout", "kv_shape"]

_PLAIN_QUANT = (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR)


class UnsupportedKVCache(ValueError):
    """vLLM handed over a KV cache atom-kv cannot serve (one line saying why and what to do)."""



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
    layouts = {layout for layout in found.values() if layout is not None}  # every one, once none is unknown
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
