"""The KV-cache layouts atom-kv can move, described without touching a tensor.

A layout fixes how one TP rank's cache tensors are shaped. Every layout here
keeps one head's slice of one *unit* a contiguous byte run, where a unit is a
block, or one of the ``block_ratio`` physical blocks a block is stored as.
That is all the read planner (:mod:`atom_kv.connector.layout`) relies on, so
engines with different TP sizes read exactly the heads they own in every
layout. What differs between layouts is the order of the bytes *inside* a
run, so two engines may only exchange KV when their layouts are equal: the
handshake compares :attr:`KVLayout.label`.

Notation: ``B`` blocks of ``block_size`` tokens (the scheduler's blocks),
stored as ``P = B * block_ratio`` physical blocks of ``p = block_size /
block_ratio`` tokens; ``h`` KV heads on this rank, ``d`` the head size,
``x = 16 / element size`` (AITER packs 16 bytes), ``L`` the MLA latent size.

================= =================================== ==========================
layout            ``k`` / ``v``                       ``k_scale`` / ``v_scale``
================= =================================== ==========================
``hnd``           ``[P, h, p, d]`` both               --
``aiter``         K ``[P, h, d/x, p, x]``             ``[P, h, p]`` (fp8 caches)
                  V ``[P, h, d, p]``
``aiter-shuffle`` K ``[P, h, d/x, p, x]``             ``[P, h, p]`` (fp8 caches)
                  V ``[P, h, p/x, d, x]``
``mla``           ``latent`` token major: ``[P*p, 1, L]`` or ``[P, p, L]``, one
                  per layer, the same on every rank; ``index`` (DeepSeek-V3.2's
                  indexer keys) likewise
``vllm-hnd``      one ``kv`` tensor ``[P, h, p, C]``, ``C = d_k + d_v``: each
                  token's row is its K then its V
``vllm-cpu``      one ``kv`` tensor ``[P, h, p, 2d]`` holding, per (block, head),
                  the ``p`` K rows and then the ``p`` V rows (``[P, h, 2, p, d]``)
================= =================================== ==========================

ATOM at 0c982ea92 allocates ``aiter``; ATOM main (ffdf3bb5d) allocates
``aiter-shuffle`` and, for MLA models, ``mla`` with ``p = 1``. The reference
engine uses ``hnd`` with ``block_ratio`` 1.

vLLM 0.32 allocates one tensor per layer, logically ``[blocks, kv_heads,
block_size, C]`` (HND, its ``LBHNC``), whose rows the attention backend
interprets: its GPU and ROCm backends (FLASH_ATTN, TRITON_ATTN, ROCm AITER FA
without the shuffled cache, ROCM_AITER_UNIFIED_ATTN, FLEX_ATTENTION) as K
then V per token (``vllm-hnd``), its CPU backend (CPU_ATTN) as the block's K
rows followed by its V rows (``vllm-cpu``). Same shape, different bytes, so
they are two layouts. vLLM's MLA caches (``[blocks, 1, block_size, L]``) are
``mla``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = [
    "FUSED", "HEAD_MAJOR", "KINDS", "LAYOUT_NAMES", "KVLayout", "LayoutMismatch", "TensorGeometry", "describe_tensor",
    "detect_layout",
]

#: Layouts with one tensor per layer holding K and V together (kind ``kv``).
FUSED = ("vllm-hnd", "vllm-cpu")
#: Layouts whose units are head major (a TP rank holds a slice of the heads).
HEAD_MAJOR = ("hnd", "aiter", "aiter-shuffle") + FUSED
LAYOUT_NAMES = HEAD_MAJOR + ("mla",)
#: Tensor kinds per layer: KV and fp8 scales for head-major layouts, one fused
#: ``kv`` tensor for vLLM's, latent and indexer keys for MLA.
KINDS = {"hnd": ("k", "v"), "aiter": ("k", "v", "k_scale", "v_scale"),
         "aiter-shuffle": ("k", "v", "k_scale", "v_scale"), "vllm-hnd": ("kv",), "vllm-cpu": ("kv",),
         "mla": ("latent", "index")}
_AITER_PACK_BYTES = 16


class LayoutMismatch(ValueError):
    """A tensor does not have the shape its layout prescribes (one line)."""


@dataclass(frozen=True)
class KVLayout:
    """One engine's KV-cache layout: its ``name`` and how many physical blocks
    make one scheduler block (``block_ratio``)."""

    name: str
    block_ratio: int = 1

    def __post_init__(self) -> None:
        if self.name not in LAYOUT_NAMES:
            raise ValueError(f"unknown KV layout {self.name!r}; known: {', '.join(LAYOUT_NAMES)}")
        if self.block_ratio < 1:
            raise ValueError(f"block_ratio must be >= 1, got {self.block_ratio}")

    @property
    def is_mla(self) -> bool:
        return self.name == "mla"

    @property
    def is_fused(self) -> bool:
        """One tensor per layer holding K and V (kind ``kv``)."""
        return self.name in FUSED

    @property
    def units(self) -> int:
        """Head-major sub-blocks per block (MLA is token major: one run per block)."""
        return 1 if self.is_mla else self.block_ratio

    @property
    def label(self) -> str:
        """What the handshake compares: the name, plus ``/ratio=N`` when a block is N physical blocks.

        MLA is token major, so its bytes per block do not depend on the ratio.
        """
        if self.is_mla or self.block_ratio == 1:
            return self.name
        return f"{self.name}/ratio={self.block_ratio}"

    @classmethod
    def parse(cls, label: str) -> "KVLayout":
        """The inverse of :attr:`label`."""
        name, _, rest = label.partition("/ratio=")
        return cls(name, int(rest) if rest else 1)


@dataclass(frozen=True)
class TensorGeometry:
    """What the transfer needs to know about one cache tensor."""

    kind: str
    num_blocks: int   # scheduler blocks
    block_bytes: int  # bytes of one block on this rank
    units: int        # contiguous head-major sub-blocks per block
    heads: int        # heads per unit (1 for MLA)
    head_dim: int     # d, or the MLA latent / indexer width


def detect_layout(k_shape: Sequence[int], v_shape: Optional[Sequence[int]], block_size: int) -> KVLayout:
    """The layout of one layer's ``(k, v)`` shapes (``v`` None: MLA), with its block ratio.

    Raises :class:`LayoutMismatch` for shapes no supported layout has.
    """
    k = tuple(int(s) for s in k_shape)
    if v_shape is None:
        return KVLayout("mla")
    v = tuple(int(s) for s in v_shape)
    if len(k) == 4 and len(v) == 4:
        name, p = "hnd", k[2]
    elif len(k) == 5 and len(v) == 4:
        name, p = "aiter", k[3]
    elif len(k) == 5 and len(v) == 5:
        name, p = "aiter-shuffle", k[3]
    else:
        raise LayoutMismatch(
            f"K cache {list(k)} with V cache {list(v)} is no supported KV layout "
            f"(supported: {', '.join(LAYOUT_NAMES)}; see atom_kv.connector.cache_layouts)"
        )
    if p < 1 or block_size % p:
        raise LayoutMismatch(f"K cache {list(k)}: {p}-token physical blocks do not divide the block size {block_size}")
    return KVLayout(name, block_size // p)


def describe_tensor(layout: KVLayout, kind: str, shape: Sequence[int], element_size: int, *,
                    block_size: int, heads: int, head_dim: Optional[int] = None) -> TensorGeometry:
    """Check one tensor against ``layout`` and say where its blocks and heads are.

    ``heads`` is this rank's KV head count (ignored for MLA); ``head_dim``,
    when known (say from the layer's K tensor), is checked too, else read
    from ``shape``. Raises :class:`LayoutMismatch` naming the expected shape.
    """
    shape = tuple(int(s) for s in shape)
    if kind not in KINDS[layout.name]:
        raise LayoutMismatch(f"a {layout.name} cache has no {kind!r} tensor (kinds: {', '.join(KINDS[layout.name])})")
    if block_size % layout.block_ratio:
        raise LayoutMismatch(f"block_ratio {layout.block_ratio} does not divide the block size {block_size}")
    if layout.is_mla:
        return _describe_token_major(layout, kind, shape, element_size, block_size)
    r, p = layout.block_ratio, block_size // layout.block_ratio
    x = _AITER_PACK_BYTES // element_size if _AITER_PACK_BYTES % element_size == 0 else 0
    if layout.name.startswith("aiter") and not kind.endswith("_scale") and x == 0:
        raise LayoutMismatch(f"{layout.name} packs 16 bytes; {element_size}-byte elements do not divide them")
    if layout.name == "aiter-shuffle" and kind == "v" and p % x:
        raise LayoutMismatch(f"aiter-shuffle V packs {x} tokens; {p}-token physical blocks cannot hold them")
    if not shape or shape[0] % r:
        raise LayoutMismatch(f"{kind} cache {list(shape)}: {shape[0] if shape else 0} physical blocks are not "
                             f"a multiple of block_ratio {r}")
    P = shape[0]
    d = head_dim if head_dim is not None else _head_dim(layout.name, kind, shape, x)
    if layout.name == "vllm-cpu" and d % 2:
        raise LayoutMismatch(f"kv cache rows are {d} wide; vllm-cpu keeps a block's K rows and V rows at "
                             "equal widths, so a row must be even")
    want = _expected(layout.name, kind, P, heads, p, d, x)
    if shape != want:
        raise LayoutMismatch(f"{kind} cache has shape {list(shape)}, expected {_show(layout.name, kind, want)} "
                             f"for layout {layout.label}")
    per_unit = math.prod(shape[1:]) * element_size
    return TensorGeometry(kind, P // r, per_unit * r, r, heads, 0 if kind.endswith("_scale") else d)


def _describe_token_major(layout: KVLayout, kind: str, shape: tuple[int, ...], element_size: int,
                          block_size: int) -> TensorGeometry:
    if len(shape) != 3:
        raise LayoutMismatch(f"{kind} cache has shape {list(shape)}, expected a token-major "
                             f"[tokens, 1, width] or [blocks, tokens_per_block, width] tensor for layout mla")
    tokens, width = shape[0] * shape[1], shape[2]
    if tokens % block_size:
        raise LayoutMismatch(f"{kind} cache has shape {list(shape)}: {tokens} token slots are not whole "
                             f"{block_size}-token blocks")
    return TensorGeometry(kind, tokens // block_size, block_size * width * element_size, 1, 1, width)


def _head_dim(name: str, kind: str, shape: tuple[int, ...], x: int) -> int:
    if kind.endswith("_scale") or len(shape) < 4:
        return 0
    if name in ("hnd",) + FUSED or (name == "aiter" and kind == "v"):
        return shape[2] if name == "aiter" else shape[3]
    if kind == "k":
        return shape[2] * x
    return shape[3]  # aiter-shuffle v: [P, h, p/x, d, x]


def _expected(name: str, kind: str, P: int, h: int, p: int, d: int, x: int) -> tuple[int, ...]:
    """The shape ``kind`` must have (``x`` > 0 for AITER's packed tensors)."""
    if kind.endswith("_scale"):
        return (P, h, p)
    if name == "hnd" or name in FUSED:
        return (P, h, p, d)
    if kind == "k":
        return (P, h, d // x, p, x)
    if name == "aiter":
        return (P, h, d, p)
    return (P, h, p // x, d, x)


def _show(name: str, kind: str, want: tuple[int, ...]) -> str:
    symbolic = {
        ("hnd", "k"): "[blocks, heads, block, head_dim]", ("hnd", "v"): "[blocks, heads, block, head_dim]",
        ("aiter", "k"): "[blocks, heads, head_dim/x, block, x]", ("aiter", "v"): "[blocks, heads, head_dim, block]",
        ("aiter-shuffle", "k"): "[blocks, heads, head_dim/x, block, x]",
        ("aiter-shuffle", "v"): "[blocks, heads, block/x, head_dim, x]",
        ("vllm-hnd", "kv"): "[blocks, heads, block, K|V]", ("vllm-cpu", "kv"): "[blocks, heads, block, 2*head_dim]",
    }.get((name, kind), "[blocks, heads, block]")
    return f"{list(want)} {symbolic}"
