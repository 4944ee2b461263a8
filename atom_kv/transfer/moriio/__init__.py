"""``moriio`` backend: one-sided reads over AMD MORI-IO (RDMA or XGMI).

Picked by name (``backend: "moriio"``, or ATOM's ``protocol: "rdma"``).

- :mod:`~atom_kv.transfer.moriio.backend`: :class:`MoriIOBackend` (IO engine, registered memory, peers, sessions).
- :mod:`~atom_kv.transfer.moriio.plan`: sessions and batched reads per peer.
- :mod:`~atom_kv.transfer.moriio.completion`: the completion thread's batches.
- :mod:`~atom_kv.transfer.moriio.probe`: whether MORI-IO can be used here (no backend built).

What it shares with ``nixl`` (plan once per peer, one completion thread, teardown order): :mod:`atom_kv.transfer._rdma`.
"""

from atom_kv.transfer.moriio.backend import MoriIOBackend

__all__ = ["MoriIOBackend"]
