"""Keeping a second libnl out of a process that loads NIXL (``UCX_MODULES``).

The NIXL wheels bundle UCX with their own copies of libibverbs, libnl-3 and
libnl-route-3. One of the bundled UCX modules, ``efa`` (``libuct_ib_efa``,
for AWS EFA NICs), links the system's ``libefa.so.1`` instead, which rdma-core's
``ibverbs-providers`` package installs; that pulls in the system's
``libibverbs.so.1``, ``libnl-3.so.200`` and ``libnl-route-3.so.200``. Two
libnl-route copies then register the same traffic-control operations: the
second copy's registrations are refused, and at process exit its destructors
unlink operations that were never linked, so the process dies with SIGSEGV in
``rtnl_tc_unregister`` during ``_dl_fini``, after every close has run.

:func:`apply_ucx_modules` exports ``UCX_MODULES=^efa`` before the first agent
loads UCX, unless the operator set ``UCX_MODULES`` or this host has an EFA
device (there the module is needed, and the crash at exit is NIXL's bug to fix).
:func:`duplicate_libnl` names the copies mapped into this process, so a process
where UCX was loaded before us (by another library) can be told what will happen.
"""

from __future__ import annotations

import logging
import os
from typing import MutableMapping, Optional

__all__ = ["DEFAULT_SYSFS_INFINIBAND", "UCX_MODULES_VALUE", "apply_ucx_modules", "duplicate_libnl",
           "efa_devices", "ucx_modules_value"]

logger = logging.getLogger(__name__)

#: where the kernel lists RDMA devices
DEFAULT_SYSFS_INFINIBAND = "/sys/class/infiniband"

#: UCX's module patterns: every module but ``efa`` (the one that links the system's libibverbs)
UCX_MODULES_VALUE = "^efa"

#: the kernel driver of AWS EFA devices
_EFA_DRIVER = "efa"

#: the library whose second copy crashes the process at exit
_LIBNL_ROUTE = "libnl-route-3"


def efa_devices(sysfs_dir: str = DEFAULT_SYSFS_INFINIBAND) -> list[str]:
    """The RDMA devices under ``sysfs_dir`` whose kernel driver is ``efa``."""
    try:
        names = sorted(os.listdir(sysfs_dir))
    except OSError:  # no RDMA subsystem here
        return []
    found = []
    for name in names:
        driver = os.path.join(sysfs_dir, name, "device", "driver")
        if os.path.basename(os.path.realpath(driver)) == _EFA_DRIVER:
            found.append(name)
    return found


def ucx_modules_value(environ: MutableMapping[str, str], sysfs_dir: str = DEFAULT_SYSFS_INFINIBAND) -> Optional[str]:
    """The ``UCX_MODULES`` to export, or None to leave the environment as it is
    (the operator set it, or an EFA device needs the module)."""
    if "UCX_MODULES" in environ:
        return None
    if efa_devices(sysfs_dir):
        return None
    return UCX_MODULES_VALUE


def apply_ucx_modules(environ: Optional[MutableMapping[str, str]] = None,
                      sysfs_dir: str = DEFAULT_SYSFS_INFINIBAND) -> Optional[str]:
    """Export ``UCX_MODULES`` (see :func:`ucx_modules_value`) into ``environ``
    (``os.environ`` by default); returns what was set, else None.

    UCX reads ``UCX_MODULES`` once, when its library is loaded: the first NIXL
    agent of the process. Called later, the value is set but has no effect."""
    env = os.environ if environ is None else environ
    value = ucx_modules_value(env, sysfs_dir)
    if value is None:
        if "UCX_MODULES" not in env:
            logger.warning("nixl: EFA device(s) %s found, so UCX's efa module stays loadable; with rdma-core "
                           "installed this process may end with SIGSEGV at exit (see docs/nixl.md, "
                           "'Exit on hosts with rdma-core')", ", ".join(efa_devices(sysfs_dir)))
        return None
    env["UCX_MODULES"] = value
    logger.debug("nixl: UCX_MODULES=%s (keeps a second libnl out of this process)", value)
    return value


def duplicate_libnl(maps_path: str = "/proc/self/maps") -> list[str]:
    """The distinct ``libnl-route-3`` files mapped into this process when
    there is more than one (an empty list when there is one or none)."""
    paths = set()
    try:
        with open(maps_path, encoding="utf-8", errors="replace") as maps:
            for line in maps:  # address perms offset device inode path
                fields = line.split(None, 5)
                if len(fields) == 6 and _LIBNL_ROUTE in fields[5]:
                    paths.add(os.path.realpath(fields[5].strip()))
    except OSError:  # no procfs here
        return []
    return sorted(paths) if len(paths) > 1 else []
