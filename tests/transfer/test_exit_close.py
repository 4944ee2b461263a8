"""A served backend (tcp, cma, gpu_ipc) its owner never closed is closed at interpreter exit, before
finalization: its threads are daemons, and one that finalization stops inside native code (a torch copy
of the staged path releases the GIL) aborts the process with "terminate called without an active
exception" (seen, rarely, in test_nixl_faults.py's ``exit`` cases, which close nothing)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import atexit, logging, sys, threading
    import numpy as np
    from atom_kv.config import KVTransferConfig
    from atom_kv.transfer import ReadOp, create_backend

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    # registered first, so it runs last: after the backends' own exit hooks
    atexit.register(lambda: print("threads at exit:", sorted(t.name for t in threading.enumerate()
                                                            if t.name.startswith("atomkv-")), flush=True))
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    cfg = KVTransferConfig.from_dict({"kv_role": "kv_consumer"})
    server = create_backend("tcp", cfg, key="exit-serve")
    remote = server.register_memory(src.ctypes.data, src.nbytes, align=4096)
    reader = create_backend("tcp", cfg, key="exit-read")
    local = reader.register_memory(dst.ctypes.data, dst.nbytes, align=4096)
    peer = reader.add_peer(server.export_descriptor())
    h = reader.read(peer, [ReadOp(local[0], 0, remote[0], 0, 4096)], timeout_s=10)
    assert h.wait(10) and h.error is None, h.error
    closed_early = create_backend("tcp", cfg, key="exit-closed-early")
    closed_early.close()
    print("end of main", flush=True)
""")


def test_backends_left_open_are_closed_at_exit_and_their_threads_stopped_before_finalization() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-2:] == ["end of main", "threads at exit: []"], out.stdout + out.stderr[-2000:]
    closed = [line for line in out.stderr.splitlines() if line.endswith(": closed")]
    for key in ("exit-serve", "exit-read"):
        assert sum(f"tcp {key}: closed" in line for line in closed) == 1, closed
    # closed by its owner: not a second time at exit
    assert sum("tcp exit-closed-early: closed" in line for line in closed) == 1, closed
