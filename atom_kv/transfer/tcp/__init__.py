"""``tcp`` backend: one-sided reads over plain sockets, between any two hosts.

``auto`` picks it across hosts (GPU memory staged through host buffers) and
wherever cma or gpu_ipc cannot serve.

- :mod:`~atom_kv.transfer.tcp.backend`: :class:`TcpBackend` (regions, read server, peers).
- :mod:`~atom_kv.transfer.tcp.server`: the read server that sends straight from registered memory.
- :mod:`~atom_kv.transfer.tcp.peer`: one reader's connections to a peer's read server.
"""

from atom_kv.transfer.tcp.backend import MAX_JOB_BYTES, MAX_JOB_RANGES, MIN_JOB_BYTES, TcpBackend, plan_jobs

__all__ = ["MAX_JOB_BYTES", "MAX_JOB_RANGES", "MIN_JOB_BYTES", "TcpBackend", "plan_jobs"]
