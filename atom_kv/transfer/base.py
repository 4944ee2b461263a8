"""The transfer backend protocol and the pure helpers every backend shares.

A backend moves bytes of *registered regions* from a peer process into this
process with one-sided reads. Coordinates are always ``(region_id, offset)``
where a region is one registered chunk (< 2 GiB, block aligned).

Lifecycle::

    be = create_backend("tcp", config)          # atom_kv.transfer.create_backend
    ids = be.register_memory(ptr, nbytes, align=block_bytes)
    blob = be.export_descriptor()               # send to the peer (handshake)
    peer = be.add_peer(remote_blob)             # import the peer's descriptor
    h = be.read(peer, [ReadOp(...), ...], timeout_s=30)
    h.wait(30); h.error                         # None on success
    be.close()
"""

from __future__ import annotations

import abc
import enum
import threading
import time
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Protocol, Sequence

from atom_kv.transfer._errors import (
    BackendClosed,
    BackendUnavailable,
    OutOfBounds,
    PeerUnreachable,
    TransferError,
    UnknownPeer,
    UnsupportedMemory,
)
from atom_kv.transfer.memory import HOST, MemoryKind, check_memory

__all__ = [
    "MAX_REGION_BYTES",
    "TransferError",
    "BackendUnavailable",
    "PeerUnreachable",
    "UnsupportedMemory",
    "ReadOp",
    "ReadFailure",
    "ReadHandle",
    "ReadRefusal",
    "failure_of",
    "TransferBackend",
    "ChunkedRegion",
    "chunk_sizes",
    "merge_ops",
    "split_pair",
]

#: Largest single registered region. RDMA NICs in the field fail ``ibv_reg_mr``
#: at about 2 GiB, so every backend registers block-aligned chunks below it.
MAX_REGION_BYTES = (1 << 31) - (1 << 20)


class ReadOp(NamedTuple):
    """Copy ``size`` bytes from the peer's region into one of ours."""

    local_region: int
    local_offset: int
    remote_region: int
    remote_offset: int
    size: int


class ReadFailure(enum.Enum):
    """Why a read failed (:attr:`ReadHandle.reason`; :attr:`ReadHandle.error` says it in words)."""

    TIMEOUT = "timeout"              # it passed its deadline
    CLOSED = "closed"                # the backend was closed before or while it ran
    UNKNOWN_PEER = "unknown_peer"    # the peer id was never added, or was removed
    OUT_OF_BOUNDS = "out_of_bounds"  # a range outside the registered regions (either side)
    PEER_GONE = "peer_gone"          # the peer exited, or the path to it closed
    TRANSPORT = "transport"          # the transport (socket, NIC, driver, library) failed; the default
    INTERNAL = "internal"            # a bug here: the words say which


def failure_of(exc: BaseException) -> ReadFailure:
    """The :class:`ReadFailure` an exception that failed a read stands for (by its class)."""
    for kind, failure in ((OutOfBounds, ReadFailure.OUT_OF_BOUNDS), (BackendClosed, ReadFailure.CLOSED),
                          (UnknownPeer, ReadFailure.UNKNOWN_PEER), (PeerUnreachable, ReadFailure.PEER_GONE)):
        if isinstance(exc, kind):
            return failure
    return ReadFailure.TRANSPORT


class ReadRefusal(NamedTuple):
    """Why a read cannot start: the typed reason and the words."""

    reason: ReadFailure
    text: str


class _Signal(Protocol):
    """What a handle needs of its two events: a ``threading.Event``, or a subclass's own latch."""

    def is_set(self) -> bool: ...

    def set(self) -> None: ...

    def wait(self, timeout: Optional[float] = None) -> bool: ...


