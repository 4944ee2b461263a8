"""The consumer (decode) side of the worker connector, one per TP rank.

For each load the rank reads its head slice of every layer from the
producer ranks holding it (one :class:`~atom_kv.connector.reads.RankRead`
per producer rank, on a read pool; handshakes are cached per peer by
:class:`~atom_kv.connector.peers.PeerTable`, which contacts a producer it has
not met on one rank's port first), then notifies every producer rank that it
is done. Each ended load says whether its producer answered a handshake here
(``KVConnectorOutput.reached``), so the scheduler may release all its ranks.

A successful load is only reported once every producer rank it read from
confirmed, with a :class:`~atom_kv.wire.DoneAck`, that it had not released
the transfer before the done-reading arrived: if the producer's lease expired
(``abort_timeout_s``) first, its blocks may have been reused and hold another
request's KV, so the load is reported failed instead (``load_failure_policy``
then applies). No confirmation within ``handshake_timeout_s`` fails it too.

A rendezvous load whose producer promised to hold the blocks (``lease_ms``)
and whose reads ended well inside that promise sends its done-reading
notices without waiting for the answers: the promise already says what the
confirmation would (the argument is at
:meth:`~atom_kv.connector.producer_rendezvous.Rendezvous.pin_locked`), and the
round trip would sit on the path to the request's second token. A producer
that answers "still coming" (its scheduler has the request queued) is asked
again, for up to ``prefill_queue_timeout_s``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import threading
import time
from typing import Optional, Union

import msgspec

from atom_kv.connector.confirm import DoneAckClient
from atom_kv.connector.layout import HeadOverlap, LayoutError, block_runs, head_overlaps
from atom_kv.connector.peers import PeerKey, PeerTable, producer_key, producer_port
from atom_kv.connector.pipeline import check_stage_cover
from atom_kv.connector.reasons import BlocksFailure, NoBlocks
from atom_kv.connector.reads import LoadState, RankRead, ReadContext
from atom_kv.connector.rendezvous import BlocksClient
from atom_kv.connector.scheduler import load_budget_s, rendezvous_wait_s
from atom_kv.connector.types import ConnectorMetadata, LoadSpec
from atom_kv.connector.worker import ConnectorWorker
from atom_kv.wire import BlocksAnswer, BlocksQuery, DoneReading, HandshakeRequest, blocks_digest

__all__ = ["ConsumerWorker"]

logger = logging.getLogger(__name__)

#: loads waiting for their prefill at once, per rank (more wait for a thread)
MAX_RENDEZVOUS_THREADS = 64
#: the end of a producer's promise a read must keep clear of: this share of it, at least LEASE_SLACK_MIN_S
LEASE_SLACK_SHARE = 0.1
LEASE_SLACK_MIN_S = 0.05


class ConsumerWorker(ConnectorWorker):
    """Owns a decode rank's in-flight loads, its peers and handshake pool,
    its read pool and the confirmation clients."""

    role = "kv_consumer"

    # what close() may find before _start() ran to the end
    _peers: Optional[PeerTable] = None
    _read_pool: Optional[cf.ThreadPoolExecutor] = None
    _wait_pool: Optional[cf.ThreadPoolExecutor] = None
    _reads: Optional[ReadContext] = None

    def _start(self) -> None:
        cfg, rank = self.config, self.tp_rank
        self._loads: dict[str, LoadState] = {}
        self._waiting: dict[str, threading.Event] = {}  # loads waiting for their block ids: rid -> cancelled
        self._tls = threading.local()  # each read thread's DoneAckClient and BlocksClient
        self._ack_clients: list[DoneAckClient] = []
        self._blocks_clients: list[BlocksClient] = []
        request = HandshakeRequest(engine_id=self.engine_id, tp_rank=rank, tp_size=self.tp_size,
                                   compat=self.compat, backend=self.backend.name, host=self.host)
        self._peers = PeerTable(self._ctx, self.backend, cfg, request, stats=self.stats_, stop=self._stop,
                                name=self._name, thread_prefix=f"atom-kv-hs-client-tp{rank}", routes=self.routes_,
                                max_peers=cfg.max_producer_peers, handshake_threads=cfg.handshake_threads)
        self._read_pool = cf.ThreadPoolExecutor(max(4, cfg.num_worker_threads),
                                                thread_name_prefix=f"atom-kv-read-tp{rank}")
        # loads waiting for their prefill (the rendezvous) wait here, never on a read thread: a read
        # whose blocks are known must not queue behind another transfer's prefill
        self._wait_pool = cf.ThreadPoolExecutor(MAX_RENDEZVOUS_THREADS, thread_name_prefix=f"atom-kv-rendezvous-tp{rank}")
        self._reads = ReadContext(
            config=cfg, compat=self.compat, backend=self.backend, peers=self._peers, stats=self.stats_,
            stop=self._stop, name=self._name, budget_s=load_budget_s(cfg),
            local_heads=1 if self.compat.is_mla else self.compat.num_kv_heads // self.tp_size,
        )

    def _registered(self, memory: list[str]) -> None:
        if self._peers is not None:
            self._peers.set_memory(memory)

    def _renamed(self) -> None:
        if self._peers is not None:
            self._peers.rename(self.engine_id, self._name)
        if self._reads is not None:
            self._reads = dataclasses.replace(self._reads, name=self._name)

    # ------------------------------------------------------------------
    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        now = time.monotonic()
        with self._lock:
            for rid in metadata.cancelled:
                st = self._loads.get(rid)
                if st is not None:
                    st.cancelled = True
                waiting = self._waiting.get(rid)
                if waiting is not None:
                    waiting.set()
        for spec in metadata.loads:
            self._start_load(spec, now)

    def _start_load(self, spec: LoadSpec, now: float, lease_until: Optional[float] = None) -> None:
        rid = spec.request_id
        if self._closed or self._read_pool is None or self._reads is None or self._peers is None:
            why = "the connector is closed"
            logger.warning("%s: request %s: cannot load remote KV: %s", self._name, rid, why)
            self._fail_load(rid, why)
            return
        if spec.await_blocks:
            self._start_rendezvous(spec)
            return
        local = self._kv.layouts
        try:
            overlaps = head_overlaps(self.compat.num_kv_heads, self.tp_size, self.tp_rank,
                                     spec.remote_tp_size, is_mla=self.compat.is_mla)
            runs = block_runs(spec.block_ids, spec.remote_block_ids)
            if not local:
                raise LayoutError("this rank has not registered its KV caches")
        except LayoutError as exc:
            self._fail_load(rid, str(exc))
            return
        if spec.remote_pp_size > 1:  # the same heads from every pipeline stage: rank = stage*tp + tp_rank
            tp = spec.remote_tp_size
            overlaps = [HeadOverlap(s * tp + o.remote_rank, o.local_first, o.remote_first, o.count)
                        for s in range(spec.remote_pp_size) for o in overlaps]
        ranks = {o.remote_rank for o in overlaps}
        st = LoadState(spec, now, set(ranks), frozenset(ranks), lease_until=lease_until,
                       first_rank=min(ranks, default=0))
        with self._lock:
            if rid in self._loads:
                logger.warning("%s: request %s is already loading; ignoring the duplicate", self._name, rid)
                return
            self._loads[rid] = st
        # the handshakes start now, not when a read thread takes the load: the loads of one step
        # contact all their producers at once, however many loads queue for a read thread
        try:
            for remote_rank in sorted(ranks):
                self._peers.get(spec, remote_rank, first_rank=st.first_rank)
        except RuntimeError:  # closed concurrently: the reads below fail the load
            pass
        for ov in overlaps:
            try:
                self._read_pool.submit(self._run_read, RankRead(self._reads, st, ov, runs, local))
            except RuntimeError:  # closed concurrently
                self._rank_done(st, ov.remote_rank, "the connector is closed")

    def _start_rendezvous(self, spec: LoadSpec) -> None:
        """Learn the load's block ids from the producer (on a rendezvous thread), then start it."""
        rid = spec.request_id
        cancelled = threading.Event()
        with self._lock:
            if rid in self._loads or rid in self._waiting:
                logger.warning("%s: request %s is already loading; ignoring the duplicate", self._name, rid)
                return
            self._waiting[rid] = cancelled
        try:
            if self._wait_pool is None:
                raise RuntimeError("no rendezvous pool")
            self._wait_pool.submit(self._await_blocks, spec, cancelled)
        except RuntimeError:  # closed concurrently
            with self._lock:
                self._waiting.pop(rid, None)
            self._fail_load(rid, "the connector is closed")

    def _await_blocks(self, spec: LoadSpec, cancelled: threading.Event) -> None:
        rid = spec.request_id
        lease_until: Optional[float] = None
        try:
            result, asked = self._ask_blocks(spec, cancelled)
        except Exception as exc:  # never lose a load to a bug: fail it clearly
            logger.exception("%s: request %s: asking for the blocks of transfer %s crashed", self._name, rid,
                             spec.transfer_id)
            result = NoBlocks(BlocksFailure.INTERNAL, f"internal error while asking for the blocks: {exc}")
        with self._lock:
            self._waiting.pop(rid, None)
        if isinstance(result, BlocksAnswer):
            blocks = result.block_ids
            need = spec.remote_block_offset + len(spec.block_ids)
            if len(blocks) < need:
                result = NoBlocks(BlocksFailure.TOO_FEW, f"the prefill holds {len(blocks)} blocks for transfer "
                                                         f"{spec.transfer_id}; this engine needs {need}")
            elif cancelled.is_set():
                result = NoBlocks(BlocksFailure.CANCELLED, "the request ended while waiting for the prefill")
            else:
                if result.first_token_ids:  # the engine may go on from it while the blocks load
                    with self._lock:
                        self._first_tokens[rid] = list(result.first_token_ids)
                    self._wake()
                remote = blocks[spec.remote_block_offset:need]
                if result.lease_ms > 0:
                    lease_s = result.lease_ms / 1000.0
                    lease_until = asked + lease_s - max(LEASE_SLACK_MIN_S, LEASE_SLACK_SHARE * lease_s)
                self._start_load(msgspec.structs.replace(spec, remote_block_ids=remote, await_blocks=False),
                                 time.monotonic(), lease_until)
                return
        logger.warning("%s: request %s: no blocks for transfer %s: %s", self._name, rid, spec.transfer_id, result)
        self._fail_load(rid, result.text)

    def _ask_blocks(self, spec: LoadSpec, cancelled: threading.Event) -> tuple[Union[BlocksAnswer, NoBlocks], float]:
        """The producer's answer (or why there is none) and when the question that got it was sent;
        asked again while the producer says the prefill is still coming, up to
        :func:`~atom_kv.connector.scheduler.rendezvous_wait_s`."""
        overlaps = head_overlaps(self.compat.num_kv_heads, self.tp_size, self.tp_rank, spec.remote_tp_size,
                                 is_mla=self.compat.is_mla)
        client: Optional[BlocksClient] = getattr(self._tls, "blocks_client", None)
        if client is None:
            client = self._tls.blocks_client = BlocksClient(self._ctx, stats=self.stats_,
                                                            auth_token=self.config.auth_token)
            with self._lock:
                self._blocks_clients.append(client)
        query = BlocksQuery(transfer_id=spec.transfer_id, engine_id=self.engine_id, tp_rank=self.tp_rank,
                            tp_size=self.tp_size)
        port = producer_port(spec, overlaps[0].remote_rank)
        end = time.monotonic() + rendezvous_wait_s(self.config)
        while True:
            asked = time.monotonic()
            wait_s = min(self.config.prefill_wait_timeout_s, max(0.0, end - asked))
            result = client.blocks(spec.remote_host, port, query, wait_s, self._stop, cancelled, spec.remote_pp_size)
            if not (isinstance(result, BlocksAnswer) and not result.found):
                return result, asked
            if time.monotonic() >= end:
                return NoBlocks(BlocksFailure.STILL_COMING,
                                f"transfer {spec.transfer_id} was still queued or computing on the prefill after "
                                f"{rendezvous_wait_s(self.config):g} s (prefill_queue_timeout_s)"), asked
            logger.debug("%s: request %s: %s; asking again", self._name, spec.request_id, result.reason)

    def _run_read(self, read: RankRead) -> None:
        st, rank = read.load, read.remote_rank
        try:
            error = read.run()
        except Exception as exc:  # never lose a load to a bug: fail it clearly
            logger.exception("%s: request %s: read from rank %d crashed", self._name, st.spec.request_id, rank)
            error = f"internal error: {exc}"
        self._rank_done(st, rank, error)

    def _rank_done(self, st: LoadState, remote_rank: int, error: Optional[str]) -> None:
        rid = st.spec.request_id
        with self._lock:
            st.pending.discard(remote_rank)
            if error is not None and st.error is None:
                st.error = error
            if st.pending:
                return
            error = st.error
        if error is None and st.spec.remote_pp_size > 1:
            error = self._check_stages(st)
        if error is None:
            # the last read of this load (a read thread): the blocks only count
            # once every producer rank read from confirms it still held them
            error = self._confirm_reads(st)
        reached = self._peers is not None and self._peers.knows(producer_key(st.spec))
        with self._lock:
            self._loads.pop(rid, None)
            if error is None:
                self._finished_recv.append(rid)
            else:
                self._failed_recv[rid] = error
            if reached:
                self._reached.append(rid)
        self._wake()
        if error is not None:
            logger.warning("%s: request %s: load of transfer %s failed: %s",
                           self._name, rid, st.spec.transfer_id, error)

    def _check_stages(self, st: LoadState) -> Optional[str]:
        """Every layer here was read from exactly one pipeline stage (per producer TP rank read from)."""
        tp, pp = st.spec.remote_tp_size, st.spec.remote_pp_size
        local_layers = {t.layer for t in self._kv.layouts}
        for tp_rank in sorted({r % tp for r in st.read_ranks}):
            held = [st.stage_layers.get(s * tp + tp_rank, []) for s in range(pp)]
            why = check_stage_cover(local_layers, held)
            if why is not None:
                return f"cannot map the prefill's pipeline stages onto this engine's layers: {why}"
        return None

    def _confirm_reads(self, st: LoadState) -> Optional[str]:
        """Send ``DoneReading(want_ack)`` to the producer ranks read from (they
        proved the token in their handshake) and wait for their acks; the
        reason the load cannot be trusted, or None. Inside the producer's
        rendezvous promise the notices go without waiting (module docstring)."""
        spec = st.spec
        client: Optional[DoneAckClient] = getattr(self._tls, "ack_client", None)
        if client is None:
            client = self._tls.ack_client = DoneAckClient(self._ctx, stats=self.stats_,
                                                          auth_token=self.config.auth_token)
            with self._lock:
                self._ack_clients.append(client)
        targets = {r: (spec.remote_host, producer_port(spec, r)) for r in sorted(st.read_ranks)}
        msg = DoneReading(transfer_id=spec.transfer_id, engine_id=self.engine_id, tp_rank=self.tp_rank,
                          tp_size=self.tp_size, ok=True, want_ack=True, block_offset=spec.remote_block_offset,
                          num_blocks=len(spec.remote_block_ids), blocks_digest=blocks_digest(spec.remote_block_ids))
        if st.lease_until is not None and time.monotonic() < st.lease_until:
            client.notify(targets, msg)
            self.stats_.add(confirmations_skipped=1)
            return None
        try:
            return client.confirm(targets, msg, self.config.handshake_timeout_s, self._stop, tp_size=spec.remote_tp_size)
        except Exception as exc:  # never lose a load to a bug: fail it clearly
            logger.exception("%s: request %s: confirming transfer %s crashed", self._name, spec.request_id,
                             spec.transfer_id)
            return f"internal error while confirming the read: {exc}"

    # ------------------------------------------------------------------
    def peer_handshakes(self) -> dict[PeerKey, float]:
        """The producer ranks this rank holds a completed handshake with, and when
        (``time.monotonic()``) each completed; at most ``max_producer_peers``."""
        return self._peers.ready_times() if self._peers is not None else {}

    def num_loading(self) -> int:
        with self._lock:
            return len(self._loads) + len(self._waiting)

    def _close_role(self) -> None:
        if self._peers is not None:
            self._peers.close()
        if self._wait_pool is not None:  # its threads see the stop event within a poll
            self._wait_pool.shutdown(wait=True, cancel_futures=True)
        self._close_backend()  # settles every read still in flight
        if self._read_pool is not None:
            self._read_pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            clients, self._ack_clients = self._ack_clients, []
            blocks_clients, self._blocks_clients = self._blocks_clients, []
        for client in clients:  # their threads have ended with the read pool
            client.close()
        for blocks_client in blocks_clients:
            blocks_client.close()
