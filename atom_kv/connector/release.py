"""Telling a producer that nobody will read a transfer: the decode engine's releases
(and the producer engine's own issue notices to its ranks).

:class:`ReleaseSpec` names a transfer and the producer ranks holding it (a
request's parsed params give one: :attr:`~atom_kv.connector.params.RequestParams.release_spec`,
also for params refused for another key). :class:`NoticeSender` owns the thread and
the DEALER sockets that deliver :class:`~atom_kv.wire.Release` (and
:class:`~atom_kv.wire.Issued`) messages to every producer rank of a transfer;
its methods never block.

With an ``auth_token``, notices are signed (``ts``, ``nonce``, ``mac``), and
a producer rank first proves it knows the token
(:class:`~atom_kv.wire.PeerProofRequest`, once per rank, remembered for
``PROVEN_TTL_S``): a host named in a client's ``kv_transfer_params`` that
cannot prove it gets nothing derived from the token.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import zmq

from atom_kv import wire
from atom_kv._lru import BoundedDict
from atom_kv._ratelimit import RateLimitedLog
from atom_kv._waker import Waker
from atom_kv.auth import PURPOSE_ISSUED, PURPOSE_RELEASE, new_nonce, same_mac, sign_struct
from atom_kv.config import MAX_PORT
from atom_kv.connector.confirm import DealerCache
from atom_kv.connector.handshake_auth import peer_proof
from atom_kv.connector.types import LoadSpec
from atom_kv.wire import (
    HANDSHAKE_PROTOCOL_VERSION,
    Issued,
    PeerProof,
    PeerProofRequest,
    Release,
    WireError,
    handshake_port,
)

__all__ = ["MAX_RELEASE_RANKS", "NoticeSender", "ReleaseSpec", "engine_sender"]

logger = logging.getLogger(__name__)

#: most producer ranks one release goes to (a client names ``remote_tp_size``): what
#: ``kv_transfer_params`` may name (:data:`~atom_kv.wire.MAX_PRODUCER_RANKS`)
MAX_RELEASE_RANKS = wire.MAX_PRODUCER_RANKS
#: how long a producer rank that proved the token is trusted without asking again
PROVEN_TTL_S = 600.0
_MAX_TARGETS = 4096        # producer ranks with releases waiting for their proof
_MAX_WAITING = 1024        # releases waiting for one producer rank's proof
_MAX_PROVEN = 4096


@dataclass(frozen=True)
class ReleaseSpec:
    """A transfer and where its producer ranks listen (``handshake_port`` is the base port).

    Never more than :data:`MAX_RELEASE_RANKS` ranks, every port within 1..65535:
    building one that breaks either raises ``ValueError`` (:meth:`bounded`
    answers None instead)."""

    transfer_id: str
    host: str
    handshake_port: int
    tp_size: int = 1
    dp_rank: int = 0
    pp_size: int = 1
    dp_size: int = 1

    def __post_init__(self) -> None:
        why = self._out_of_bounds()
        if why is not None:
            raise ValueError(f"release of transfer {self.transfer_id!r} to {self.host}: {why}")

    def _out_of_bounds(self) -> Optional[str]:
        if self.tp_size < 1 or self.pp_size < 1 or self.dp_rank < 0 or self.dp_size < 1:
            return f"sizes and ranks out of range (tp {self.tp_size}, pp {self.pp_size}, dp rank {self.dp_rank} " \
                   f"of {self.dp_size})"
        if self.tp_size * self.pp_size > MAX_RELEASE_RANKS:
            return f"{self.tp_size * self.pp_size} producer ranks, more than {MAX_RELEASE_RANKS}"
        last = handshake_port(self.handshake_port, self.dp_rank, self.tp_size, self.tp_size - 1,
                              pp_rank=self.pp_size - 1, dp_size=self.dp_size)
        if self.handshake_port < 1 or last > MAX_PORT:
            return f"ports {self.handshake_port}..{last} are not all within 1..{MAX_PORT}"
        return None

    @classmethod
    def bounded(cls, transfer_id: str, host: str, port: int, tp_size: int = 1, dp_rank: int = 0, pp_size: int = 1,
                dp_size: int = 1) -> Optional["ReleaseSpec"]:
        """The spec, or None when it would name more than :data:`MAX_RELEASE_RANKS` ranks or a port past 65535."""
        try:
            return cls(transfer_id, host, port, tp_size, dp_rank, pp_size, max(dp_size, dp_rank + 1))
        except ValueError:
            return None

    def targets(self) -> list[tuple[str, int]]:
        """(host, port) of every producer rank of the DP rank: each TP rank of each pipeline stage."""
        return [(self.host, handshake_port(self.handshake_port, self.dp_rank, self.tp_size, r, pp_rank=s,
                                           dp_size=self.dp_size))
                for s in range(self.pp_size) for r in range(self.tp_size)]

    def first_rank(self) -> "ReleaseSpec":
        """The same release to the first rank only (TP rank 0 of the first stage of the DP rank): where a
        load's first handshake goes, and all a producer no rank of this engine completed a handshake
        with is sent (:mod:`atom_kv.connector.known_producers`)."""
        if self.tp_size == self.pp_size == 1:
            return self
        return ReleaseSpec(self.transfer_id, self.host, handshake_port(self.handshake_port, self.dp_rank,
                                                                       self.tp_size, 0, dp_size=self.dp_size))

    @classmethod
    def from_load(cls, spec: LoadSpec) -> Optional["ReleaseSpec"]:
        """The producer ranks a load reads from (None when out of bounds: its params were checked already)."""
        return cls.bounded(spec.transfer_id, spec.remote_host, spec.remote_handshake_port, spec.remote_tp_size,
                           spec.remote_dp_rank, spec.remote_pp_size, spec.remote_dp_size)


#: a notice and the purpose its signature is made for
_Notice = tuple[Any, str]


@dataclass
class _Waiting:
    """Notices for one producer rank that has not proven the token yet."""

    nonce: str
    deadline: float
    releases: deque = field(default_factory=lambda: deque(maxlen=_MAX_WAITING))


def engine_sender(role: str, engine_id: str) -> str:
    """How an engine names itself in its notices' ``sender`` ("decode engine D1")."""
    return f"{role} engine {engine_id}"


