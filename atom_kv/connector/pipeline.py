"""Prefill pipeline stages: which layers a stage's KV caches are, and where
a consumer finds each layer.

With pipeline parallelism (PP) a prefill engine's layers are split over
stages; each stage's ranks register only their own layers and answer
handshakes on their own side-channel ports (``wire.handshake_port`` with
``pp_rank``). A stage's cache list is group-major in ATOM's sense (for each
kind of tensor, its layers in order); :func:`consumer_region_indices` maps a
stage's local regions onto the full model's, as ATOM main's
``port_offset.consumer_region_indices`` defines it, and
:func:`stage_layers` turns that into the global layer of each local layer.
A consumer reads each layer from the stage whose handshake names it
(:func:`check_stage_cover`).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

__all__ = ["consumer_region_indices", "stage_layers", "check_stage_cover"]


def consumer_region_indices(num_local_regions: int, num_local_layers: int, start_layer: int,
                            num_consumer_regions: int, pp_size: int) -> Optional[list[int]]:
    """The consumer-side index of each of a stage's regions, or None when the
    stage's regions are not a uniform group-major block of the consumer's.

    A stage holds ``groups = num_local_regions / num_local_layers`` groups
    (kinds) of ``num_local_layers`` regions each; on the consumer every group
    spans ``num_consumer_regions / groups`` regions (its stride), so local
    region ``g*num_local_layers + l`` is consumer region
    ``g*stride + start_layer + l``. With one stage the map is the identity."""
    if pp_size == 1 or num_local_layers == 0 or num_local_regions == 0:
        return list(range(num_local_regions))
    if num_local_regions % num_local_layers:
        return None
    groups = num_local_regions // num_local_layers
    if num_consumer_regions % groups:
        return None
    stride = num_consumer_regions // groups
    out = [g * stride + start_layer + layer for g in range(groups) for layer in range(num_local_layers)]
    return out if out[-1] < num_consumer_regions else None


def stage_layers(num_local_regions: int, num_local_layers: int, start_layer: int, num_layers: int,
                 pp_size: int, pp_rank: int) -> list[int]:
    """The global layer of each of a stage's ``num_local_layers`` layers (``num_local_regions``
    tensors in all) in a model of ``num_layers``; raises ``ValueError`` in one line when the
    stage cannot be mapped onto the consumer's layers."""
    groups = num_local_regions // num_local_layers if num_local_layers else 0
    indices = None
    if start_layer >= 0 and num_local_layers > 0:
        indices = consumer_region_indices(num_local_regions, num_local_layers, start_layer, groups * num_layers,
                                          pp_size)
    if indices is None:
        raise ValueError(
            f"pipeline stage {pp_rank} of {pp_size}: {num_local_layers} layers ({num_local_regions} tensors) "
            f"starting at layer {start_layer} do not map onto the model's {num_layers} layers")
    stride = num_layers
    # group-major: the first group's indices are the layers themselves
    return [i % stride for i in indices[:num_local_layers]]


def check_stage_cover(local_layers: Iterable[int], stage_held: Sequence[Sequence[int]]) -> Optional[str]:
    """None when the stages' layers (``stage_held[s]``: what stage ``s``'s handshake named)
    cover every layer here exactly once; else why not, in one line."""
    want = sorted(set(local_layers))
    seen: dict[int, int] = {}
    for stage, layers in enumerate(stage_held):
        for layer in layers:
            if layer in seen:
                return f"layer {layer} is held by prefill stages {seen[layer]} and {stage}"
            seen[layer] = stage
    missing = [layer for layer in want if layer not in seen]
    extra = sorted(set(seen) - set(want))
    if missing:
        return f"no prefill stage holds layer(s) {missing} (the stages hold {sorted(seen)})"
    if extra:
        return f"prefill stages hold layer(s) {extra} that this engine does not have"
    return None
