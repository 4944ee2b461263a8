"""``cma`` backend: reads of host memory on one host with ``process_vm_readv``.

``auto`` picks it for host memory on one host, when the kernel allows it.

- :mod:`~atom_kv.transfer.cma.backend`: :class:`CmaBackend` (regions, grant endpoint, reader threads).
- :mod:`~atom_kv.transfer.cma.syscalls`: the ``process_vm_readv`` / ``prctl`` calls and why they may be refused.

The grant endpoint it serves is shared with ``gpu_ipc``: :mod:`atom_kv.transfer._grant`.
"""

from atom_kv.transfer.cma.backend import SPLIT_BYTES, CmaBackend
from atom_kv.transfer.cma.syscalls import cma_unavailable_reason

__all__ = ["SPLIT_BYTES", "CmaBackend", "cma_unavailable_reason"]
