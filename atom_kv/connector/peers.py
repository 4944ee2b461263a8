"""A consumer rank's producer peers.

One handshake per peer (remote engine id, host, handshake port) runs on a
small named pool and its result is cached; consecutive failures are counted,
and a peer that reaches ``peer_failure_threshold`` is dropped (from the
backend too), so its next use handshakes again. A failed handshake is never
cached. A peer that cannot be connected to within ``connect_timeout_s`` (its
handshake port, or the backend's data port when the backend connects while
adding the peer) fails its handshake with :class:`HandshakeUnreachable`.

A producer's ports come from a request's ``kv_transfer_params``, which any
client of the engine may write. Until one handshake with a producer (engine
id, host, base port, DP rank, TP size, stages) succeeded, only one of its
ranks is contacted: the first a load reads from. Its reply says which TP
rank, stage and DP rank it is, and is refused unless that is what the params
placed on its port; the load's other ranks handshake only once it was
accepted, and never when it failed. So a host a client named gets one
bounded handshake attempt per load, never one on every port of a range.

Peer state is bounded and dropped when the peer leaves. A table holds at most
``max_peers`` peers (:data:`MAX_PEERS` by default); adding one past that
evicts the least recently used (from the backend too: its connections and
reader threads go), and its next use handshakes again. A read still running
on an evicted peer fails and is retried on a fresh handshake. A handshake
that finds another engine at a cached peer's address (the producer restarted
or re-registered under a new id) drops the peer cached for the old id.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import msgspec
import zmq

from atom_kv._lru import BoundedDict, BoundedSet
from atom_kv.config import KVTransferConfig
from atom_kv.connector.handshake import (
    HandshakeError, HandshakeRejected, HandshakeUnreachable, compat_mismatch, handshake_port, request_handshake,
)
from atom_kv.connector.kv_caches import peer_layouts
from atom_kv.connector.layout import HeadOverlap, ReadPlanner, TensorLayout
from atom_kv.connector.routes_view import RouteView, backend_for_peer
from atom_kv.connector.stats import TransferStats
from atom_kv.connector.types import LoadSpec
from atom_kv.transfer import PeerUnreachable, TransferBackend
from atom_kv.transfer.memory import pair_refusal
from atom_kv.wire import HandshakeRequest

__all__ = ["MAX_PEERS", "Peer", "PeerKey", "PeerTable", "ProducerKey", "producer_key", "producer_port"]

logger = logging.getLogger(__name__)

#: (remote engine id, host, handshake port of one producer rank)
PeerKey = tuple[str, str, int]
#: a producer as a load names it: (remote engine id, host, base handshake port, DP rank, TP size, stages, DP size)
ProducerKey = tuple[str, str, int, int, int, int, int]
#: producers a rank remembers having completed a handshake with (least recently used forgotten first)
MAX_KNOWN_PRODUCERS = 4096
#: producer ranks one consumer rank keeps a handshake with (least recently used evicted past it)
MAX_PEERS = 256
#: handshakes one consumer rank runs at once (more wait for a thread): a fan-in of many producers
#: contacted in one step waits for round trips, not for CPU
HANDSHAKE_THREADS = 8


def producer_key(spec: LoadSpec) -> ProducerKey:
    """The producer whose ranks ``spec`` reads from."""
    return (spec.remote_engine_id, spec.remote_host, spec.remote_handshake_port, spec.remote_dp_rank,
            spec.remote_tp_size, spec.remote_pp_size, spec.remote_dp_size)


def producer_port(spec: LoadSpec, rank: int) -> int:
    """The handshake port of producer rank ``rank`` of the engine ``spec`` reads from:
    ``rank`` is ``pp_rank*tp_size + tp_rank`` (just the TP rank without pipeline stages)."""
    stage, tp_rank = divmod(rank, spec.remote_tp_size)
    return handshake_port(spec.remote_handshake_port, spec.remote_dp_rank, spec.remote_tp_size, tp_rank,
                          pp_rank=stage, dp_size=spec.remote_dp_size)


@dataclass
class Peer:
    """A producer rank this consumer rank completed a handshake with."""

    key: PeerKey
    peer_id: str  # the transfer backend's id for it
    tp_rank: int
    tensors: list[TensorLayout]
    ready_at: float = 0.0  # time.monotonic() when its handshake completed
    planners: dict[HeadOverlap, ReadPlanner] = field(default_factory=dict)

    def planner(self, local: list[TensorLayout], overlap: HeadOverlap, *, local_heads: int,
                remote_heads: int) -> ReadPlanner:
        """The read planner from this peer's tensors into ``local`` for ``overlap`` (built once)."""
        planner = self.planners.get(overlap)
        if planner is None:
            planner = ReadPlanner(local, self.tensors, overlap, local_heads=local_heads, remote_heads=remote_heads)
            self.planners[overlap] = planner
        return planner


