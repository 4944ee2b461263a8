"""Worker-side connector for one TP rank.

Producer ranks register their KV tensors, serve handshakes, count
done-reading notices and remember which transfers the scheduler released
(``ConnectorMetadata.released``, learnt in ``start_load_kv`` before the step's
forward can overwrite those blocks). Consumer ranks handshake in the background
(cached per remote engine x rank), read every layer's blocks (their head slice)
from the producer ranks holding them, retry transient failures, drop peers that
keep failing, and notify every producer rank when done.

A successful load is only reported once every producer rank it read from
confirmed, with a :class:`~atom_kv.wire.DoneAck`, that it had not released the
transfer before the done-reading arrived: if the producer's lease expired
(``abort_timeout_s``) first, its blocks may have been reused and hold another
request's KV, so the load is reported failed instead (``load_failure_policy``
then applies). No confirmation within ``handshake_timeout_s`` fails it too.
Results go out through :meth:`ConnectorWorker.get_finished`.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import zmq

from atom_kv.config import KVTransferConfig
from atom_kv.connector.handshake import (
    DoneAckClient,
    DoneNotifier,
    HandshakeError,
    HandshakeRejected,
    HandshakeServer,
    compat_mismatch,
    handshake_port,
    request_handshake,
)
from atom_kv.connector.layout import (
    HeadOverlap,
    LayoutError,
    TensorLayout,
    block_runs,
    head_overlaps,
    ReadPlanner,
    head_range,
)
from atom_kv.connector.scheduler import load_budget_s
from atom_kv.connector.stats import TransferStats
from atom_kv.engine_hooks.interface import KVCacheLayer, WorkerHooks
from atom_kv.engine_hooks.types import ConnectorMetadata, KVConnectorOutput, LoadSpec
from atom_kv.transfer import ChunkedRegion, ReadHandle, TransferBackend, chunk_sizes, create_backend
from atom_kv.wire import CompatInfo, DoneAck, DoneReading, HandshakeReply, HandshakeRequest, RegionInfo

__all__ = ["ConnectorWorker"]

logger = logging.getLogger(__name__)

_PeerKey = tuple[str, str, int]
_ARRAY_OP_BACKENDS = frozenset({"tcp", "cma", "auto", "moriio"})
_ARRAY_MIN_OPS = 32  # from here an op array is cheaper end to end (planning + the backend's conversion)
_MAX_PARTIAL_DONE = 65536  # (remote engine id, host, port)
_MAX_RELEASED = 65536


@dataclass
class _Peer:
    key: _PeerKey
    peer_id: str
    tp_rank: int
    tensors: list[TensorLayout]
    planners: dict[HeadOverlap, ReadPlanner] = field(default_factory=dict)


@dataclass
class _LoadState:
    spec: LoadSpec
    received: float
    pending: set[int]
    read_ranks: frozenset[int] = frozenset()
    error: Optional[str] = None
    cancelled: bool = False


@dataclass
class _DoneState:
    ranks: set[int] = field(default_factory=set)
    tp_size: int = 1
    first_seen: float = field(default_factory=time.monotonic)


class ConnectorWorker(WorkerHooks):
    """Owns one TP rank's transfer backend, handshake server/client, in-flight reads and stats."""

    def __init__(
        self,
        config: KVTransferConfig,
        *,
        engine_id: str,
        host: str,
        tp_rank: int,
        tp_size: int,
        dp_rank: int = 0,
        compat: CompatInfo,
        backend: Optional[TransferBackend] = None,
        bind_host: str = "0.0.0.0",
    ) -> None:
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is outside tp_size {tp_size}")
        if not compat.is_mla:
            head_range(compat.num_kv_heads, tp_size, tp_rank)  # raises LayoutError when heads don't divide
        self.config = config
        self.engine_id = engine_id
        self.host = host
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.dp_rank = dp_rank
        self.compat = compat
        self._name = f"{engine_id}/dp{dp_rank}/tp{tp_rank}"
        self._budget = load_budget_s(config)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self.stats_ = TransferStats(f"atom-kv {self._name}")
        self._tensors: list[TensorLayout] = []
        self._regions: list[RegionInfo] = []
        self._keepalive: list[Any] = []
        # consumer
        self._loads: dict[str, _LoadState] = {}
        self._finished_recv: list[str] = []
        self._failed_recv: dict[str, str] = {}
        self._peers: dict[_PeerKey, cf.Future] = {}
        self._peer_failures: dict[_PeerKey, int] = {}
        self._tls = threading.local()  # each read thread's DoneAckClient
        self._ack_clients: list[DoneAckClient] = []
        # producer
        self._done: dict[str, _DoneState] = {}
        self._completed: OrderedDict[str, None] = OrderedDict()
        self._released: OrderedDict[str, None] = OrderedDict()  # transfers whose blocks the scheduler freed
        self._finished_send: list[str] = []

        self.backend = backend or create_backend(
            config.backend, config, host=host, key=f"{engine_id}-dp{dp_rank}-tp{tp_rank}"
        )
        # these backends document that ``read`` also takes an (n, 5) int array of
        # ReadOp columns: planning then stays vectorised (32k+ ranges for big
        # heterogeneous-TP loads); any other backend gets ReadOp lists
        self._array_ops = self.backend.name in _ARRAY_OP_BACKENDS
        self._ctx = zmq.Context()
        self._server: Optional[HandshakeServer] = None
        self._notifier: Optional[DoneNotifier] = None
        self._hs_pool: Optional[cf.ThreadPoolExecutor] = None
        self._read_pool: Optional[cf.ThreadPoolExecutor] = None
        try:
            if config.is_producer:
                self._server = HandshakeServer(
                    self._ctx,
                    bind_host=bind_host,
                    port=handshake_port(config.handshake_port, dp_rank, tp_size, tp_rank),
                    auth_token=config.auth_token,
                    responder=self._answer_handshake,
                    on_done=self._on_done_reading,
                    stats=self.stats_,
                    name=f"atom-kv-hs-server-tp{tp_rank}",
                )
            else:
                self._notifier = DoneNotifier(self._ctx, name=f"atom-kv-notify-tp{tp_rank}", stats=self.stats_)
                self._hs_pool = cf.ThreadPoolExecutor(2, thread_name_prefix=f"atom-kv-hs-client-tp{tp_rank}")
                self._read_pool = cf.ThreadPoolExecutor(
                    max(4, config.num_worker_threads), thread_name_prefix=f"atom-kv-read-tp{tp_rank}"
                )
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------
    # registration
    # ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Sequence[KVCacheLayer]) -> None:
        c = self.compat
        if len(kv_caches) != c.num_layers:
            raise ValueError(f"got {len(kv_caches)} KV cache layers, compat says num_layers={c.num_layers}")
        tensors: list[TensorLayout] = []
        regions: list[RegionInfo] = []
        for layer, entry in enumerate(kv_caches):
            if c.is_mla:
                named = [("latent", entry)]
            else:
                if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                    raise ValueError(f"layer {layer}: expected a (k, v) pair of tensors")
                named = [("k", entry[0]), ("v", entry[1])]
            for kind, t in named:
                block_bytes = self._check_tensor(layer, kind, t)
                nbytes = t.numel() * t.element_size()
                ids = self.backend.register_memory(t.data_ptr(), nbytes, align=block_bytes)
                chunk = chunk_sizes(nbytes, block_bytes)[0]
                num_blocks = int(t.shape[0])
                tensors.append(TensorLayout(layer, kind, ChunkedRegion(tuple(ids), chunk, nbytes), block_bytes, num_blocks))
                regions.append(RegionInfo(layer=layer, kind=kind, region_ids=list(ids), chunk_bytes=chunk,
                                          block_bytes=block_bytes, num_blocks=num_blocks))
                self._keepalive.append(t)
        with self._lock:
            self._tensors = tensors
            self._regions = regions
        logger.info("%s: registered %d KV tensors (%d layers) with the %s backend",
                    self._name, len(tensors), c.num_layers, self.backend.name)

    def _check_tensor(self, layer: int, kind: str, t: Any) -> int:
        c = self.compat
        shape = tuple(int(s) for s in t.shape)
        if c.is_mla:
            ok = len(shape) == 3 and shape[1] == c.block_size
            want = "[num_blocks, block_size, latent_dim]"
        else:
            heads = c.num_kv_heads // self.tp_size
            ok = len(shape) == 4 and shape[1:] == (heads, c.block_size, c.head_dim)
            want = f"[num_blocks, {heads}, {c.block_size}, {c.head_dim}]"
        if not ok:
            raise ValueError(f"layer {layer} {kind} cache has shape {list(shape)}, expected {want}")
        if hasattr(t, "is_contiguous") and not t.is_contiguous():
            raise ValueError(f"layer {layer} {kind} cache must be contiguous")
        return (t.numel() // shape[0]) * t.element_size()

    # ------------------------------------------------------------------
    # producer side
    # ------------------------------------------------------------------
    def _answer_handshake(self, req: HandshakeRequest) -> HandshakeReply:
        with self._lock:
            regions = list(self._regions)
        base = dict(engine_id=self.engine_id, tp_rank=self.tp_rank, tp_size=self.tp_size,
                    dp_rank=self.dp_rank, compat=self.compat, backend=self.backend.name, host=self.host)
        error = compat_mismatch(self.compat, req.compat)
        if error is None and not regions:
            error = "the producer has not registered its KV caches yet"
        if error is None and req.backend and req.backend != self.backend.name:
            error = f"transfer backend mismatch: {self.backend.name} (here) vs {req.backend} (peer)"
        if error is not None:
            logger.warning("%s: refused handshake from engine %s rank %d: %s",
                           self._name, req.engine_id, req.tp_rank, error)
            return HandshakeReply(ok=False, error=error, **base)
        return HandshakeReply(ok=True, descriptor=self.backend.export_descriptor(), regions=regions, **base)

    def _on_done_reading(self, msg: DoneReading) -> Optional[DoneAck]:
        ack: Optional[DoneAck] = None
        if msg.want_ack and msg.ok:
            # checked under the lock that start_load_kv marks releases under
            with self._lock:
                released = msg.transfer_id in self._released
            if released:
                why = (f"producer released transfer {msg.transfer_id} before the read was confirmed "
                       f"(lease expired after abort_timeout_s)")
                logger.warning("%s: consumer %s rank %d read transfer %s after its lease expired; "
                               "telling it the read is invalid", self._name, msg.engine_id, msg.tp_rank,
                               msg.transfer_id)
                ack = DoneAck(transfer_id=msg.transfer_id, tp_rank=self.tp_rank, valid=False, reason=why)
            else:
                ack = DoneAck(transfer_id=msg.transfer_id, tp_rank=self.tp_rank, valid=True)
        self._count_done(msg)
        return ack

    def _count_done(self, msg: DoneReading) -> None:
        with self._lock:
            if msg.transfer_id in self._completed:
                return
            st = self._done.get(msg.transfer_id)
            if st is None:
                st = self._done[msg.transfer_id] = _DoneState(tp_size=msg.tp_size)
                if len(self._done) > _MAX_PARTIAL_DONE:  # bounded even if notices never complete
                    del self._done[next(iter(self._done))]
            st.ranks.add(msg.tp_rank)
            if len(st.ranks) < st.tp_size:
                return
            del self._done[msg.transfer_id]
            self._remember_completed(msg.transfer_id)
            self._finished_send.append(msg.transfer_id)
        logger.debug("%s: transfer %s read by all %d consumer ranks (last %s)", self._name, msg.transfer_id,
                     msg.tp_size, "ok" if msg.ok else "gave up")

    def _remember_completed(self, tid: str) -> None:
        self._completed[tid] = None
        if len(self._completed) > 65536:
            self._completed.popitem(last=False)

    # ------------------------------------------------------------------
    # consumer side
    # ------------------------------------------------------------------
    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        now = time.monotonic()
        with self._lock:
            for tid in metadata.released:
                self._done.pop(tid, None)
                self._remember_completed(tid)
                self._released[tid] = None
                if len(self._released) > _MAX_RELEASED:
                    self._released.popitem(last=False)
            for rid in metadata.cancelled:
                st = self._loads.get(rid)
                if st is not None:
                    st.cancelled = True
        for spec in metadata.loads:
            self._start_load(spec, now)

    def _start_load(self, spec: LoadSpec, now: float) -> None:
        rid = spec.request_id
        if self._read_pool is None or self._closed:
            why = "the connector is closed" if self._closed else "this engine is not a kv_consumer"
            logger.warning("%s: request %s: cannot load remote KV: %s", self._name, rid, why)
            with self._lock:
                self._failed_recv[rid] = why
            return
        try:
            overlaps = head_overlaps(self.compat.num_kv_heads, self.tp_size, self.tp_rank,
                                     spec.remote_tp_size, is_mla=self.compat.is_mla)
            runs = block_runs(spec.block_ids, spec.remote_block_ids)
            if not self._tensors:
                raise LayoutError("this rank has not registered its KV caches")
        except LayoutError as exc:
            with self._lock:
                self._failed_recv[rid] = str(exc)
            self._notify_done(spec, ok=False)
            return
        ranks = {o.remote_rank for o in overlaps}
        st = _LoadState(spec, now, set(ranks), frozenset(ranks))
        with self._lock:
            if rid in self._loads:
                logger.warning("%s: request %s is already loading; ignoring the duplicate", self._name, rid)
                return
            self._loads[rid] = st
        for ov in overlaps:
            try:
                self._read_pool.submit(self._run_read, st, ov, runs)
            except RuntimeError:  # closed concurrently
                self._rank_done(st, ov.remote_rank, "the connector is closed")

    def _peer_future(self, spec: LoadSpec, remote_rank: int) -> tuple[_PeerKey, cf.Future]:
        port = handshake_port(spec.remote_handshake_port, spec.remote_dp_rank, spec.remote_tp_size, remote_rank)
        key = (spec.remote_engine_id, spec.remote_host, port)
        with self._lock:
            fut = self._peers.get(key)
            if fut is None or (fut.done() and fut.exception() is not None):
                assert self._hs_pool is not None
                fut = self._hs_pool.submit(self._handshake, key, remote_rank, spec.remote_tp_size)
                self._peers[key] = fut
            return key, fut

    def _handshake(self, key: _PeerKey, remote_rank: int, remote_tp: int) -> _Peer:
        _, host, port = key
        t0 = time.perf_counter()
        req = HandshakeRequest(engine_id=self.engine_id, tp_rank=self.tp_rank, tp_size=self.tp_size,
                               compat=self.compat, backend=self.backend.name, host=self.host,
                               auth_token=self.config.auth_token)
        try:
            reply = request_handshake(self._ctx, host, port, req, self.config.handshake_timeout_s, self._stop)
            if not reply.ok:
                raise HandshakeRejected(f"handshake with {host}:{port} refused: {reply.error}")
            if reply.compat is not None and (err := compat_mismatch(self.compat, reply.compat)):
                raise HandshakeRejected(f"handshake with {host}:{port}: {err}")
            if key[0] and reply.engine_id and reply.engine_id != key[0]:
                # a restarted producer: the KV this transfer names is gone
                raise HandshakeRejected(
                    f"{host}:{port} is now engine {reply.engine_id}, not {key[0]} that prefilled this "
                    "request (the prefill engine restarted; its KV is gone)"
                )
            if reply.tp_size != remote_tp or reply.tp_rank != remote_rank:
                raise HandshakeRejected(
                    f"{host}:{port} is TP rank {reply.tp_rank} of {reply.tp_size}, "
                    f"expected rank {remote_rank} of {remote_tp}"
                )
            peer_id = self.backend.add_peer(reply.descriptor)
        except HandshakeError:
            self.stats_.add(handshake_failures=1)
            raise
        except Exception as exc:
            self.stats_.add(handshake_failures=1)
            raise HandshakeError(f"handshake with {host}:{port} failed: {exc}") from None
        tensors = [
            TensorLayout(r.layer, r.kind, ChunkedRegion(tuple(r.region_ids), r.chunk_bytes, r.num_blocks * r.block_bytes),
                         r.block_bytes, r.num_blocks)
            for r in reply.regions
        ]
        elapsed = time.perf_counter() - t0
        self.stats_.add(handshakes=1, handshake_seconds=elapsed)
        logger.info("%s: handshake with engine %s rank %d at %s:%d took %.1f ms",
                    self._name, reply.engine_id, reply.tp_rank, host, port, elapsed * 1e3)
        return _Peer(key, peer_id, reply.tp_rank, tensors)

    def _run_read(self, st: _LoadState, ov: HeadOverlap, runs: list[tuple[int, int, int]]) -> None:
        try:
            error = self._read_from(st, ov, runs)
        except Exception as exc:  # never lose a load to a bug: fail it clearly
            logger.exception("%s: request %s: read from rank %d crashed", self._name, st.spec.request_id, ov.remote_rank)
            error = f"internal error: {exc}"
        self._rank_done(st, ov.remote_rank, error)

    def _read_from(self, st: _LoadState, ov: HeadOverlap, runs: list[tuple[int, int, int]]) -> Optional[str]:
        spec, cfg = st.spec, self.config
        rid = spec.request_id
        deadline = st.received + self._budget
        local_heads = 1 if self.compat.is_mla else self.compat.num_kv_heads // self.tp_size
        remote_heads = 1 if self.compat.is_mla else self.compat.num_kv_heads // spec.remote_tp_size
        retries = 0
        error = "no attempt made"
        ops = None
        ops_peer: Optional[_Peer] = None
        for attempt in range(cfg.transfer_retries + 1):
            if attempt:
                retries += 1
                self._stop.wait(cfg.transfer_retry_backoff_ms * (2 ** (attempt - 1)) / 1000.0)
            if st.cancelled:
                error = "cancelled"
                break
            if self._stop.is_set():
                error = "connector closing"
                break
            left = deadline - time.monotonic()
            if left <= 0:
                error = f"{error}; gave up after {self._budget:.1f} s"
                break
            key, fut = self._peer_future(spec, ov.remote_rank)
            try:
                peer: _Peer = fut.result(timeout=min(cfg.handshake_timeout_s + 0.5, left))
            except HandshakeRejected as exc:
                error = str(exc)
                break
            except cf.CancelledError:
                error = "connector closing"
                break
            except (HandshakeError, cf.TimeoutError) as exc:
                error = str(exc) or f"handshake with {key[1]}:{key[2]} timed out"
                self._peer_failed(key, fut, None)
                continue
            if ops is None or ops_peer is not peer:  # a re-handshaked peer may number its regions anew
                ops_peer = peer
                c0 = time.thread_time()
                try:
                    planner = peer.planners.get(ov)
                    if planner is None:
                        planner = peer.planners[ov] = ReadPlanner(self._tensors, peer.tensors, ov,
                                                                  local_heads=local_heads, remote_heads=remote_heads)
                    # numpy only pays off for many ranges (heterogeneous TP, long prompts)
                    use_array = self._array_ops and planner.num_ops(runs) >= _ARRAY_MIN_OPS
                    ops = planner.plan_array(runs) if use_array else planner.plan(runs)
                except LayoutError as exc:
                    error = f"cannot map blocks from {key[1]}:{key[2]}: {exc}"
                    break
                finally:
                    self.stats_.add(plan_cpu_seconds=time.thread_time() - c0)
            timeout = max(0.001, min(cfg.transfer_timeout_s, deadline - time.monotonic()))
            t0 = time.perf_counter()
            handle = None
            try:
                handle = self.backend.read(peer.peer_id, ops, timeout_s=timeout)
                finished = handle.wait(timeout + 1.0)
                err = handle.error if finished else f"read did not finish within {timeout:.1f} s"
            except Exception as exc:
                err = f"{type(exc).__name__}: {exc}"
            if err is not None and handle is not None:
                # Neither retry into these blocks nor hand them back to the
                # engine while the backend may still write them.
                self._await_settled(handle, rid)
            if err is None:
                with self._lock:
                    self._peer_failures.pop(key, None)
                nbytes = int(ops[:, 4].sum()) if isinstance(ops, np.ndarray) else sum(op.size for op in ops)
                self.stats_.transfer(nbytes=nbytes, seconds=time.perf_counter() - t0, ranges=len(ops),
                                     retries=retries, ok=True, request_id=rid)
                return None
            error = f"read from {key[1]}:{key[2]} failed: {err}"
            logger.info("%s: request %s: attempt %d: %s", self._name, rid, attempt + 1, error)
            self._peer_failed(key, fut, peer)
        self.stats_.transfer(nbytes=0, seconds=0.0, ranges=0, retries=retries, ok=False, request_id=rid)
        return error

    def _await_settled(self, handle: ReadHandle, rid: str) -> None:
        """Block this read thread until ``handle`` settles (no more writes into
        the destination), or the connector closes (the backend's close settles
        everything). Backends settle within their I/O timeout; a warning is
        logged if it takes longer than ``transfer_timeout_s``."""
        if handle.wait_settled(self.config.transfer_timeout_s):
            return
        logger.warning("%s: request %s: a failed read is still writing its blocks after %.1f s; holding them",
                       self._name, rid, self.config.transfer_timeout_s)
        while not handle.wait_settled(1.0):
            if self._stop.is_set():
                return

    def _peer_failed(self, key: _PeerKey, fut: cf.Future, peer: Optional[_Peer]) -> None:
        """Count a consecutive failure; past the threshold, forget the peer so the next use re-handshakes."""
        with self._lock:
            if self._peers.get(key) is not fut:
                return  # a failure on a peer already replaced: says nothing about the new one
            n = self._peer_failures.get(key, 0) + 1
            self._peer_failures[key] = n
            if n < self.config.peer_failure_threshold:
                if peer is None and fut.done():
                    del self._peers[key]  # a failed handshake is never cached
                return
            self._peer_failures.pop(key, None)
            if not fut.done():
                return  # the handshake is still running; its own timeout ends it
            del self._peers[key]
        self.stats_.add(peers_dropped=1)
        logger.warning("%s: peer %s at %s:%d declared failed after %d consecutive failures; will re-handshake",
                       self._name, key[0], key[1], key[2], n)
        if peer is not None:
            try:
                self.backend.remove_peer(peer.peer_id)
            except Exception as exc:
                logger.warning("%s: removing peer %s failed: %s", self._name, peer.peer_id, exc)

    def _rank_done(self, st: _LoadState, remote_rank: int, error: Optional[str]) -> None:
        rid = st.spec.request_id
        with self._lock:
            st.pending.discard(remote_rank)
            if error is not None and st.error is None:
                st.error = error
            if st.pending:
                return
            error = st.error
        if error is None:
            # the last read of this load (a read thread): the blocks only count
            # once every producer rank read from confirms it still held them
            error = self._confirm_reads(st)
        with self._lock:
            self._loads.pop(rid, None)
            if error is None:
                self._finished_recv.append(rid)
            else:
                self._failed_recv[rid] = error
        if error is not None:
            logger.warning("%s: request %s: load of transfer %s failed: %s",
                           self._name, rid, st.spec.transfer_id, error)
        if st.error is not None:
            self._notify_done(st.spec, ok=False)

    def _confirm_reads(self, st: _LoadState) -> Optional[str]:
        """Send ``DoneReading(want_ack)`` to the producer ranks read from (a
        plain notice to the others) and wait for their acks; the reason the
        load cannot be trusted, or None."""
        spec = st.spec
        self._notify_done(spec, ok=True, skip=st.read_ranks)
        client: Optional[DoneAckClient] = getattr(self._tls, "ack_client", None)
        if client is None:
            client = self._tls.ack_client = DoneAckClient(self._ctx, stats=self.stats_)
            with self._lock:
                self._ack_clients.append(client)
        targets = {
            r: (spec.remote_host,
                handshake_port(spec.remote_handshake_port, spec.remote_dp_rank, spec.remote_tp_size, r))
            for r in sorted(st.read_ranks)
        }
        msg = DoneReading(transfer_id=spec.transfer_id, engine_id=self.engine_id, tp_rank=self.tp_rank,
                          tp_size=self.tp_size, ok=True, auth_token=self.config.auth_token, want_ack=True)
        try:
            return client.confirm(targets, msg, self.config.handshake_timeout_s, self._stop)
        except Exception as exc:  # never lose a load to a bug: fail it clearly
            logger.exception("%s: request %s: confirming transfer %s crashed", self._name, spec.request_id,
                             spec.transfer_id)
            return f"internal error while confirming the read: {exc}"

    def _notify_done(self, spec: LoadSpec, *, ok: bool, skip: frozenset[int] = frozenset()) -> None:
        if self._notifier is None:
            return
        msg = DoneReading(transfer_id=spec.transfer_id, engine_id=self.engine_id, tp_rank=self.tp_rank,
                          tp_size=self.tp_size, ok=ok, auth_token=self.config.auth_token)
        for p in range(spec.remote_tp_size):
            if p in skip:
                continue
            port = handshake_port(spec.remote_handshake_port, spec.remote_dp_rank, spec.remote_tp_size, p)
            self._notifier.send(spec.remote_host, port, msg)

    # ------------------------------------------------------------------
    def get_finished(self) -> KVConnectorOutput:
        now = time.monotonic()
        with self._lock:
            out = KVConnectorOutput(finished_sending=self._finished_send, finished_recving=self._finished_recv,
                                    failed_recving=self._failed_recv)
            self._finished_send, self._finished_recv, self._failed_recv = [], [], {}
            stale = [t for t, s in self._done.items() if now - s.first_seen > 2 * self.config.abort_timeout_s]
            for tid in stale:
                del self._done[tid]
        self.stats_.maybe_log()
        return out

    def stats(self) -> dict[str, float]:
        return self.stats_.snapshot()

    def num_loading(self) -> int:
        with self._lock:
            return len(self._loads)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._server is not None:
            self._server.close()
        if self._hs_pool is not None:
            self._hs_pool.shutdown(wait=True, cancel_futures=True)
        try:
            self.backend.close()
        except Exception as exc:
            logger.warning("%s: closing the transfer backend failed: %s", self._name, exc)
        if self._read_pool is not None:
            self._read_pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            clients, self._ack_clients = self._ack_clients, []
        for client in clients:  # their threads have ended with the read pool
            client.close()
        if self._notifier is not None:
            self._notifier.close()
        self._ctx.destroy(linger=0)
        logger.info("%s", self.stats_.summary())
