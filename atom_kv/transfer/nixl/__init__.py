"""``nixl`` backend: one-sided reads through NVIDIA's NIXL (UCX: RDMA, GPUDirect, shm).

``auto`` picks it for GPU memory across hosts where NIXL loads; else by name
(``backend: "nixl"``).

- :mod:`~atom_kv.transfer.nixl.backend`: :class:`NixlBackend` (agent, registered memory, peers).
- :mod:`~atom_kv.transfer.nixl.agent`: the native agent and every native object made from it.
- :mod:`~atom_kv.transfer.nixl.plan`: turning a read's ranges into NIXL descriptor lists.
- :mod:`~atom_kv.transfer.nixl.completion`: the completion thread's transfers.
- :mod:`~atom_kv.transfer.nixl.probe`: whether NIXL can be imported here (no backend built).
- :mod:`~atom_kv.transfer.nixl.ucx_modules`: ``UCX_MODULES``, keeping the system's libnl out (a crash at exit).

What it shares with ``moriio`` (plan once per peer, one completion thread, teardown order): :mod:`atom_kv.transfer._rdma`.
"""

from atom_kv.transfer.nixl.backend import NixlBackend

__all__ = ["NixlBackend"]
