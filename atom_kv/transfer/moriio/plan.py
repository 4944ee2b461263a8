"""Pure logic of the ``moriio`` backend: no ``mori`` import, no threads.

* :func:`rdma_config_attrs` / :func:`build_rdma_config`: ``KVTransferConfig``
  -> ``RdmaBackendConfig`` attributes;
* :func:`plan_reads`: merge ops, bounds-check them against both sides'
  registered regions and group them into one batch per (local, remote) region
  pair, i.e. per MORI-IO session;
* :class:`SessionCache`: sessions created lazily per region pair actually
  used, cached, dropped per peer;
* :func:`status_error`: a failed ``TransferStatus`` -> the handle's one-line error.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Hashable, Mapping, NamedTuple, Optional, Sequence

from atom_kv.config import KVTransferConfig
import numpy as np

from atom_kv.transfer.base import OutOfBounds, ReadOp, TransferError

__all__ = [
    "OPTIONAL_RDMA_ATTRS",
    "RDMA_ENV_VARS",
    "rdma_config_attrs",
    "build_rdma_config",
    "Batch",
    "op_array",
    "plan_reads",
    "SessionCache",
    "code_name",
    "status_error",
]

#: attributes only newer ``RdmaBackendConfig`` versions have; 0 = library default
OPTIONAL_RDMA_ATTRS = ("max_send_wr", "max_cqe_num", "max_msg_sge")


#: RdmaBackendConfig attribute -> the MORI environment variable that also sets it
RDMA_ENV_VARS = {
    "qp_per_transfer": "MORI_IO_QP_PER_TRANSFER",
    "post_batch_size": "MORI_IO_POST_BATCH_SIZE",
    "num_worker_threads": "MORI_IO_NUM_WORKER_THREADS",
    "poll_cq_mode": "MORI_IO_POLL_CQ_MODE",
    "enable_notification": "MORI_IO_ENABLE_NOTIFICATION",
}


def rdma_config_attrs(config: KVTransferConfig, environ: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """The ``RdmaBackendConfig`` attributes ``config`` sets.

    ``poll_cq_mode`` (``moriio.poll_cq_mode``) is given as the ``PollCqMode``
    member name ("POLLING" or "EVENT"); ``max_*`` keys appear only when
    nonzero (0 keeps MORI's default). A key left at its default is omitted
    when its ``MORI_IO_*`` variable is set in ``environ``, so the operator's
    environment applies; a key set to anything else wins over the variable.
    """
    env = os.environ if environ is None else environ
    defaults = _rdma_values(KVTransferConfig(kv_role=config.kv_role))
    attrs: dict[str, Any] = {}
    for name, value in _rdma_values(config).items():
        if env.get(RDMA_ENV_VARS[name], "").strip() and value == defaults[name]:
            continue
        attrs[name] = value.upper() if name == "poll_cq_mode" else value
    for name in OPTIONAL_RDMA_ATTRS:
        value = getattr(config, name)
        if value:
            attrs[name] = value
    return attrs


def _rdma_values(config: KVTransferConfig) -> dict[str, Any]:
    """The values of :data:`RDMA_ENV_VARS`' attributes in ``config`` (ATOM's keys at the top level, the poll mode
    in the ``moriio`` section)."""
    return {name: config.moriio.poll_cq_mode if name == "poll_cq_mode" else getattr(config, name)
            for name in RDMA_ENV_VARS}


def build_rdma_config(
    config_cls: Callable[[], Any],
    poll_cq_mode_enum: Any,
    config: KVTransferConfig,
    environ: Optional[Mapping[str, str]] = None,
) -> tuple[Any, list[str]]:
    """Build an ``RdmaBackendConfig`` from ``config``.

    Returns the object and the names of optional attributes this MORI
    version does not have (they are skipped, the caller logs them).
    """
    obj = config_cls()
    skipped: list[str] = []
    for name, value in rdma_config_attrs(config, environ).items():
        if name == "poll_cq_mode":
            value = getattr(poll_cq_mode_enum, value)
        try:
            setattr(obj, name, value)
        except AttributeError:
            if name not in OPTIONAL_RDMA_ATTRS:
                raise TransferError(f"this mori version's RdmaBackendConfig has no `{name}`") from None
            skipped.append(name)
    return obj, skipped


class Batch(NamedTuple):
    """One ``session.batch_read`` call: all ranges between one region pair."""

    local_region: int
    remote_region: int
    local_offsets: list[int]
    remote_offsets: list[int]
    sizes: list[int]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


def _check(op: ReadOp, local_sizes: Sequence[int], remote_sizes: Sequence[int], peer: str) -> None:
    if op.size <= 0:
        raise TransferError(f"read op {tuple(op)} has non-positive size {op.size}")
    if not 0 <= op.local_region < len(local_sizes):
        raise OutOfBounds(
            f"local region {op.local_region} is outside the {len(local_sizes)} regions this engine registered"
        )
    if not 0 <= op.remote_region < len(remote_sizes):
        raise OutOfBounds(
            f"remote region {op.remote_region} is outside the {len(remote_sizes)} regions peer {peer} registered"
        )
    lsize = local_sizes[op.local_region]
    if op.local_offset < 0 or op.local_offset + op.size > lsize:
        raise OutOfBounds(
            f"local range [{op.local_offset}, {op.local_offset + op.size}) is outside "
            f"local region {op.local_region} ({lsize} bytes)"
        )
    rsize = remote_sizes[op.remote_region]
    if op.remote_offset < 0 or op.remote_offset + op.size > rsize:
        raise OutOfBounds(
            f"remote range [{op.remote_offset}, {op.remote_offset + op.size}) is outside "
            f"remote region {op.remote_region} of peer {peer} ({rsize} bytes)"
        )


def op_array(ops: Any) -> np.ndarray:
    """``ops`` (ReadOps, 5-tuples or an (n, 5) int array) as an (n, 5) int64 array."""
    try:
        arr = np.asarray(ops if isinstance(ops, np.ndarray) else list(ops), dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise TransferError(f"read ops must be ReadOps or an (n, 5) integer array: {exc}") from None
    if arr.size == 0:
        return np.zeros((0, 5), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 5:
        raise TransferError(f"read ops must be ReadOps or an (n, 5) integer array, got shape {arr.shape}")
    return arr


def plan_reads(
    ops: Any, local_sizes: Sequence[int], remote_sizes: Sequence[int], peer: str = "?"
) -> list[Batch]:
    """Bounds-check ``ops``, merge ranges contiguous on both sides and group
    them by (local_region, remote_region), ordered by remote then local region.

    Vectorised, so tens of thousands of block ops cost milliseconds. Raises
    :class:`TransferError` naming the first bad op; nothing is issued then.
    """
    arr = op_array(ops)
    if len(arr) == 0:
        return []
    lr, lo, rr, ro, size = (arr[:, i] for i in range(5))
    lsizes = np.asarray(list(local_sizes) or [0], dtype=np.int64)
    rsizes = np.asarray(list(remote_sizes) or [0], dtype=np.int64)
    l_ok = (lr >= 0) & (lr < len(local_sizes))
    r_ok = (rr >= 0) & (rr < len(remote_sizes))
    bad = (size <= 0) | ~l_ok | ~r_ok | (lo < 0) | (ro < 0)
    bad |= lo + size > lsizes[np.where(l_ok, lr, 0)]
    bad |= ro + size > rsizes[np.where(r_ok, rr, 0)]
    if bad.any():
        _check(ReadOp(*arr[int(np.argmax(bad))].tolist()), local_sizes, remote_sizes, peer)
    # sort by (remote region, local region, remote offset, local offset) like
    # merge_ops; the first three packed in one int64 (offsets are < 2**31)
    key = (rr * len(local_sizes) + lr) * (1 << 31) + ro
    ordered = bool(np.all((key[1:] > key[:-1]) | ((key[1:] == key[:-1]) & (lo[1:] >= lo[:-1]))))
    s = arr if ordered else arr[np.lexsort((lo, key))]
    lr, lo, rr, ro, size = (s[:, i] for i in range(5))
    start = np.ones(len(s), dtype=bool)
    start[1:] = (
        (lr[1:] != lr[:-1])
        | (rr[1:] != rr[:-1])
        | (lo[:-1] + size[:-1] != lo[1:])
        | (ro[:-1] + size[:-1] != ro[1:])
    )
    idx = np.flatnonzero(start)
    m_lr, m_lo, m_rr, m_ro = lr[idx], lo[idx], rr[idx], ro[idx]
    m_size = np.add.reduceat(size, idx)
    pair_start = np.ones(len(idx), dtype=bool)
    pair_start[1:] = (m_lr[1:] != m_lr[:-1]) | (m_rr[1:] != m_rr[:-1])
    bounds = np.flatnonzero(pair_start).tolist() + [len(idx)]
    return [
        Batch(int(m_lr[a]), int(m_rr[a]), m_lo[a:b].tolist(), m_ro[a:b].tolist(), m_size[a:b].tolist())
        for a, b in zip(bounds[:-1], bounds[1:])
    ]


class SessionCache:
    """MORI-IO sessions keyed by (peer, local region, remote region).

    A session is created by ``factory`` the first time a pair is used and
    reused after; :meth:`drop_peer` forgets all of a peer's sessions.
    Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[tuple[Hashable, int, int], Any] = {}
        self.created = 0

    def get(
        self, peer: Hashable, local_region: int, remote_region: int, factory: Callable[[], Optional[Any]]
    ) -> Any:
        key = (peer, local_region, remote_region)
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                session = factory()
                if session is None:
                    raise TransferError(
                        f"MORI-IO could not create a session from local region {local_region} "
                        f"to remote region {remote_region} of peer {peer}"
                    )
                self._sessions[key] = session
                self.created += 1
            return session

    def drop_peer(self, peer: Hashable) -> int:
        with self._lock:
            keys = [k for k in self._sessions if k[0] == peer]
            for k in keys:
                del self._sessions[k]
            return len(keys)

    def keys(self) -> list[tuple[Hashable, int, int]]:
        with self._lock:
            return list(self._sessions)

    def clear(self) -> None:
        with self._lock:
            self._sessions.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)


def code_name(code: Any) -> str:
    """``StatusCode.ERR_RDMA_OP`` -> "ERR_RDMA_OP (5)"; tolerant of plain ints."""
    name = getattr(code, "name", None)
    try:
        number: Optional[int] = int(code)
    except (TypeError, ValueError):
        number = None
    if name and number is not None:
        return f"{name} ({number})"
    return str(name or code)


def status_error(code: Any, message: str, *, peer: str, batch: Optional[Batch] = None) -> str:
    """The one-line handle error for a failed MORI-IO transfer status."""
    where = f"peer {peer}"
    if batch is not None:
        where += f", local region {batch.local_region} <- remote region {batch.remote_region}, {batch.nbytes} bytes"
    text = " ".join(str(message or "no message").split())
    return f"MORI-IO transfer failed: {code_name(code)}: {text} ({where})"
