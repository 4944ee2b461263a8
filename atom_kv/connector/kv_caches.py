"""One TP rank's KV caches as the connector sees them.

:func:`describe_kv_caches` is the one place that knows how an engine lays out
its caches: it checks what the engine passes to ``register_kv_caches``
against the :class:`~atom_kv.wire.CompatInfo` and turns it into a list of
:class:`KVTensor` (layer, kind, tensor, block_bytes, num_blocks). Supported
today: per layer a ``(k, v)`` pair ``[num_blocks, kv_heads, block_size,
head_dim]`` (HND), or one MLA latent ``[num_blocks, block_size, latent_dim]``.
Every layout must keep one block's slice of one head a contiguous byte run.

:func:`register_kv_tensors` registers them with the transfer backend, and
:func:`peer_layouts` reads a peer's registration back from its handshake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

from atom_kv.connector.base import KVCacheLayer
from atom_kv.connector.layout import TensorLayout
from atom_kv.transfer import ChunkedRegion, TransferBackend, chunk_sizes
from atom_kv.wire import CompatInfo, RegionInfo

__all__ = ["KVTensor", "RegisteredKV", "describe_kv_caches", "peer_layouts", "register_kv_tensors"]


class KVTensor(NamedTuple):
    """One cache tensor of this rank: ``kind`` is "k", "v" or "latent";
    ``block_bytes`` the bytes of one block (this rank's heads)."""

    layer: int
    kind: str
    tensor: Any
    block_bytes: int
    num_blocks: int


@dataclass
class RegisteredKV:
    """This rank's registered caches: how to address them locally
    (``layouts``), what a peer is told (``regions``), and the tensors,
    kept alive while the backend may read or write them."""

    layouts: list[TensorLayout] = field(default_factory=list)
    regions: list[RegionInfo] = field(default_factory=list)
    tensors: list[Any] = field(default_factory=list)


def describe_kv_caches(kv_caches: Sequence[KVCacheLayer], compat: CompatInfo, tp_size: int) -> list[KVTensor]:
    """Validate the engine's caches (one entry per layer) and describe each tensor.

    Raises ``ValueError`` with one line naming the layer and what was expected.
    """
    if len(kv_caches) != compat.num_layers:
        raise ValueError(f"got {len(kv_caches)} KV cache layers, compat says num_layers={compat.num_layers}")
    out: list[KVTensor] = []
    for layer, entry in enumerate(kv_caches):
        if compat.is_mla:
            named = [("latent", entry)]
        else:
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise ValueError(f"layer {layer}: expected a (k, v) pair of tensors")
            named = [("k", entry[0]), ("v", entry[1])]
        for kind, tensor in named:
            block_bytes = _block_bytes(layer, kind, tensor, compat, tp_size)
            out.append(KVTensor(layer, kind, tensor, block_bytes, int(tensor.shape[0])))
    return out


def _block_bytes(layer: int, kind: str, t: Any, compat: CompatInfo, tp_size: int) -> int:
    """Check one tensor's shape and contiguity; the bytes of one of its blocks."""
    shape = tuple(int(s) for s in t.shape)
    if compat.is_mla:
        ok = len(shape) == 3 and shape[1] == compat.block_size
        want = "[num_blocks, block_size, latent_dim]"
    else:
        heads = compat.num_kv_heads // tp_size
        ok = len(shape) == 4 and shape[1:] == (heads, compat.block_size, compat.head_dim)
        want = f"[num_blocks, {heads}, {compat.block_size}, {compat.head_dim}]"
    if not ok:
        raise ValueError(f"layer {layer} {kind} cache has shape {list(shape)}, expected {want}")
    if hasattr(t, "is_contiguous") and not t.is_contiguous():
        raise ValueError(f"layer {layer} {kind} cache must be contiguous")
    return (t.numel() // shape[0]) * t.element_size()


def register_kv_tensors(backend: TransferBackend, tensors: Sequence[KVTensor]) -> RegisteredKV:
    """Register every tensor with ``backend`` (block-aligned chunks)."""
    out = RegisteredKV()
    for kt in tensors:
        nbytes = kt.tensor.numel() * kt.tensor.element_size()
        ids = backend.register_memory(kt.tensor.data_ptr(), nbytes, align=kt.block_bytes)
        chunk = chunk_sizes(nbytes, kt.block_bytes, backend.max_region_bytes)[0]
        region = ChunkedRegion(tuple(ids), chunk, nbytes)
        out.layouts.append(TensorLayout(kt.layer, kt.kind, region, kt.block_bytes, kt.num_blocks))
        out.regions.append(RegionInfo(layer=kt.layer, kind=kt.kind, region_ids=list(ids), chunk_bytes=chunk,
                                      block_bytes=kt.block_bytes, num_blocks=kt.num_blocks))
        out.tensors.append(kt.tensor)
    return out


def peer_layouts(regions: Sequence[RegionInfo]) -> list[TensorLayout]:
    """A producer rank's tensors, as its handshake reply described them."""
    return [
        TensorLayout(r.layer, r.kind, ChunkedRegion(tuple(r.region_ids), r.chunk_bytes, r.num_blocks * r.block_bytes),
                     r.block_bytes, r.num_blocks)
        for r in regions
    ]
