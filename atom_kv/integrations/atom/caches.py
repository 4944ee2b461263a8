"""ATOM's KV caches as atom-kv registers them.

ATOM hands a worker connector ``{"layer_<n>": KVCacheTensor}`` (``k_cache``,
``v_cache``, fp8 ``k_scale``/``v_scale``, DeepSeek-V3.2's ``index_cache``)
plus, on ATOM main, its own region map (``KVTransferTensors``) and the
scheduler's block count. :func:`describe_atom_caches` recognises the layout
(:mod:`atom_kv.connector.cache_layouts`), checks every tensor against it and
derives the :class:`~atom_kv.wire.CompatInfo` two engines must share.

Under pipeline parallelism a stage holds a slice of the model's layers. ATOM
keys each cache by its module's global layer (``layer_<n>``; ``layer_num``
counts from 0 on every stage), so the keys say where the stage starts
(:attr:`AtomCaches.first_layer`); the compat info then names the whole
model's layers, which the decode engine has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from atom_kv.connector.cache_layouts import KVLayout, LayoutMismatch, TensorGeometry, describe_tensor, detect_layout
from atom_kv.wire import CompatInfo

__all__ = ["AtomCaches", "describe_atom_caches", "stage_first_layer"]


@dataclass
class AtomCaches:
    """One TP rank's ATOM caches: the layout, the compat info, and per layer
    (in layer order) the tensors by kind with their geometry."""

    layout: KVLayout
    compat: CompatInfo
    layers: list[dict[str, Any]]
    geometry: list[dict[str, TensorGeometry]]
    #: the model layer of the first cache (ATOM's key ``layer_<n>``); 0 without pipeline stages
    first_layer: int = 0


def describe_atom_caches(
    kv_caches: Mapping[str, Any],
    *,
    block_size: int,
    tp_size: int,
    model_id: str,
    num_blocks: Optional[int] = None,
    transfer_tensors: Any = None,
    model_layers: Optional[int] = None,
) -> AtomCaches:
    """Check ATOM's caches and describe them; raises :class:`LayoutMismatch` (one line) for what atom-kv cannot move.

    ``model_layers``: a pipeline stage's model has this many layers, of which ``kv_caches`` are a
    consecutive slice (found from ATOM's keys)."""
    _refuse_per_request_state(transfer_tensors)
    if not kv_caches:
        raise LayoutMismatch("ATOM registered no KV cache tensors")
    entries = sorted(kv_caches.items(), key=lambda kv: (getattr(kv[1], "layer_num", 0), kv[0]))
    first_layer = 0 if model_layers is None else stage_first_layer([name for name, _ in entries], model_layers)
    first = entries[0][1]
    v0 = _tensor(first, "v_cache")
    layout = detect_layout(first.k_cache.shape, None if v0 is None else v0.shape, block_size)
    layers: list[dict[str, Any]] = []
    geometry: list[dict[str, TensorGeometry]] = []
    heads = 1 if layout.is_mla else int(first.k_cache.shape[1])
    head_dim = 0
    for name, entry in entries:
        named = _named_tensors(entry, layout)
        shapes: dict[str, TensorGeometry] = {}
        for kind, t in named.items():
            try:
                g = describe_tensor(layout, kind, t.shape, t.element_size(), block_size=block_size, heads=heads,
                                    head_dim=(shapes["k"].head_dim if "k" in shapes and kind == "v" else None))
            except LayoutMismatch as exc:
                raise LayoutMismatch(f"{name}: {exc}") from None
            if hasattr(t, "is_contiguous") and not t.is_contiguous():
                raise LayoutMismatch(f"{name}: the {kind} cache must be contiguous")
            if num_blocks is not None and g.num_blocks != num_blocks:
                raise LayoutMismatch(f"{name}: the {kind} cache holds {g.num_blocks} blocks of {block_size} tokens, "
                                     f"ATOM's scheduler has {num_blocks}")
            shapes[kind] = g
        head_dim = head_dim or shapes["latent" if layout.is_mla else "k"].head_dim
        layers.append(named)
        geometry.append(shapes)
    dtype = str(first.k_cache.dtype).removeprefix("torch.")
    compat = CompatInfo(model_id=model_id, dtype=dtype, num_layers=model_layers or len(entries),
                        num_kv_heads=heads if layout.is_mla else heads * tp_size, head_dim=head_dim,
                        block_size=block_size, is_mla=layout.is_mla, layout=layout.label)
    return AtomCaches(layout, compat, layers, geometry, first_layer)


def stage_first_layer(names: list[str], model_layers: int) -> int:
    """The model layer of a pipeline stage's first cache, from ATOM's keys (``layer_<n>``, in
    ``layer_num`` order); raises :class:`LayoutMismatch` (one line) unless they name consecutive
    layers of a model of ``model_layers``."""
    numbers = []
    for name in names:
        prefix, _, index = name.rpartition("_")
        if prefix != "layer" or not index.isdigit():
            raise LayoutMismatch(f"pipeline stage: ATOM's KV cache {name!r} is not named layer_<n>, so the model "
                                 "layers this stage holds are unknown")
        numbers.append(int(index))
    first, last = numbers[0], numbers[-1]
    if numbers != list(range(first, first + len(numbers))) or last >= model_layers:
        raise LayoutMismatch(f"pipeline stage: ATOM's KV caches name layers {numbers[0]}..{numbers[-1]} "
                             f"({len(numbers)} caches), not consecutive layers of the model's {model_layers}")
    return first


def _tensor(entry: Any, attr: str) -> Any:
    """``entry.attr`` if it is a real cache tensor (ATOM leaves None, or an empty tensor, when absent)."""
    t = getattr(entry, attr, None)
    if t is None or not hasattr(t, "shape") or t.numel() == 0 or len(t.shape) < 3:
        return None
    return t


def _named_tensors(entry: Any, layout: KVLayout) -> dict[str, Any]:
    if layout.is_mla:
        named = {"latent": entry.k_cache}
        index = _tensor(entry, "index_cache")
        if index is not None:
            named["index"] = index
        return named
    named = {"k": entry.k_cache, "v": entry.v_cache}
    for kind, attr in (("k_scale", "k_scale"), ("v_scale", "v_scale")):
        t = _tensor(entry, attr)
        if t is not None:
            named[kind] = t
    return named


def _refuse_per_request_state(transfer_tensors: Any) -> None:
    """Models whose requests carry state outside the paged blocks (GDN's recurrent
    state, DeepSeek-V4's compressor and sliding-window rings) need that state moved
    too; atom-kv moves paged blocks only, so it refuses them rather than decode wrong."""
    if transfer_tensors is None:
        return
    extra = [name for name in ("slot_regions", "swa_block_regions") if getattr(transfer_tensors, name, None)]
    if getattr(transfer_tensors, "staging_region", None) is not None:
        extra.append("staging_region")
    if extra:
        raise LayoutMismatch(
            "this model keeps per-request state outside the paged KV blocks (ATOM's KVTransferTensors has "
            f"{', '.join(extra)}); atom-kv moves paged blocks only, so it cannot serve this model"
        )
