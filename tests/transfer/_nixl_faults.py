"""A process that meets a NIXL failure at one point between creating its
agent and closing it, then ends: ``python -m tests.transfer._nixl_faults POINT END``.

POINT is where NIXL fails (an error injected into NIXL's own Python API, the
native agent and everything else real): ``agent`` (a plugin does not start),
``register``, ``export`` (the agent's metadata), ``add_peer`` (loading the
peer's metadata), ``plan`` (a prepared descriptor list), ``read`` (posting the
first transfer); ``none`` injects nothing, and ``cuda-refusal`` is the
refusal of GPU memory on a host without CUDA (no stand-ins). END is ``close``
(the owner closes everything) or ``exit`` (nothing is closed: finalizers at
interpreter exit). Two ``auto`` backends with GPU memory, the reader seeing
the server as another host, so that NIXL is their route.

No GPU here: "GPU memory" is host memory labelled ``gpu:0``. Staged tcp copies
it with the host copier (a stand-in for the CUDA copier) and NIXL registers it
as DRAM (its VRAM registration needs UCX built with CUDA); both are fakes
for hardware this host lacks, set up by :func:`_gpu_stand_ins`. The process
prints ``outcome: ...`` lines that the test checks, and must exit with status 0.
"""

from __future__ import annotations

import logging
import sys

import msgspec
import numpy as np

from atom_kv import wire
from atom_kv.config import KVTransferConfig
from atom_kv.transfer import ChunkedRegion, create_backend, split_pair
from atom_kv.transfer.memory import gpu
from atom_kv.transfer.nixl.probe import load_nixl

POINTS = ("agent", "register", "export", "add_peer", "plan", "read", "none", "cuda-refusal")
BLOCK = 4096
NBLOCKS = 16

#: the method of NIXL's ``nixl_agent`` that fails at each point
_INJECT = {"agent": "create_backend", "register": "register_memory", "export": "get_agent_metadata",
           "add_peer": "add_remote_agent", "plan": "prep_xfer_dlist", "read": "transfer"}


def _inject(point: str) -> None:
    method = _INJECT.get(point)
    if method is None:
        return
    cls = load_nixl().nixl_agent

    def fail(self, *args, **kwargs):
        raise RuntimeError(f"injected NIXL failure in {method}")

    setattr(cls, method, fail)


def _gpu_stand_ins() -> None:
    from atom_kv.transfer import staging
    from atom_kv.transfer.nixl import backend as nixl

    class HostStandInCopier(staging.HostCopier):
        """Stand-in for the CUDA copier: the 'GPU' bytes are host bytes."""

        def __init__(self, device: int) -> None:
            super().__init__()
            self.device = device

    def dram(seg: str) -> str:
        return "DRAM" if seg == "VRAM" else seg

    class DramStandInAgent(nixl.NixlAgent):
        """Registers and names the 'GPU' bytes as what they are: DRAM."""

        def register(self, rows, seg):
            return super().register(rows, dram(seg))

        def prep(self, side, rows, seg):
            return super().prep(side, rows, dram(seg))

        def start_rows(self, local_rows, lseg, remote_rows, rseg, remote):
            return super().start_rows(local_rows, dram(lseg), remote_rows, dram(rseg), remote)

    staging.DeviceCopier = HostStandInCopier
    nixl.NixlAgent = DramStandInAgent


def _cfg() -> KVTransferConfig:
    return KVTransferConfig.from_dict({"kv_role": "kv_consumer", "transfer_timeout_s": 5.0, "handshake_timeout_s": 5.0})


def _read(reader, peer, src, dst, local, remote) -> str:
    """Read every other block (scattered: NIXL's prepared descriptor lists)."""
    blocks = range(0, NBLOCKS, 2)
    ops = [op for b in blocks for op in split_pair(local, b * BLOCK, remote, b * BLOCK, BLOCK)]
    h = reader.read(peer, ops, timeout_s=5)
    if not h.wait(10):
        return "read timed out"
    if h.error is not None:
        return f"read failed: {h.error}"
    ok = all(bool((dst[b * BLOCK:(b + 1) * BLOCK] == src[b * BLOCK:(b + 1) * BLOCK]).all()) for b in blocks)
    return "read ok" if ok else "read returned wrong bytes"


def run(point: str, owned: list) -> None:
    """Two ``auto`` backends with GPU memory, the reader seeing the server as
    another host (so NIXL is the route), one of them failing at ``point``."""
    if point != "cuda-refusal":
        _gpu_stand_ins()
    src = np.random.default_rng(5).integers(0, 256, NBLOCKS * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    server = create_backend("auto", _cfg(), key="faults-serve")
    owned.append(server)
    try:
        remote = server.register_memory(src.ctypes.data, src.nbytes, align=BLOCK, memory=gpu(0))
    except Exception as exc:  # the refusal an engine start reports
        print(f"outcome: refused: {type(exc).__name__}: {exc}", flush=True)
        return
    reader = create_backend("auto", _cfg(), key="faults-read")
    owned.append(reader)
    local = reader.register_memory(dst.ctypes.data, dst.nbytes, align=BLOCK, memory=gpu(0))
    desc = wire.decode(server.export_descriptor(), wire.AutoDescriptor)
    print(f"outcome: server offers nixl: {bool(desc.nixl)}", flush=True)
    # the same peer as seen from another host: GPU memory across hosts is nixl's route
    peer = reader.add_peer(wire.encode(msgspec.structs.replace(desc, host_id="another-host")))
    print(f"outcome: route {reader.backend_for(peer)}", flush=True)
    print(f"outcome: fallbacks {sorted(reader.route_fallbacks().items())} "
          f"server {sorted(server.route_fallbacks().items())}", flush=True)
    nb = src.nbytes
    print("outcome: " + _read(reader, peer, src, dst, ChunkedRegion(tuple(local), nb, nb),
                              ChunkedRegion(tuple(remote), nb, nb)), flush=True)


def main(argv: list[str]) -> int:
    point, end = argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _inject(point)
    owned: list = []
    run(point, owned)
    if end == "close":
        for be in reversed(owned):
            be.close()
    print("outcome: end of main", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