class ReadHandle:
    """Completion of one ``read()`` call: ``done()``, ``wait(timeout)``, ``error``, ``reason``.

    Backends call :meth:`_finish` exactly once (later calls are ignored), from
    any thread. ``error`` is ``None`` on success, else a one-line reason;
    ``reason`` is then the :class:`ReadFailure` it names (decide on that, never
    on the words).

    *Finished* is not the same as *settled*: a handle failed by its deadline
    finishes at once, but a backend worker may still be inside one syscall
    writing into the destination. :meth:`wait_settled` returns once no
    backend thread will touch the destination memory again; only then may the
    caller hand those blocks to anybody else. Backends that track their
    in-flight I/O call :meth:`_track_io` at creation and :meth:`_settle` when
    the last worker let go; for the others, finishing settles.
    """

    __slots__ = (
        "_event", "_settled", "_tracked", "_lock", "error", "reason", "nbytes", "num_ranges", "started", "finished",
    )

    def __init__(self, nbytes: int = 0, num_ranges: int = 0) -> None:
        self._event: _Signal = threading.Event()
        self._settled: _Signal = threading.Event()
        self._tracked = False
        self._lock = threading.Lock()
        self.error: Optional[str] = None
        self.reason: Optional[ReadFailure] = None
        self.nbytes = nbytes
        self.num_ranges = num_ranges
        self.started = time.monotonic()
        self.finished: Optional[float] = None

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until finished or ``timeout`` seconds pass; True if finished."""
        return self._event.wait(timeout)

    def settled(self) -> bool:
        return self._settled.is_set()

    def wait_settled(self, timeout: Optional[float] = None) -> bool:
        """Block until no backend thread will write the destination again."""
        return self._settled.wait(timeout)

    @property
    def ok(self) -> bool:
        return self._event.is_set() and self.error is None

    @property
    def duration(self) -> float:
        end = self.finished if self.finished is not None else time.monotonic()
        return end - self.started

    def _finish(self, error: Optional[str] = None, reason: Optional[ReadFailure] = None) -> bool:
        """Mark finished, failed with ``error`` (for ``reason``: :attr:`ReadFailure.TRANSPORT` when a
        backend names none) or not; returns False if it already was (first result wins)."""
        with self._lock:
            if self._event.is_set():
                return False
            self.error = error
            self.reason = None if error is None else (reason or ReadFailure.TRANSPORT)
            self.finished = time.monotonic()
            self._event.set()
            if not self._tracked:
                self._settled.set()
            return True

    def _track_io(self) -> None:
        """Called by a backend before any I/O: settling is then explicit."""
        self._tracked = True

    def _settle(self) -> None:
        """The backend's last worker for this handle has let go of its memory."""
        self._settled.set()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("ok" if self.error is None else f"error={self.error!r}")
        return f"<ReadHandle {self.nbytes}B {self.num_ranges} ranges {state}>"


class TransferBackend(abc.ABC):
    """One process's endpoint of a transfer backend: owns its registered
    regions, its imported peers, its sockets and threads."""

    #: short name: "tcp", "cma", "moriio"
    name: str = ""

    #: True when :meth:`read` also takes its ops as an ``(n, 5)`` int64 array
    #: in :class:`ReadOp` column order (callers then plan in bulk with numpy)
    accepts_op_arrays: bool = False

    #: memory kinds ("host", "gpu") this backend can register, serve and read
    #: into; anything else is refused by :meth:`check_memory` at registration
    memory_kinds: frozenset[str] = frozenset({"host"})

    #: what to use instead when refused GPU memory (the refusal's last clause)
    gpu_alternative: str = ("use backend 'auto' (gpu_ipc on one node, staged tcp across nodes), 'gpu_ipc' or 'tcp' "
                            "(docs/gpu.md)")

    #: largest region :meth:`register_memory` creates; tests lower it on an
    #: instance to exercise chunk boundaries with small buffers.
    max_region_bytes: int = MAX_REGION_BYTES

    @abc.abstractmethod
    def register_memory(self, ptr: int, size: int, *, align: int = 1, memory: MemoryKind = HOST) -> list[int]:
        """Register ``size`` bytes at ``ptr`` for remote reads (and as read
        destinations). The memory is split into chunks below
        :data:`MAX_REGION_BYTES` whose sizes are multiples of ``align``;
        returns their region ids in address order.

        ``memory`` says where the bytes live (``atom_kv.transfer.memory.memory_of``
        reads it off a tensor); a backend calls :meth:`check_memory` first and
        refuses a kind it cannot serve before it touches ``ptr``."""

    def check_memory(self, memory: MemoryKind) -> None:
        """Raise :class:`UnsupportedMemory` (one line: backend, memory, what to
        use instead) unless this backend serves ``memory``."""
        check_memory(self.name, self.memory_kinds, memory, instead=self.gpu_alternative if memory.is_gpu else "")

    @abc.abstractmethod
    def export_descriptor(self) -> bytes:
        """Opaque bytes a peer passes to :meth:`add_peer` to reach this process."""

    @abc.abstractmethod
    def add_peer(self, descriptor: bytes) -> str:
        """Import a peer's descriptor; returns a peer id for :meth:`read`."""

    @abc.abstractmethod
    def remove_peer(self, peer_id: str) -> None:
        """Forget a peer and drop its cached connections/sessions."""

    @abc.abstractmethod
    def read(self, peer_id: str, ops: Sequence[ReadOp], *, timeout_s: float) -> ReadHandle:
        """Start reading ``ops`` from the peer; never blocks on the transfer.

        Backends with :attr:`accepts_op_arrays` also take an ``(n, 5)`` array.

        The handle fails (never hangs) if the peer errors, dies, or the
        transfer passes ``timeout_s``. Adjacent ops are merged by the backend.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop threads, close sockets, deregister memory. Idempotent."""

    def kv_written(self) -> None:
        """The engine's KV writes queued so far, on its current stream of every
        registered GPU, count as written: reads and staging gathers of this
        process's memory start only after they are complete on the device.
        Call from the thread that queued them (the connector calls it in
        ``get_finished``, after each step's forward: docs/integrating.md).
        Host memory needs nothing: its writes are complete when made."""

    def stats(self) -> dict[str, int]:
        """Event counts of this endpoint by reason (connections refused or
        dropped, bad frames, fallbacks); empty for backends that keep none."""
        return {}

    def __enter__(self) -> "TransferBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------
