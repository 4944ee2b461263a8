"""Switch between the FAKE ``mori`` package in this directory and the real one.

The fake (``tests/transfer/fake_mori/mori``) is a host-memory stand-in for
MORI-IO used by the ``moriio-fake`` contract entry and the moriio tests; it
never ships. These functions are the registry's ``setup``/``skip_reason``
hooks, run in the test process and in spawned serving processes.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

FAKE_ROOT = os.path.dirname(os.path.abspath(__file__))
#: a sysfs-like directory listing one FAKE RDMA device
FAKE_SYSFS_INFINIBAND = os.path.join(FAKE_ROOT, "sysfs_infiniband")


def _purge_mori() -> None:
    for name in [n for n in sys.modules if n == "mori" or n.startswith("mori.")]:
        del sys.modules[name]


def _fake_loaded() -> bool:
    module = sys.modules.get("mori")
    return module is not None and getattr(module, "__fake__", False)


def use_fake() -> None:
    """Make ``import mori.io`` load the fake and the moriio backend see its device."""
    from atom_kv.transfer.moriio import MoriIOBackend

    if "mori" in sys.modules and not _fake_loaded():
        _purge_mori()
    if FAKE_ROOT not in sys.path:
        sys.path.insert(0, FAKE_ROOT)
    MoriIOBackend.sysfs_dir = FAKE_SYSFS_INFINIBAND


def use_real() -> None:
    """Undo :func:`use_fake`: ``import mori.io`` finds only a real installation."""
    from atom_kv.transfer.moriio import MoriIOBackend
    from atom_kv.transfer.moriio.probe import DEFAULT_SYSFS_INFINIBAND

    while FAKE_ROOT in sys.path:
        sys.path.remove(FAKE_ROOT)
    if _fake_loaded():
        _purge_mori()
    MoriIOBackend.sysfs_dir = DEFAULT_SYSFS_INFINIBAND


def real_moriio_skip_reason() -> Optional[str]:
    """None when the real MORI-IO can run here, else its one-line reason."""
    from atom_kv.transfer.moriio.probe import unavailable_reason

    use_real()
    return unavailable_reason()
