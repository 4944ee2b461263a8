"""Finding NIXL's Python API without importing it at ``import atom_kv`` time.

NIXL ships per-CUDA-major wheels (``nixl-cu12`` imports as ``nixl_cu12``,
``nixl-cu13`` as ``nixl_cu13``) and a ``nixl`` meta package that picks one.
:func:`load_nixl` tries them in that order and, when none loads, raises
:class:`BackendUnavailable` with one line that says how to install it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable, Optional

from atom_kv.transfer._errors import BackendUnavailable

__all__ = ["INSTALL_HINT", "MODULES", "load_nixl", "nixl_unavailable_reason"]

#: what to run to get NIXL (the wheel for CUDA 12; it also runs on CPU-only hosts)
INSTALL_HINT = 'pip install "atom-kv[nixl]"'

#: the modules that hold NIXL's Python API, tried in this order
MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl._api")

ImportFn = Callable[[str], ModuleType]


def load_nixl(import_fn: Optional[ImportFn] = None) -> ModuleType:
    """NIXL's ``_api`` module (``nixl_agent``, ``nixl_agent_config``), or
    :class:`BackendUnavailable` in one line naming the install command."""
    load = import_fn or importlib.import_module
    broken = ""
    for name in MODULES:
        try:
            module = load(name)
        except ModuleNotFoundError:
            continue
        except Exception as exc:  # installed but its native library does not load
            broken = broken or f"{name} is installed but does not load ({type(exc).__name__}: {' '.join(str(exc).split())})"
            continue
        if hasattr(module, "nixl_agent") and hasattr(module, "nixl_agent_config"):
            return module
        broken = broken or f"{name} has no nixl_agent (an unsupported NIXL version)"
    if broken:
        raise BackendUnavailable(f"transfer backend 'nixl' is unavailable: {broken}; reinstall it with: {INSTALL_HINT}")
    raise BackendUnavailable(f"transfer backend 'nixl' needs NIXL, which is not installed; install it with: {INSTALL_HINT}")


def nixl_unavailable_reason(import_fn: Optional[ImportFn] = None) -> Optional[str]:
    """None when NIXL's Python API loads here, else the one-line reason."""
    try:
        load_nixl(import_fn)
    except BackendUnavailable as exc:
        return str(exc)
    return None
