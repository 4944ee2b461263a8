"""Memory kinds: where a registered region's bytes live, read off the tensor.

A pointer alone does not say whether it is a host address or a device
address, and a backend that reads host memory (``tcp``'s serving thread,
``cma``'s ``process_vm_readv``) would read a GPU pointer as garbage or crash.
So every registration names its :class:`MemoryKind`, taken from the tensor
itself by :func:`memory_of` *before* its pointer is touched, and every
backend declares the kinds it can serve in
:attr:`~atom_kv.transfer.base.TransferBackend.memory_kinds`.
:func:`check_memory` is the one refusal, raised at registration.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from atom_kv.transfer._errors import UnsupportedMemory

__all__ = [
    "HOST", "MemoryKind", "UnsupportedMemory", "check_memory", "gpu", "gpu_unavailable_reason", "kinds_of",
    "memory_of", "pair_refusal",
]


class MemoryKind(NamedTuple):
    """``kind`` is "host" or "gpu"; ``device`` the GPU's index (-1 for host)."""

    kind: str
    device: int = -1

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    @property
    def label(self) -> str:
        """"host" or "gpu:N", the form logs, errors and the handshake use."""
        return "host" if self.kind == "host" else f"gpu:{self.device}"

    @classmethod
    def parse(cls, label: str) -> "MemoryKind":
        """Inverse of :attr:`label`; raises ``ValueError`` naming the allowed forms."""
        if label == "host":
            return HOST
        kind, sep, index = label.partition(":")
        if kind == "gpu" and sep and index.isdigit():
            return cls("gpu", int(index))
        raise ValueError(f"unknown memory kind {label!r}; allowed: 'host' or 'gpu:N'")


HOST = MemoryKind("host", -1)


def gpu(device: int) -> MemoryKind:
    """GPU ``device``'s memory."""
    if device < 0:
        raise ValueError(f"GPU index must be >= 0, got {device}")
    return MemoryKind("gpu", device)


def memory_of(tensor: Any) -> MemoryKind:
    """The memory ``tensor`` lives in, from its ``device`` (never its pointer).

    torch tensors on ``cuda`` (also ROCm builds of torch, which call HIP
    devices ``cuda``) are GPU memory; ``cpu`` tensors and objects without a
    ``device`` (numpy arrays) are host memory. Any other device type is
    refused: no backend here reads it.
    """
    device = getattr(tensor, "device", None)
    if device is None or isinstance(device, str) and device == "cpu":
        return HOST
    dtype = getattr(device, "type", None)
    if dtype is None:  # numpy >= 2 arrays have .device == "cpu" (a str), handled above
        return HOST
    if dtype == "cpu":
        return HOST
    if dtype == "cuda":
        index = getattr(device, "index", None)
        return gpu(int(index) if index is not None else 0)
    raise UnsupportedMemory(f"tensor on device {device} is neither host nor GPU memory; "
                            "put the KV cache on 'cpu' or 'cuda'")


def check_memory(backend_name: str, kinds: frozenset[str], memory: MemoryKind, *, instead: str = "") -> None:
    """Refuse, in one line, memory a backend cannot serve: names the backend,
    the memory and what to use instead (``instead``)."""
    if memory.kind in kinds:
        return
    hint = f"; {instead}" if instead else ""
    raise UnsupportedMemory(f"transfer backend {backend_name!r} cannot serve {memory.label} memory "
                            f"(it serves {', '.join(sorted(kinds))}){hint}")


def kinds_of(labels: "list[str] | tuple[str, ...]") -> frozenset[str]:
    """The kinds ("host", "gpu") a handshake's memory labels name; an empty
    list (a peer from before memory kinds were exchanged) means host memory.
    Unknown labels are kept as they are, so the refusal can name them."""
    if not labels:
        return frozenset({"host"})
    out = set()
    for label in labels:
        try:
            out.add(MemoryKind.parse(label).kind)
        except ValueError:
            out.add(label)
    return frozenset(out)


def pair_refusal(
    backend_name: str, kinds: frozenset[str], peer_labels: "list[str] | tuple[str, ...]", peer_is: str = "peer",
) -> "str | None":
    """One line refusing a peer whose registered memory ``backend_name`` (serving
    ``kinds`` here) cannot move, else None. Each side runs it on the other's
    labels from the handshake, so a pair that cannot work is refused on both."""
    missing = sorted(kinds_of(peer_labels) - kinds)
    if not missing:
        return None
    shown = ", ".join(peer_labels) if peer_labels else "host (an atom-kv that does not say)"
    return (f"memory kind mismatch: the {peer_is}'s KV cache is in {shown} memory, which transfer backend "
            f"{backend_name!r} cannot move (it serves {', '.join(sorted(kinds))}); use backend 'auto' on both "
            "engines, or one that serves both sides' memory (docs/gpu.md)")


def gpu_unavailable_reason(min_devices: int = 1) -> Optional[str]:
    """None when torch sees at least ``min_devices`` GPUs (CUDA, or ROCm
    through torch's ``cuda`` device), else why not, in one line."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        build = "ROCm" if getattr(torch.version, "hip", None) else ("CUDA" if torch.version.cuda else "CPU-only")
        return f"no GPU visible to torch {torch.__version__} ({build} build)"
    if torch.cuda.device_count() < min_devices:
        return f"{torch.cuda.device_count()} GPU(s) visible, {min_devices} needed"
    return None
