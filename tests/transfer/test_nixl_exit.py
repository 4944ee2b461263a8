"""A process that loaded NIXL exits with status 0 where rdma-core is installed:
``UCX_MODULES`` keeps UCX's ``efa`` module (and with it the system's second
libnl) out unless an EFA device needs it or the operator chose otherwise. The
process test runs against real NIXL (skipped, with the install line, where it
is not installed); it crashes at exit without the fix only where the system
has ``libibverbs1`` (``ibverbs-providers``) installed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from atom_kv.transfer.nixl import probe as nixl_probe
from atom_kv.transfer.nixl.ucx_modules import (
    UCX_MODULES_VALUE,
    apply_ucx_modules,
    duplicate_libnl,
    efa_devices,
    ucx_modules_value,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

needs_nixl = pytest.mark.skipif(bool(nixl_probe.nixl_unavailable_reason()),
                                reason=nixl_probe.nixl_unavailable_reason() or "")


def _fake_sysfs(tmp_path, devices: dict[str, str]) -> str:
    """A fake /sys/class/infiniband: each device's ``device/driver`` links to a driver directory."""
    sysfs = tmp_path / "fake_sysfs_infiniband"
    drivers = tmp_path / "fake_sysfs_drivers"
    sysfs.mkdir()
    for name, driver in devices.items():
        (drivers / driver).mkdir(parents=True, exist_ok=True)
        (sysfs / name / "device").mkdir(parents=True)
        (sysfs / name / "device" / "driver").symlink_to(drivers / driver)
    return str(sysfs)


def test_the_efa_module_is_kept_out_where_no_efa_device_is_present(tmp_path):
    sysfs = _fake_sysfs(tmp_path, {"mlx5_0": "mlx5_core", "mlx5_1": "mlx5_core"})
    env: dict[str, str] = {}
    assert apply_ucx_modules(env, sysfs) == UCX_MODULES_VALUE
    assert env == {"UCX_MODULES": "^efa"}
    # no RDMA subsystem at all: the same
    env = {}
    assert apply_ucx_modules(env, str(tmp_path / "no_such_dir")) == "^efa" and env["UCX_MODULES"] == "^efa"


def test_an_efa_device_keeps_the_module_loadable(tmp_path):
    sysfs = _fake_sysfs(tmp_path, {"rdmap16s27": "efa", "mlx5_0": "mlx5_core"})
    assert efa_devices(sysfs) == ["rdmap16s27"]
    env: dict[str, str] = {}
    assert apply_ucx_modules(env, sysfs) is None
    assert env == {}


def test_the_operators_ucx_modules_is_left_as_it_is(tmp_path):
    sysfs = _fake_sysfs(tmp_path, {})
    env = {"UCX_MODULES": "*"}
    assert ucx_modules_value(env, sysfs) is None
    assert apply_ucx_modules(env, sysfs) is None
    assert env == {"UCX_MODULES": "*"}


def test_two_libnl_route_copies_in_the_maps_are_named(tmp_path):
    maps = tmp_path / "fake_maps"
    bundled = "/site-packages/nixl_cu12.libs/libnl-route-3-3ad497a3.so.200.26.0"
    system = "/usr/lib/x86_64-linux-gnu/libnl-route-3.so.200.26.0"
    line = "7fffebe21000-7fffebe64000 r-xp 00010000 fe:00 5407030                    {}\n"
    maps.write_text(line.format(bundled) + line.format(bundled) + "7fff0000-7fff1000 rw-p 00000000 00:00 0\n")
    assert duplicate_libnl(str(maps)) == []  # one copy, mapped twice
    maps.write_text(line.format(bundled) + line.format(system))
    assert duplicate_libnl(str(maps)) == sorted([bundled, system])
    assert duplicate_libnl(str(tmp_path / "no_such_maps")) == []


_LOAD_AND_CLOSE = textwrap.dedent("""
    import numpy as np
    from atom_kv.config import KVTransferConfig
    from atom_kv.transfer import create_backend
    from atom_kv.transfer.nixl.ucx_modules import duplicate_libnl
    backend = create_backend("nixl", KVTransferConfig.from_dict({"kv_role": "kv_consumer", "backend": "nixl"}),
                             key="exit-check")
    buf = np.zeros(1 << 16, dtype=np.uint8)
    backend.register_memory(buf.ctypes.data, buf.nbytes, align=4096)
    print("libnl copies:", duplicate_libnl(), flush=True)
    backend.close()
    print("closed", flush=True)
""")


@needs_nixl
def test_a_process_that_loaded_nixl_and_closed_it_exits_0():
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}  # the process sets its own
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", _LOAD_AND_CLOSE], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, f"exit status {out.returncode}: {out.stdout[-1000:]} {out.stderr[-2000:]}"
    assert "libnl copies: []" in out.stdout and "closed" in out.stdout, out.stdout
