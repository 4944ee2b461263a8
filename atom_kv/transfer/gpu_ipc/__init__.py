"""``gpu_ipc`` backend: GPU-to-GPU reads on one node through CUDA/HIP IPC handles.

``auto`` picks it for GPU memory on one node.

- :mod:`~atom_kv.transfer.gpu_ipc.backend`: :class:`GpuIpcBackend` (exporters, mapped peers, their copy
  lanes).
- :mod:`~atom_kv.transfer.gpu_ipc.plan`: one read planned in one vectorised pass (bounds, pointers, runs).
- :mod:`~atom_kv.transfer.gpu_ipc.completion`: read handles completed by polling their fences, the fence
  event pools, the settling thread.
- :mod:`~atom_kv.transfer.gpu_ipc.handles`: exporting and opening IPC memory handles and written events (torch CUDA).
- :mod:`~atom_kv.transfer.gpu_ipc.cuda_seam`: every device call of the backend, on a real GPU.
- :mod:`~atom_kv.transfer.gpu_ipc.host_seam`: a host-memory stand-in of that seam (tests only).

Its grant endpoint is the one cma serves: :mod:`atom_kv.transfer._grant`.
"""

from atom_kv.transfer.gpu_ipc.backend import GpuIpcBackend, pid_exited

__all__ = ["GpuIpcBackend", "pid_exited"]
