"""One TP rank's KV caches as the connector sees them.

:func:`describe_kv_caches` is the one place that turns what an engine passes
to ``register_kv_caches`` into a list of :class:`KVTensor` (layer, kind,
tensor, block_bytes, num_blocks, units). It checks every tensor against the
layout ``CompatInfo.layout`` names; the layouts themselves (HND, ATOM's AITER
K/V and shuffled V, MLA, ``block_ratio``, vLLM's one-tensor-per-layer
``vllm-hnd`` and ``vllm-cpu``) are described in
:mod:`atom_kv.connector.cache_layouts`. All keep one head's slice of one unit
(a block, or a physical block) a contiguous byte run.

:func:`register_kv_tensors` registers them with the transfer backend, and
:func:`peer_layouts` reads a peer's registration back from its handshake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Optional, Sequence

from atom_kv.connector.base import KVCacheLayer
from atom_kv.connector.cache_layouts import KVLayout, LayoutMismatch, describe_tensor
from atom_kv.connector.layout import TensorLayout
from atom_kv.transfer import ChunkedRegion, TransferBackend, chunk_sizes, memory_of
from atom_kv.wire import CompatInfo, RegionInfo

__all__ = ["KVTensor", "RegisteredKV", "compat_layout", "describe_kv_caches", "peer_layouts", "register_kv_tensors"]


class KVTensor(NamedTuple):
    """One cache tensor of this rank: ``kind`` is "k", "v", "k_scale", "v_scale",
    "kv" (K and V in one tensor), "latent" or "index"; ``block_bytes`` the bytes
    of one block (this rank's heads), stored as ``units`` head-major sub-blocks."""

    layer: int
    kind: str
    tensor: Any
    block_bytes: int
    num_blocks: int
    units: int = 1


@dataclass
class RegisteredKV:
    """This rank's registered caches: how to address them locally
    (``layouts``), what a peer is told (``regions``), and the tensors,
    kept alive while the backend may read or write them."""

    layouts: list[TensorLayout] = field(default_factory=list)
    regions: list[RegionInfo] = field(default_factory=list)
    tensors: list[Any] = field(default_factory=list)
    #: the memory kinds of the tensors ("host", "gpu:N"), each once, as the handshake carries them
    memory: list[str] = field(default_factory=list)


def compat_layout(compat: CompatInfo) -> KVLayout:
    """The layout ``compat`` names; raises ``ValueError`` (one line) for an unknown one or one that contradicts ``is_mla``."""
    layout = KVLayout.parse(compat.layout)
    if layout.is_mla != compat.is_mla:
        raise ValueError(f"compat info says is_mla={compat.is_mla} but layout {compat.layout!r}")
    return layout


def describe_kv_caches(kv_caches: Sequence[KVCacheLayer], compat: CompatInfo, tp_size: int,
                       layers: Optional[Sequence[int]] = None) -> list[KVTensor]:
    """Validate the engine's caches (one entry per layer) and describe each tensor.

    An entry is a ``(k, v)`` pair, one tensor (an MLA latent, or the ``kv``
    tensor of a fused layout), or a mapping of kind to tensor. Raises
    ``ValueError`` with one line naming the layer and what was expected.
    ``layers``: the model layer of each entry (a pipeline stage holds only
    some); by default every layer of the model, in order.
    """
    if layers is None:
        if len(kv_caches) != compat.num_layers:
            raise ValueError(f"got {len(kv_caches)} KV cache layers, compat says num_layers={compat.num_layers}")
        layers = range(compat.num_layers)
    elif len(kv_caches) != len(layers):
        raise ValueError(f"got {len(kv_caches)} KV cache layers for the {len(layers)} layers of this stage")
    layout = compat_layout(compat)
    heads = 1 if layout.is_mla else compat.num_kv_heads // tp_size
    out: list[KVTensor] = []
    for layer, entry in zip(layers, kv_caches):
        for kind, t in _named(layer, entry, layout):
            width = compat.head_dim if kind in ("k", "v", "kv", "latent") else None
            try:
                g = describe_tensor(layout, kind, t.shape, t.element_size(), block_size=compat.block_size,
                                    heads=heads, head_dim=width)
            except LayoutMismatch as exc:
                raise ValueError(f"layer {layer} {exc}") from None
            if layout.is_mla and width is not None and g.head_dim != width:
                raise ValueError(f"layer {layer} {kind} cache is {g.head_dim} wide, compat says {width}")
            if hasattr(t, "is_contiguous") and not t.is_contiguous():
                raise ValueError(f"layer {layer} {kind} cache must be contiguous")
            out.append(KVTensor(layer, kind, t, g.block_bytes, g.num_blocks, g.units))
    return out


def _named(layer: int, entry: Any, layout: KVLayout) -> list[tuple[str, Any]]:
    if isinstance(entry, Mapping):
        return list(entry.items())
    if layout.is_mla:
        return [("latent", entry)]
    if layout.is_fused:
        if isinstance(entry, (tuple, list)):
            raise ValueError(f"layer {layer}: layout {layout.label} keeps K and V in one tensor per layer, "
                             f"got {len(entry)} tensors")
        return [("kv", entry)]
    if not isinstance(entry, (tuple, list)) or len(entry) != 2:
        raise ValueError(f"layer {layer}: expected a (k, v) pair of tensors")
    return [("k", entry[0]), ("v", entry[1])]


def register_kv_tensors(backend: TransferBackend, tensors: Sequence[KVTensor]) -> RegisteredKV:
    """Register every tensor with ``backend`` (block-aligned chunks), each as
    the memory it lives in; raises :class:`~atom_kv.transfer.UnsupportedMemory`
    (one line) for a tensor the backend cannot serve, before its pointer is used."""
    out = RegisteredKV()
    for kt in tensors:
        memory = memory_of(kt.tensor)  # before any pointer is taken: a GPU address is not a host one
        backend.check_memory(memory)
        nbytes = kt.tensor.numel() * kt.tensor.element_size()
        ids = backend.register_memory(kt.tensor.data_ptr(), nbytes, align=kt.block_bytes, memory=memory)
        chunk = chunk_sizes(nbytes, kt.block_bytes, backend.max_region_bytes)[0]
        region = ChunkedRegion(tuple(ids), chunk, nbytes)
        out.layouts.append(TensorLayout(kt.layer, kt.kind, region, kt.block_bytes, kt.num_blocks, kt.units))
        out.regions.append(RegionInfo(layer=kt.layer, kind=kt.kind, region_ids=list(ids), chunk_bytes=chunk,
                                      block_bytes=kt.block_bytes, num_blocks=kt.num_blocks))
        out.tensors.append(kt.tensor)
        if memory.label not in out.memory:
            out.memory.append(memory.label)
    return out


def peer_layouts(regions: Sequence[RegionInfo]) -> list[TensorLayout]:
    """A producer rank's tensors, as its handshake reply described them (the
    planner takes their sub-block count from ours: the layouts are equal)."""
    return [
        TensorLayout(r.layer, r.kind, ChunkedRegion(tuple(r.region_ids), r.chunk_bytes, r.num_blocks * r.block_bytes),
                     r.block_bytes, r.num_blocks)
        for r in regions
    ]