class PeerTable:
    """Owns a consumer rank's handshake pool (``handshake_threads``), at most ``max_peers`` cached
    handshakes (one per peer, least recently used evicted), and the
    consecutive-failure count that decides when a peer is dropped."""

    def __init__(
        self,
        ctx: zmq.Context,
        backend: TransferBackend,
        config: KVTransferConfig,
        request: HandshakeRequest,
        *,
        stats: TransferStats,
        stop: threading.Event,
        name: str,
        thread_prefix: str,
        routes: Optional[RouteView] = None,
        max_peers: int = MAX_PEERS,
        handshake_threads: int = HANDSHAKE_THREADS,
    ) -> None:
        if max_peers < 1:
            raise ValueError(f"max_peers must be >= 1, got {max_peers}")
        self._ctx = ctx
        self._routes = routes if routes is not None else RouteView()
        self._backend = backend
        self._config = config
        self._request = request
        self._stats = stats
        self._stop = stop
        self._name = name
        self._lock = threading.Lock()
        self._evicted: list[tuple[PeerKey, cf.Future]] = []  # evicted under the lock, dropped after it
        self._peers: BoundedDict[PeerKey, cf.Future] = BoundedDict(
            max_peers, on_evict=lambda key, fut: self._evicted.append((key, fut)))
        self._failures: dict[PeerKey, int] = {}
        self._known: BoundedSet[ProducerKey] = BoundedSet(MAX_KNOWN_PRODUCERS)  # a handshake with it succeeded
        self._pool = cf.ThreadPoolExecutor(handshake_threads, thread_name_prefix=thread_prefix)

    def rename(self, engine_id: str, name: str) -> None:
        """Handshake as ``engine_id`` from now on (see ``ConnectorWorker.set_engine_id``)."""
        with self._lock:
            self._request = msgspec.structs.replace(self._request, engine_id=engine_id)
            self._name = name

    def set_memory(self, memory: list[str]) -> None:
        """Tell producers the memory kinds of this rank's KV cache from now on."""
        with self._lock:
            self._request = msgspec.structs.replace(self._request, memory=list(memory))

    def get(self, spec: LoadSpec, remote_rank: int, first_rank: Optional[int] = None) -> tuple[PeerKey, cf.Future]:
        """The peer's key and its (maybe still running) handshake; starts one if none is cached.

        ``first_rank``: the rank the load reads from first (``remote_rank`` when None).
        Until a handshake with the producer succeeded, another rank's handshake starts only
        once ``first_rank``'s succeeded, and fails when it failed (module docstring)."""
        with self._lock:
            got = self._get_locked(spec, remote_rank, remote_rank if first_rank is None else first_rank)
            evicted, self._evicted = self._evicted, []
        for key, fut in evicted:
            self._drop(key, fut, f"evicted: this rank holds its {self._peers.capacity} most recently used peers")
        return got

    def __len__(self) -> int:
        """Peers held now (handshakes done or running)."""
        with self._lock:
            return len(self._peers)

    def ready_times(self) -> dict[PeerKey, float]:
        """When each peer held now completed its handshake (``time.monotonic()``)."""
        with self._lock:
            futs = list(self._peers.items())
        return {key: fut.result().ready_at for key, fut in futs if fut.done() and not _failed(fut)}

    def _get_locked(self, spec: LoadSpec, rank: int, first_rank: int) -> tuple[PeerKey, cf.Future]:
        key = (spec.remote_engine_id, spec.remote_host, producer_port(spec, rank))
        fut = self._peers.get(key)
        if fut is not None and not _failed(fut):
            self._peers.touch(key)
            return key, fut
        producer = producer_key(spec)
        run = partial(self._handshake, key, producer, rank, spec.remote_tp_size, spec.remote_dp_rank,
                      spec.remote_pp_size)
        if rank == first_rank or producer in self._known:
            fut = self._pool.submit(run)
        else:
            first_key, first = self._get_locked(spec, first_rank, first_rank)
            fut = cf.Future()
            first.add_done_callback(partial(self._after_first, fut, run, first_key))
        self._peers[key] = fut
        return key, fut

    def _after_first(self, fut: cf.Future, run, first_key: PeerKey, first: cf.Future) -> None:
        """``first`` (the producer's first rank's handshake) ended: start ``run`` into ``fut``, or fail it.
        Runs on the thread that ended ``first`` (or the caller's, with the table's lock held): it
        takes no lock."""
        _, host, port = first_key
        if first.cancelled():
            fut.cancel()
            return
        exc = first.exception()
        if exc is not None:
            why = f"not contacted: the producer's first rank at {host}:{port} did not complete its handshake ({exc})"
            fut.set_exception(HandshakeRejected(why) if isinstance(exc, HandshakeRejected) else HandshakeError(why))
            return
        try:
            inner = self._pool.submit(run)
        except RuntimeError:  # the table closed meanwhile
            fut.cancel()
            return
        inner.add_done_callback(partial(_settle, fut))

    def knows(self, producer: ProducerKey) -> bool:
        """Whether a handshake with a rank of ``producer`` succeeded (recently: the set is bounded)."""
        with self._lock:
            return producer in self._known

    def succeeded(self, key: PeerKey) -> None:
        """A read from the peer worked: its failure count starts over."""
        with self._lock:
            self._failures.pop(key, None)

    def failed(self, key: PeerKey, fut: cf.Future, peer: Optional[Peer]) -> None:
        """Count a consecutive failure; past the threshold, forget the peer so the next use re-handshakes."""
        with self._lock:
            if self._peers.get(key) is not fut:
                return  # a failure on a peer already replaced: says nothing about the new one
            n = self._failures.get(key, 0) + 1
            self._failures[key] = n
            if n < self._config.peer_failure_threshold:
                if peer is None and fut.done():
                    del self._peers[key]  # a failed handshake is never cached
                return
            self._failures.pop(key, None)
            if not fut.done():
                return  # the handshake is still running; its own timeout ends it
            del self._peers[key]
        self._routes.forget(key)
        self._stats.add(peers_dropped=1)
        logger.warning("%s: peer %s at %s:%d declared failed after %d consecutive failures; will re-handshake",
                       self._name, key[0], key[1], key[2], n)
        if peer is not None:
            try:
                self._backend.remove_peer(peer.peer_id)
            except Exception as exc:
                logger.warning("%s: removing peer %s failed: %s", self._name, peer.peer_id, exc)

    def _drop(self, key: PeerKey, fut: cf.Future, why: str) -> None:
        """Forget ``key`` (already out of the table) and its backend peer, once its handshake ends."""
        with self._lock:
            self._failures.pop(key, None)
        self._routes.forget(key)
        self._stats.add(peers_evicted=1)
        logger.info("%s: peer %s at %s:%d %s", self._name, key[0], key[1], key[2], why)
        fut.add_done_callback(self._remove_from_backend)  # at once when done, else when its handshake ends

    def _remove_from_backend(self, fut: cf.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return  # no backend peer was added
        peer = fut.result()
        try:
            self._backend.remove_peer(peer.peer_id)
        except Exception as exc:
            logger.warning("%s: removing peer %s failed: %s", self._name, peer.peer_id, exc)

    def _replaced(self, key: PeerKey, engine_id: str) -> None:
        """Engine ``engine_id`` answered at ``key``'s address: peers cached there for other ids are gone."""
        _, host, port = key
        with self._lock:
            stale = [(k, f) for k, f in self._peers.items()
                     if k[1] == host and k[2] == port and k[0] not in (key[0], engine_id)]
            for k, _ in stale:
                del self._peers[k]
        for k, f in stale:
            self._drop(k, f, f"dropped: engine {engine_id or key[0]} answers at its address now")

    def close(self) -> None:
        """Stop the pool; running handshakes end with the connector's stop event."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _handshake(self, key: PeerKey, producer: ProducerKey, remote_rank: int, remote_tp: int, remote_dp: int = 0,
                   remote_pp: int = 1) -> Peer:
        _, host, port = key
        t0 = time.perf_counter()
        try:
            reply = request_handshake(self._ctx, host, port, self._request, self._config.handshake_timeout_s,
                                      self._stop, auth_token=self._config.auth_token,
                                      connect_timeout_s=self._config.connect_timeout_s)
            if not reply.ok:
                raise HandshakeRejected(f"handshake with {host}:{port} refused: {reply.error}")
            if reply.compat is not None and (err := compat_mismatch(self._request.compat, reply.compat, "decode", "prefill")):
                raise HandshakeRejected(f"handshake with {host}:{port}: {err}")
            if err := pair_refusal(self._backend.name, self._backend.memory_kinds, reply.memory, "prefill engine"):
                raise HandshakeRejected(f"handshake with {host}:{port}: {err}")
            if key[0] and reply.engine_id and reply.engine_id != key[0]:
                # a restarted producer: the KV this transfer names is gone
                raise HandshakeRejected(
                    f"{host}:{port} is now engine {reply.engine_id}, not {key[0]} that prefilled this "
                    "request (the prefill engine restarted; its KV is gone)"
                )
            stage, tp_rank = divmod(remote_rank, remote_tp)
            if reply.tp_size != remote_tp or reply.tp_rank != tp_rank:
                raise HandshakeRejected(
                    f"{host}:{port} is TP rank {reply.tp_rank} of {reply.tp_size}, "
                    f"expected rank {tp_rank} of {remote_tp}"
                )
            if reply.pp_rank != stage or reply.pp_size != remote_pp:
                raise HandshakeRejected(f"{host}:{port} is pipeline stage {reply.pp_rank} of {reply.pp_size}, "
                                        f"expected stage {stage} of {remote_pp}")
            if reply.dp_rank != remote_dp:
                raise HandshakeRejected(f"{host}:{port} is DP rank {reply.dp_rank}, expected DP rank {remote_dp} "
                                        "(the rank that prefilled this request)")
            try:
                peer_id = self._backend.add_peer(reply.descriptor)
            except PeerUnreachable as exc:  # the data port is closed where the handshake port is open
                raise HandshakeUnreachable(f"handshake with {host}:{port}: {exc}") from None
        except HandshakeError:
            self._stats.add(handshake_failures=1)
            raise
        except Exception as exc:
            self._stats.add(handshake_failures=1)
            raise HandshakeError(f"handshake with {host}:{port} failed: {exc}") from None
        elapsed = time.perf_counter() - t0
        with self._lock:
            self._known.add(producer)  # it answered as the rank its port places: its other ranks may be contacted
        self._replaced(key, reply.engine_id)
        self._stats.add(handshakes=1, handshake_seconds=elapsed)
        self._routes.record(key, peer=reply.engine_id or key[0], peer_dp_rank=reply.dp_rank, peer_rank=remote_rank,
                            memory=reply.memory, backend=backend_for_peer(self._backend, peer_id))
        logger.info("%s: handshake with engine %s rank %d at %s:%d took %.1f ms",
                    self._name, reply.engine_id, reply.tp_rank, host, port, elapsed * 1e3)
        return Peer(key, peer_id, reply.tp_rank, peer_layouts(reply.regions), ready_at=time.monotonic())


def _failed(fut: cf.Future) -> bool:
    """Whether a handshake ended without a peer (failed, or cancelled when the table closed)."""
    return fut.done() and (fut.cancelled() or fut.exception() is not None)


def _settle(fut: cf.Future, inner: cf.Future) -> None:
    """Give ``fut`` the outcome of ``inner``."""
    if inner.cancelled():
        fut.cancel()
    elif inner.exception() is not None:
        fut.set_exception(inner.exception())
    else:
        fut.set_result(inner.result())
