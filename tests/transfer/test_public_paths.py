"""Every ``atom_kv.transfer`` import path that users, the docs and the scripts
name keeps working, with the names taken from it; the old flat paths of the
probes are the very modules their sub-packages hold."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from atom_kv.transfer.base import TransferBackend

#: public path -> the names users take from it
PUBLIC = {
    "atom_kv.transfer": (
        "BACKENDS", "MAX_REGION_BYTES", "BackendUnavailable", "ChunkedRegion", "HOST", "MemoryKind", "ReadHandle",
        "ReadOp", "TransferBackend", "TransferError", "UnsupportedMemory", "chunk_sizes", "create_backend",
        "memory_of", "merge_ops", "split_pair",
    ),
    "atom_kv.transfer.base": (
        "MAX_REGION_BYTES", "BackendUnavailable", "ChunkedRegion", "ReadHandle", "ReadOp", "TransferBackend",
        "TransferError", "UnsupportedMemory", "chunk_sizes", "merge_ops", "split_pair",
    ),
    "atom_kv.transfer.memory": (
        "HOST", "MemoryKind", "UnsupportedMemory", "check_memory", "gpu", "gpu_unavailable_reason", "kinds_of",
        "memory_of", "pair_refusal",
    ),
    "atom_kv.transfer.routes": ("ROUTES", "Route", "choose_route"),
    "atom_kv.transfer.auto": ("AutoBackend", "FALLBACK_REASONS"),
    "atom_kv.transfer.tcp": ("TcpBackend", "plan_jobs"),
    "atom_kv.transfer.cma": ("CmaBackend", "cma_unavailable_reason"),
    "atom_kv.transfer.gpu_ipc": ("GpuIpcBackend", "pid_exited"),
    "atom_kv.transfer.nixl": ("NixlBackend",),
    "atom_kv.transfer.moriio": ("MoriIOBackend",),
    "atom_kv.transfer.staging": ("HostCopier", "StagingPool", "copier_for", "recv_staged", "send_staged"),
    "atom_kv.transfer.nixl.probe": ("INSTALL_HINT", "MODULES", "load_nixl", "nixl_unavailable_reason"),
    "atom_kv.transfer.moriio.probe": ("DEFAULT_SYSFS_INFINIBAND", "load_mori", "unavailable_reason"),
    # the probes' old flat paths (docs and scripts named them)
    "atom_kv.transfer.nixl_probe": ("INSTALL_HINT", "MODULES", "load_nixl", "nixl_unavailable_reason"),
    "atom_kv.transfer.moriio_probe": ("DEFAULT_SYSFS_INFINIBAND", "load_mori", "unavailable_reason"),
}


@pytest.mark.parametrize("path", sorted(PUBLIC))
def test_each_public_path_imports_with_the_names_users_take_from_it(path: str) -> None:
    module = importlib.import_module(path)
    missing = [name for name in PUBLIC[path] if not hasattr(module, name)]
    assert missing == [], f"{path} lost {missing}"


@pytest.mark.parametrize("old, new", [("atom_kv.transfer.nixl_probe", "atom_kv.transfer.nixl.probe"),
                                      ("atom_kv.transfer.moriio_probe", "atom_kv.transfer.moriio.probe")])
def test_an_old_probe_path_is_the_same_module(old: str, new: str) -> None:
    # the same object: a test or script that patches one patches what the backend reads
    assert importlib.import_module(old) is importlib.import_module(new)


def test_the_old_probe_paths_import_first_in_a_fresh_interpreter() -> None:
    code = ("from atom_kv.transfer.nixl_probe import nixl_unavailable_reason\n"
            "from atom_kv.transfer.moriio_probe import unavailable_reason\n"
            "import atom_kv.transfer.nixl_probe as a, atom_kv.transfer.nixl.probe as b\n"
            "assert a is b and callable(nixl_unavailable_reason) and callable(unavailable_reason)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_every_named_backend_resolves_to_its_class() -> None:
    from atom_kv.transfer import BACKENDS

    assert set(BACKENDS) == {"auto", "tcp", "cma", "gpu_ipc", "nixl", "moriio"}
    for name, target in BACKENDS.items():
        module_name, cls_name = target.split(":")
        cls = getattr(importlib.import_module(module_name), cls_name)
        assert issubclass(cls, TransferBackend) and cls.name == name, target
