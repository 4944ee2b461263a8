"""``tcp`` backend: one-sided reads over plain sockets, between any two hosts (``auto``'s route across hosts, staged for GPU memory).

- :mod:`~atom_kv.transfer.tcp.backend`: :class:`TcpBackend` (regions, read server, peers).
- :mod:`~atom_kv.transfer.tcp.server`: the read server that sends straight from registered memory.
- :mod:`~atom_kv.transfer.tcp.peer`: one reader's connections to a peer's read server.
"""

from atom_kv.transfer.tcp.backend import MAX_JOB_BYTES, MAX_JOB_RANGES, MIN_JOB_BYTES, TcpBackend, plan_jobs

__all__ = ["MAX_JOB_BYTES", "MAX_JOB_RANGES", "MIN_JOB_BYTES", "TcpBackend", "plan_jobs"]
