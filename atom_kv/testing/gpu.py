"""Whether the GPU tests and benches can run here, in one line when not."""

from __future__ import annotations

from typing import Optional

__all__ = ["gpu_unavailable_reason"]


def gpu_unavailable_reason(min_devices: int = 1) -> Optional[str]:
    """None when torch sees at least ``min_devices`` GPUs (CUDA, or ROCm
    through torch's ``cuda`` device), else why not."""
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