class NoticeSender:
    """Owns the sender thread (``name``), its DEALER sockets (LRU-bounded), the
    producer ranks that proved the token, and the notices waiting for a proof.

    ``sender`` names this engine in the producer's log; ``proof_timeout_s``
    bounds the wait for a producer rank's proof (notices to a rank that does
    not answer in time are dropped, counted and logged at a bounded rate:
    the producer's lease frees the blocks later)."""

    def __init__(self, *, auth_token: Optional[str], sender: str, proof_timeout_s: float,
                 close_wait_s: float = 2.0, name: str = "atom-kv-release", max_sockets: int = 256) -> None:
        self._token = auth_token
        self._sender = sender
        self._proof_timeout_s = proof_timeout_s
        self._close_wait_s = close_wait_s
        self._max_sockets = max_sockets
        self._name = name
        self._queue: "queue.SimpleQueue[tuple[list[tuple[str, int]], _Notice]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._waker: Optional[Waker] = None
        self.warnings = RateLimitedLog(logger, "undelivered notices")
        self.counts = {"sent": 0, "dropped": 0, "unproven": 0}

    def release(self, spec: ReleaseSpec, reason: str) -> None:
        """Queue a release of ``spec.transfer_id`` to every producer rank (from any thread)."""
        msg = Release(transfer_id=spec.transfer_id, reason=reason, sender=self._sender)
        self._put(spec.targets(), (msg, PURPOSE_RELEASE))

    def issue(self, spec: ReleaseSpec, block_ids: list[int]) -> None:
        """Queue an :class:`~atom_kv.wire.Issued` notice to every rank of ``spec`` (a producer's own)."""
        if len(block_ids) > wire.MAX_ISSUED_BLOCKS:  # over the handshake port's message bound: never sent
            self.warnings.event("issued_blocks", f"transfer {spec.transfer_id}: {len(block_ids)} blocks are more "
                                f"than an issue notice names ({wire.MAX_ISSUED_BLOCKS}); its ranks learn it from the "
                                "engine's metadata only")
            return
        msg = Issued(transfer_id=spec.transfer_id, block_ids=list(block_ids))
        self._put(spec.targets(), (msg, PURPOSE_ISSUED))

    def _put(self, targets: list[tuple[str, int]], notice: _Notice) -> None:
        with self._lock:
            if self._closed:
                return
            if self._thread is None:
                self._start_locked()
            self._queue.put((targets, notice))
        self._wake()

    def _start_locked(self) -> None:
        self._waker = Waker()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        if self._waker is not None:
            self._waker.wake()

    def close(self) -> None:
        """Send what is queued, stop. Notices to a producer rank not yet proven
        wait for its proof, at most ``close_wait_s`` more (a release queued
        just before an engine closes still frees the producer's blocks at
        once); what is unproven then is dropped and left to the lease."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        self._wake()
        if thread is not threading.current_thread():
            thread.join(timeout=min(self._proof_timeout_s, self._close_wait_s) + 5)
        if self._waker is not None:
            self._waker.close()

    # -- the sender thread ---------------------------------------------------
    def _run(self) -> None:
        ctx = zmq.Context()
        socks = DealerCache(ctx, self._max_sockets, {zmq.SNDHWM: 1024, zmq.MAXMSGSIZE: 1 << 16, zmq.RCVHWM: 64})
        proven: BoundedDict[tuple[str, int], float] = BoundedDict(_MAX_PROVEN)
        waiting: BoundedDict[tuple[str, int], _Waiting] = BoundedDict(_MAX_TARGETS, on_evict=self._evicted)
        try:
            cut = False
            while True:
                closing = self._closed
                self._take_queue(socks, proven, waiting)
                if closing and not waiting:
                    break
                if closing and not cut:  # the proofs still awaited get close_wait_s at most
                    cut, last = True, time.monotonic() + self._close_wait_s
                    for w in waiting.values():
                        w.deadline = min(w.deadline, last)
                self._poll(socks, proven, waiting)
        except Exception:
            logger.exception("%s: release sender crashed; releases fall back to the producers' leases", self._name)
        finally:
            for target, w in waiting.items():
                self._drop(target, len(w.releases), "the engine is shutting down")
            socks.close(linger_ms=500)  # let queued releases go out, briefly
            ctx.term()

    def _take_queue(self, socks: DealerCache, proven: BoundedDict, waiting: BoundedDict) -> None:
        now = time.monotonic()
        while True:
            try:
                targets, notice = self._queue.get_nowait()
            except queue.Empty:
                return
            for target in targets:
                if self._token is None or proven.get(target, 0.0) > now:
                    self._send(socks, target, notice)
                    continue
                w = waiting.get(target)
                if w is None:
                    w = waiting[target] = _Waiting(new_nonce(), now + self._proof_timeout_s)
                    self._ask_proof(socks, target, w)
                if len(w.releases) == w.releases.maxlen:
                    self._drop(target, 1, "too many notices wait for its proof")
                w.releases.append(notice)

    def _ask_proof(self, socks: DealerCache, target: tuple[str, int], w: _Waiting) -> None:
        try:
            socks.get(*target).send(wire.encode(PeerProofRequest(nonce=w.nonce)), zmq.NOBLOCK)
        except (zmq.ZMQError, ValueError) as exc:
            w.deadline = 0.0  # given up on the next pass
            self.warnings.event("send", f"cannot ask {target[0]}:{target[1]} to prove the auth token: {exc}")

    def _send(self, socks: DealerCache, target: tuple[str, int], notice: _Notice) -> None:
        msg, purpose = notice
        if self._token is not None:
            msg = sign_struct(self._token, purpose, msg)
        try:
            socks.get(*target).send(wire.encode(msg), zmq.NOBLOCK)
        except (zmq.ZMQError, ValueError) as exc:
            self._drop(target, 1, str(exc))
            return
        self.counts["sent"] += 1
        logger.debug("%s: sent %s of transfer %s to %s:%d", self._name, type(msg).__name__, msg.transfer_id, *target)

    def _poll(self, socks: DealerCache, proven: BoundedDict, waiting: BoundedDict) -> None:
        poller = zmq.Poller()
        waker = self._waker  # made before the thread started
        if waker is not None:
            poller.register(waker.fileno(), zmq.POLLIN)
        by_sock = {}
        for target in waiting:
            sock = socks.get(*target)
            by_sock[sock] = target
            poller.register(sock, zmq.POLLIN)
        now = time.monotonic()
        timeout = min([w.deadline for w in waiting.values()], default=now + 1.0) - now
        events = dict(poller.poll(int(max(0.0, min(timeout, 1.0)) * 1000)))
        if waker is not None and waker.fileno() in events:
            waker.drain()
        for sock, target in by_sock.items():
            if sock in events:
                self._on_answer(sock, target, socks, proven, waiting)
        now = time.monotonic()
        for target in [t for t, w in waiting.items() if w.deadline <= now]:
            w = waiting.pop(target)
            socks.drop(*target)  # no late answer lingers in a reused socket
            self.counts["unproven"] += 1
            self._drop(target, len(w.releases), f"it did not prove the auth token within {self._proof_timeout_s:g} s")

    def _on_answer(self, sock: zmq.Socket, target: tuple[str, int], socks: DealerCache, proven: BoundedDict,
                   waiting: BoundedDict) -> None:
        try:
            data = sock.recv(zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        w = waiting.get(target)
        if w is None:
            return
        try:
            answer = wire.decode(data, PeerProof)
        except (WireError, RecursionError):
            v = wire.peek_version(data)
            if v is not None and v != HANDSHAKE_PROTOCOL_VERSION:
                why = f"it speaks handshake protocol version {v}, this engine {HANDSHAKE_PROTOCOL_VERSION}"
            else:
                why = "its answer to the proof request is garbage"
            del waiting[target]
            self._drop(target, len(w.releases), why)
            return
        assert self._token is not None
        expected = peer_proof(self._token, w.nonce, answer.engine_id, answer.tp_rank)
        del waiting[target]
        if answer.v != HANDSHAKE_PROTOCOL_VERSION or not same_mac(expected, answer.proof):
            self.counts["unproven"] += 1
            self._drop(target, len(w.releases), "it did not prove the auth token (different auth_token, or none)")
            return
        proven[target] = time.monotonic() + PROVEN_TTL_S
        for notice in w.releases:
            self._send(socks, target, notice)

    def _evicted(self, target: tuple[str, int], w: _Waiting) -> None:
        self._drop(target, len(w.releases), "too many producer ranks wait for a proof")

    def _drop(self, target: tuple[str, int], n: int, why: str) -> None:
        if n <= 0:
            return
        self.counts["dropped"] += n
        self.warnings.event("dropped", f"{self._name}: {n} notice(s) not sent to {target[0]}:{target[1]}: {why} "
                                       "(its lease frees the blocks)")
