"""One load's read from one producer rank, in steps that do one thing each.

:class:`RankRead` makes up to ``transfer_retries + 1`` attempts within the
load's budget. Between attempts it backs off exponentially; before each it
stops early if the load was cancelled, the connector is closing or time is
up. An attempt waits for the peer's handshake, plans the byte ranges (once
per peer: a re-handshaked peer may number its regions anew), and reads. A
peer that refused the handshake, or that could not be connected to within
``connect_timeout_s``, ends the load at its first attempt. A failed read is
not retried, nor its blocks handed back, until the backend has stopped
writing them (the handle *settled*).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from atom_kv.config import KVTransferConfig
from atom_kv.connector.handshake import HandshakeError, HandshakeRejected, HandshakeUnreachable
from atom_kv.connector.layout import HeadOverlap, LayoutError, TensorLayout
from atom_kv.connector.peers import Peer, PeerKey, PeerTable
from atom_kv.connector.stats import TransferStats
from atom_kv.connector.types import LoadSpec
from atom_kv.transfer import ReadHandle, TransferBackend
from atom_kv.wire import CompatInfo

__all__ = ["ARRAY_MIN_OPS", "LoadState", "RankRead", "ReadContext"]

logger = logging.getLogger(__name__)

#: from this many ops an op array is cheaper end to end (planning + the backend's conversion)
ARRAY_MIN_OPS = 32


@dataclass
class LoadState:
    """One load on this rank: the producer ranks still reading, the first error, cancellation."""

    spec: LoadSpec
    received: float
    pending: set[int]
    read_ranks: frozenset[int] = frozenset()
    error: Optional[str] = None
    cancelled: bool = False
    #: with pipeline stages: the layers each producer rank (``pp_rank*tp_size + tp_rank``) said it holds
    stage_layers: dict[int, list[int]] = field(default_factory=dict)
    #: a rendezvous load: until when (monotonic, slack taken off) the producer promised to hold the blocks
    lease_until: Optional[float] = None
    #: the producer rank this rank handshakes with first, while the producer is unknown to it (``PeerTable.get``)
    first_rank: int = 0


@dataclass(frozen=True)
class ReadContext:
    """What every read of one consumer rank works with."""

    config: KVTransferConfig
    compat: CompatInfo
    backend: TransferBackend
    peers: PeerTable
    stats: TransferStats
    stop: threading.Event
    name: str
    budget_s: float
    local_heads: int


class _AttemptFailed(Exception):
    """An attempt failed: ``error`` says why; ``final`` when another attempt cannot help."""

    def __init__(self, error: str, final: bool = False) -> None:
        super().__init__(error)
        self.error = error
        self.final = final


class RankRead:
    """Reads one load's blocks (this rank's head slice) from one producer rank."""

    def __init__(self, ctx: ReadContext, load: LoadState, overlap: HeadOverlap,
                 runs: list[tuple[int, int, int]], local: list[TensorLayout]) -> None:
        self._ctx = ctx
        self.load = load
        self.remote_rank = overlap.remote_rank
        self._overlap = overlap
        self._runs = runs
        self._local = local
        self._rid = load.spec.request_id
        self._deadline = load.received + ctx.budget_s
        self._remote_heads = 1 if ctx.compat.is_mla else ctx.compat.num_kv_heads // load.spec.remote_tp_size
        self._retries = 0
        self._ops: Any = None
        self._ops_peer: Optional[Peer] = None

    def run(self) -> Optional[str]:
        """Read until success (None) or a reason to give up (the error)."""
        error = "no attempt made"
        for attempt in range(self._ctx.config.transfer_retries + 1):
            if attempt:
                self._back_off(attempt)
            halt = self._halt_reason(error)
            if halt is not None:
                error = halt
                break
            try:
                self._attempt(attempt)
                return None
            except _AttemptFailed as exc:
                error = exc.error
                if exc.final:
                    break
        self._ctx.stats.transfer(nbytes=0, seconds=0.0, ranges=0, retries=self._retries, ok=False,
                                 request_id=self._rid)
        return error

    # -- between attempts -------------------------------------------------
    def _back_off(self, attempt: int) -> None:
        self._retries += 1
        self._ctx.stop.wait(self._ctx.config.transfer_retry_backoff_ms * (2 ** (attempt - 1)) / 1000.0)

    def _halt_reason(self, last_error: str) -> Optional[str]:
        if self.load.cancelled:
            return "cancelled"
        if self._ctx.stop.is_set():
            return "connector closing"
        if self._time_left() <= 0:
            return f"{last_error}; gave up after {self._ctx.budget_s:.1f} s"
        return None

    def _time_left(self) -> float:
        return self._deadline - time.monotonic()

    # -- one attempt ------------------------------------------------------
    def _attempt(self, attempt: int) -> None:
        key, fut = self._ctx.peers.get(self.load.spec, self.remote_rank, first_rank=self.load.first_rank)
        peer = self._await_peer(key, fut)
        ops = self._plan(key, peer)
        self._read(key, fut, peer, ops, attempt)

    def _await_peer(self, key: PeerKey, fut: cf.Future) -> Peer:
        """The peer once its handshake completed (bounded by the handshake timeout and the budget)."""
        try:
            return fut.result(timeout=min(self._ctx.config.handshake_timeout_s + 0.5, self._time_left()))
        except HandshakeRejected as exc:
            raise _AttemptFailed(str(exc), final=True) from None
        except HandshakeUnreachable as exc:  # the path is closed: another attempt now would wait as long again
            self._ctx.peers.failed(key, fut, None)
            raise _AttemptFailed(str(exc), final=True) from None
        except cf.CancelledError:
            raise _AttemptFailed("connector closing", final=True) from None
        except (HandshakeError, cf.TimeoutError) as exc:
            self._ctx.peers.failed(key, fut, None)
            raise _AttemptFailed(str(exc) or f"handshake with {key[1]}:{key[2]} timed out") from None

    def _plan(self, key: PeerKey, peer: Peer) -> Any:
        """The read ops from ``peer``, planned once per peer (as an op array when
        the backend takes them and there are many)."""
        if self._ops is not None and self._ops_peer is peer:
            return self._ops
        c0 = time.thread_time()
        local = self._local
        if self.load.spec.remote_pp_size > 1:  # a stage holds some layers: read those from it
            held = sorted({t.layer for t in peer.tensors})
            self.load.stage_layers[self.remote_rank] = held
            local = [t for t in local if t.layer in held]
        try:
            planner = peer.planner(local, self._overlap, local_heads=self._ctx.local_heads,
                                   remote_heads=self._remote_heads)
            # numpy only pays off for many ranges (heterogeneous TP, long prompts)
            use_array = self._ctx.backend.accepts_op_arrays and planner.num_ops(self._runs) >= ARRAY_MIN_OPS
            ops = planner.plan_array(self._runs) if use_array else planner.plan(self._runs)
        except LayoutError as exc:
            raise _AttemptFailed(f"cannot map blocks from {key[1]}:{key[2]}: {exc}", final=True) from None
        finally:
            self._ctx.stats.add(plan_cpu_seconds=time.thread_time() - c0)
        self._ops, self._ops_peer = ops, peer
        return ops

    def _read(self, key: PeerKey, fut: cf.Future, peer: Peer, ops: Any, attempt: int) -> None:
        timeout = max(0.001, min(self._ctx.config.transfer_timeout_s, self._time_left()))
        t0 = time.perf_counter()
        handle = None
        try:
            handle = self._ctx.backend.read(peer.peer_id, ops, timeout_s=timeout)
            finished = handle.wait(timeout + 1.0)
            err = handle.error if finished else f"read did not finish within {timeout:.1f} s"
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
        if err is None:
            self._ctx.peers.succeeded(key)
            self._record_success(ops, time.perf_counter() - t0)
            return
        if handle is not None:
            # Neither retry into these blocks nor hand them back to the
            # engine while the backend may still write them.
            self._await_settled(handle)
        error = f"read from {key[1]}:{key[2]} failed: {err}"
        nbytes, ranges = _extent(ops)
        logger.info("%s: request %s: attempt %d of %d: read of %d bytes in %d ranges from peer %s at %s:%d failed: %s",
                    self._ctx.name, self._rid, attempt + 1, self._ctx.config.transfer_retries + 1, nbytes, ranges,
                    key[0] or "?", key[1], key[2], err)
        self._ctx.peers.failed(key, fut, peer)
        raise _AttemptFailed(error)

    def _await_settled(self, handle: ReadHandle) -> None:
        """Block this read thread until ``handle`` settles (no more writes into
        the destination), or the connector closes (the backend's close settles
        everything). Backends settle within their I/O timeout; a warning is
        logged if it takes longer than ``transfer_timeout_s``."""
        timeout_s = self._ctx.config.transfer_timeout_s
        if handle.wait_settled(timeout_s):
            return
        logger.warning("%s: request %s: a failed read is still writing its blocks after %.1f s; holding them",
                       self._ctx.name, self._rid, timeout_s)
        while not handle.wait_settled(1.0):
            if self._ctx.stop.is_set():
                return

    def _record_success(self, ops: Any, seconds: float) -> None:
        nbytes, _ = _extent(ops)
        self._ctx.stats.transfer(nbytes=nbytes, seconds=seconds, ranges=len(ops), retries=self._retries, ok=True,
                                 request_id=self._rid)


def _extent(ops: Any) -> tuple[int, int]:
    """The bytes and the ranges of a read's ops (a list of ReadOps or an op array)."""
    if isinstance(ops, np.ndarray):
        return int(ops[:, 4].sum()), len(ops)
    return sum(op.size for op in ops), len(ops)
