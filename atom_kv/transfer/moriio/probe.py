"""Whether MORI-IO can run on this machine, and why not in one line.

``mori`` is imported here only when a ``moriio`` backend is being built, never
at ``import atom_kv`` time. Every check takes its inputs as arguments (the
import function, the sysfs directory, the environment) so it is unit-testable
on machines without ROCm or RDMA hardware.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Any, Callable, Mapping, Optional

from atom_kv.transfer.base import BackendUnavailable

__all__ = [
    "UNAVAILABLE_PREFIX",
    "DEFAULT_SYSFS_INFINIBAND",
    "ImportFn",
    "describe_import_error",
    "rdma_device_problem",
    "load_mori",
    "unavailable_reason",
    "resolve",
]

logger = logging.getLogger(__name__)

UNAVAILABLE_PREFIX = "MORI-IO unavailable: "
#: where the kernel lists RDMA devices (one directory entry per device)
DEFAULT_SYSFS_INFINIBAND = "/sys/class/infiniband"

ImportFn = Callable[[str], ModuleType]

_FALLBACK = 'or set "backend": "tcp" in --kv-transfer-config'
_ROCM_LIBS = ("libamdhip64", "libhsa-runtime64", "libhsa-runtime", "librocm", "libhiprtc")


def _one_line(text: str, limit: int = 240) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def describe_import_error(exc: BaseException) -> str:
    """Say in one line what is missing when ``import mori.io`` raised ``exc``."""
    text = _one_line(str(exc))
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "mori":
        return (
            f"No module named {exc.name!r}; install it on a ROCm 7 machine with "
            f"`pip install 'atom-kv[mori]'` (wheels exist for Python 3.10 and 3.12), {_FALLBACK}"
        )
    lowered = text.lower()
    if any(lib in lowered for lib in _ROCM_LIBS):
        return (
            f"the ROCm runtime library could not be loaded ({text}); MORI-IO needs ROCm 7 "
            f"(libamdhip64.so.7, libhsa-runtime64.so.1) on the loader path, {_FALLBACK}"
        )
    if "libibverbs" in lowered:
        return f"libibverbs could not be loaded ({text}); install rdma-core, {_FALLBACK}"
    if "glibc" in lowered:
        return f"the mori wheel needs a newer glibc ({text}), {_FALLBACK}"
    return f"importing mori.io failed: {type(exc).__name__}: {text}; {_FALLBACK}"


def rdma_device_problem(
    sysfs_dir: str = DEFAULT_SYSFS_INFINIBAND, environ: Optional[Mapping[str, str]] = None
) -> Optional[str]:
    """None when an RDMA device is usable, else one line saying what is missing.

    ``MORI_RDMA_DEVICES`` (comma separated, optional ``:port`` suffix, a
    leading ``^`` meaning "exclude") must name devices that exist.
    """
    env = os.environ if environ is None else environ
    try:
        devices = sorted(os.listdir(sysfs_dir)) if os.path.isdir(sysfs_dir) else []
    except OSError as exc:
        return f"cannot list RDMA devices in {sysfs_dir}: {exc.strerror or exc}"
    if not devices:
        return (
            f"no RDMA device found under {sysfs_dir}; the rdma transport needs an RDMA NIC "
            f'(use "moriio": {{"transport": "xgmi"}} for two engines on one node), {_FALLBACK}'
        )
    wanted = env.get("MORI_RDMA_DEVICES", "").strip()
    if not wanted or wanted.startswith("^"):
        return None
    names = [item.strip().split(":", 1)[0] for item in wanted.split(",") if item.strip()]
    missing = [n for n in names if n not in devices]
    if missing:
        return (
            f"MORI_RDMA_DEVICES names {', '.join(missing)} but the devices under {sysfs_dir} "
            f"are {', '.join(devices)}; fix MORI_RDMA_DEVICES or unset it"
        )
    return None


def load_mori(
    import_fn: Optional[ImportFn] = None,
    *,
    transport: str = "rdma",
    sysfs_dir: str = DEFAULT_SYSFS_INFINIBAND,
    environ: Optional[Mapping[str, str]] = None,
) -> ModuleType:
    """Import ``mori.io`` and check the hardware ``transport`` needs.

    Raises :class:`BackendUnavailable` whose message is one line starting
    with ``"MORI-IO unavailable: "``.
    """
    importer = import_fn or importlib.import_module
    try:
        module = importer("mori.io")
    except Exception as exc:  # ImportError, OSError from dlopen, RuntimeError from HIP init
        logger.debug("import mori.io failed", exc_info=True)
        raise BackendUnavailable(UNAVAILABLE_PREFIX + describe_import_error(exc)) from None
    if transport == "rdma":
        problem = rdma_device_problem(sysfs_dir, environ)
        if problem:
            raise BackendUnavailable(UNAVAILABLE_PREFIX + problem)
    return module


def unavailable_reason(
    import_fn: Optional[ImportFn] = None,
    *,
    transport: str = "rdma",
    sysfs_dir: str = DEFAULT_SYSFS_INFINIBAND,
    environ: Optional[Mapping[str, str]] = None,
) -> Optional[str]:
    """None when :func:`load_mori` would succeed, else its one-line reason."""
    try:
        load_mori(import_fn, transport=transport, sysfs_dir=sysfs_dir, environ=environ)
    except BackendUnavailable as exc:
        return str(exc)
    return None


def resolve(module: ModuleType, name: str, import_fn: Optional[ImportFn] = None) -> Any:
    """``mori.io.<name>``, falling back to ``mori.cpp.<name>`` (older wheels
    export some symbols, e.g. ``PollCqMode``, only from ``mori.cpp``)."""
    value = getattr(module, name, None)
    if value is not None:
        return value
    importer = import_fn or importlib.import_module
    try:
        cpp = importer("mori.cpp")
    except Exception as exc:
        raise BackendUnavailable(
            f"{UNAVAILABLE_PREFIX}mori.io has no {name} and mori.cpp cannot be imported ({_one_line(str(exc))})"
        ) from None
    value = getattr(cpp, name, None)
    if value is None:
        raise BackendUnavailable(
            f"{UNAVAILABLE_PREFIX}this mori version has no {name}; upgrade with `pip install -U 'atom-kv[mori]'`"
        )
    return value