def chunk_sizes(size: int, align: int = 1, limit: int = MAX_REGION_BYTES) -> list[int]:
    """Split ``size`` bytes into chunk sizes that are multiples of ``align``
    (the last may be shorter) and each at most ``limit``."""
    if size <= 0:
        raise ValueError(f"cannot register {size} bytes: size must be positive")
    if align <= 0:
        raise ValueError(f"align must be positive, got {align}")
    if align > limit:
        raise ValueError(
            f"one block ({align} bytes) is larger than the {limit}-byte region limit; "
            "use smaller blocks"
        )
    step = (limit // align) * align
    out = []
    remaining = size
    while remaining > 0:
        n = min(step, remaining)
        out.append(n)
        remaining -= n
    return out


@dataclass(frozen=True)
class ChunkedRegion:
    """A logical buffer registered as consecutive chunks (region ids)."""

    region_ids: tuple[int, ...]
    chunk_bytes: int
    total: int

    def locate(self, offset: int, size: int) -> list[tuple[int, int, int]]:
        """Map ``[offset, offset+size)`` onto ``(region_id, chunk_offset, n)`` pieces."""
        if offset < 0 or size < 0 or offset + size > self.total:
            raise ValueError(f"range [{offset}, {offset + size}) outside buffer of {self.total} bytes")
        out = []
        while size > 0:
            idx, off = divmod(offset, self.chunk_bytes)
            n = min(size, self.chunk_bytes - off)
            out.append((self.region_ids[idx], off, n))
            offset += n
            size -= n
        return out


def split_pair(
    local: ChunkedRegion, local_offset: int, remote: ChunkedRegion, remote_offset: int, size: int
) -> list[ReadOp]:
    """ReadOps copying ``size`` bytes, split wherever either side crosses a chunk."""
    ops = []
    for rid, roff, n in remote.locate(remote_offset, size):
        for lid, loff, m in local.locate(local_offset, n):
            ops.append(ReadOp(lid, loff, rid, roff, m))
            roff += m
        local_offset += n
    return ops


def merge_ops(ops: Iterable[ReadOp]) -> list[ReadOp]:
    """Sort ops and merge those contiguous on both sides into single ranges."""
    ordered = sorted(ops, key=lambda o: (o.remote_region, o.local_region, o.remote_offset, o.local_offset))
    merged: list[ReadOp] = []
    for op in ordered:
        if op.size <= 0:
            continue
        if merged:
            last = merged[-1]
            if (
                last.local_region == op.local_region
                and last.remote_region == op.remote_region
                and last.local_offset + last.size == op.local_offset
                and last.remote_offset + last.size == op.remote_offset
            ):
                merged[-1] = last._replace(size=last.size + op.size)
                continue
        merged.append(op)
    return merged
