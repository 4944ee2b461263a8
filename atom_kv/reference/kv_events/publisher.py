"""One DP rank's KV event publisher, on vLLM's wire.

Each message is three frames ``[topic, seq, payload]``: ``seq`` 8 bytes
big-endian, counting from 0 in each publisher (a restarted engine starts at 0
again, its first batch ``AllBlocksCleared``), ``payload`` one msgpack
:class:`~atom_kv.reference.kv_events.events.KVEventBatch`. Replay, on the
ROUTER at ``replay_endpoint``: a DEALER (or REQ) sends an empty delimiter and
the start seq (8 bytes big-endian); every buffered batch with seq >= start
comes back as ``[b"", seq, payload]``, then the end marker ``[b"", -1, b""]``.
The buffer holds the last ``buffer_steps`` batches.

The engine step hands each step's events to :meth:`KVEventPublisher.publish`,
which only queues them: encoding, sending and replay happen on the sender
thread. The queue holds ``max_queue_size`` batches; when it is full a batch
is dropped and counted, never waited for (events are advisory). A dropped
batch keeps its seq, so a subscriber sees the gap, and a replay cannot fill
it: the subscriber knows to distrust what it holds for this engine.

A replay request is bounded before anything is done for it: 64 bytes a
frame, 64 requests queued per peer, 16 served per pass; a peer whose queue
is full (or that left) gets the rest of its replay cut, counted.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Optional

import msgspec
import zmq

from atom_kv._ratelimit import RateLimitedLog
from atom_kv.config import ConfigError
from atom_kv.reference.kv_events.config import KVEventsConfig, ZmqEndpoint, endpoints
from atom_kv.reference.kv_events.events import AllBlocksCleared, KVEvent, KVEventBatch

__all__ = ["END_SEQ", "KVEventPublisher", "PublisherStats"]

log = logging.getLogger(__name__)

#: the replay's end marker (seq -1, signed)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_MAX_REQUEST_FRAME = 64    # bytes of one frame of a replay request (the seq is 8)
_REQUESTS_QUEUED = 64      # replay requests queued per peer
_REPLAYS_PER_PASS = 16     # replay requests served before the sender looks at its queue again


@dataclass
class PublisherStats:
    """What one publisher did (read by ``/metrics``; written by the engine step and the sender thread)."""

    batches_queued: int = 0
    batches_published: int = 0
    events_published: int = 0
    batches_dropped: int = 0   # the queue was full
    events_dropped: int = 0
    replay_requests: int = 0
    replayed_batches: int = 0
    bad_replay_requests: int = 0
    replays_cut: int = 0       # the peer's queue was full, or it left


class KVEventPublisher:
    """Owns one DP rank's PUB socket, its replay ROUTER, the bounded queue to the sender
    thread (``atom-kv-kv-events-dp<rank>``) and the replay buffer.

    The sockets are bound on construction (a port in use fails the engine's start in one
    line); :meth:`start` starts the sender, :meth:`close` stops it (idempotent)."""

    def __init__(self, config: KVEventsConfig, *, dp_rank: int = 0, advertise_host: str = "127.0.0.1") -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.stats = PublisherStats()
        self._topic = config.topic.encode("utf-8")
        self._queue: "queue.Queue[tuple[int, KVEventBatch]]" = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: "deque[tuple[int, bytes]]" = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._drops = RateLimitedLog(log, "KV event batches dropped (the sender's queue was full)")
        self._bad = RateLimitedLog(log, "bad KV event replay requests")
        pub_ep, replay_ep = endpoints(config)
        self._ctx = zmq.Context()
        self._pub: Optional[zmq.Socket] = None
        self._replay: Optional[zmq.Socket] = None
        self._waker_r, self._waker_w = socket.socketpair()
        self._waker_r.setblocking(False)
        self._waker_w.setblocking(False)
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self.endpoint = self._bind(self._pub, pub_ep.for_rank(dp_rank), advertise_host)
            self.replay_endpoint: Optional[str] = None
            if replay_ep is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_FRAME)
                self._replay.setsockopt(zmq.RCVHWM, _REQUESTS_QUEUED)
                self._replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 1)  # a whole replay fits
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone peer raises, never drops silently
                self.replay_endpoint = self._bind(self._replay, replay_ep.for_rank(dp_rank), advertise_host)
        except BaseException:
            self._close_sockets()
            raise

    def _bind(self, sock: zmq.Socket, ep: ZmqEndpoint, advertise_host: str) -> str:
        """Bind ``ep``; returns the address subscribers connect to."""
        if ep.is_ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(ep.bind_address)
        except zmq.ZMQError as exc:
            raise ConfigError(f"--kv-events-config: cannot bind `{ep.key}` {ep.bind_address} (DP rank "
                              f"{self.dp_rank}): {exc.strerror}; pick a free port") from None
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return ep.announced(int(bound.rsplit(":", 1)[1]), advertise_host)

    # ------------------------------------------------------------------ engine side (one thread)
    def start(self) -> "KVEventPublisher":
        """Start the sender, and publish ``AllBlocksCleared`` (seq 0): the engine's cache is empty."""
        if self._thread is None and not self._closed:
            self.publish([AllBlocksCleared()])  # queued first: nothing goes out before it
            self._thread = threading.Thread(target=self._run, name=f"atom-kv-kv-events-dp{self.dp_rank}", daemon=True)
            self._thread.start()
            log.info("KV events of DP rank %d on %s%s", self.dp_rank, self.endpoint,
                     f" (replay {self.replay_endpoint})" if self.replay_endpoint else "")
        return self

    def publish(self, events: list[KVEvent]) -> Optional[int]:
        """Queue one step's ``events`` as one batch, without waiting. Returns its seq, or None when
        the queue was full (the batch is dropped and counted; its seq is spent) or the publisher closed."""
        if self._closed or not events:
            return None
        seq = self._next_seq
        self._next_seq += 1
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.dp_rank)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.stats.batches_dropped += 1
            self.stats.events_dropped += len(events)
            self._drops.event("full", f"dropped KV event batch {seq} of DP rank {self.dp_rank} ({len(events)} "
                                      f"events): the sender is {self.config.max_queue_size} batches behind "
                                      "(max_queue_size); subscribers see a gap")
            return None
        self.stats.batches_queued += 1
        self._wake()
        return seq

    def _wake(self) -> None:
        try:
            self._waker_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # bytes are waiting already: the sender wakes anyway

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the sender once it sent what is queued (at most ``timeout_s``); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake()
        if self._thread is None:
            self._close_sockets()
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("KV event sender of DP rank %d still running after %g s; leaving it", self.dp_rank,
                        timeout_s)

    def snapshot(self) -> dict[str, int]:
        return asdict(self.stats)

    # ------------------------------------------------------------------ sender thread
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        try:
            poller = zmq.Poller()
            poller.register(self._waker_r.fileno(), zmq.POLLIN)
            if self._replay is not None:
                poller.register(self._replay, zmq.POLLIN)
            while True:
                ready = dict(poller.poll())  # blocks until a batch is queued, a replay asked, or close()
                self._drain_waker()
                self._send_queued(encoder)
                if self._replay is not None and self._replay in ready:
                    self._serve_replays()
                if self._stop.is_set():
                    self._send_queued(encoder)
                    return
        except Exception:
            log.exception("KV event sender of DP rank %d failed; no more events are published", self.dp_rank)
        finally:
            self._close_sockets()

    def _drain_waker(self) -> None:
        try:
            while self._waker_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _send_queued(self, encoder: msgspec.msgpack.Encoder) -> None:
        assert self._pub is not None
        while True:
            try:
                seq, batch = self._queue.get_nowait()
            except queue.Empty:
                return
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
            except zmq.Again:  # a PUB drops at its high-water mark instead; counted as dropped if it ever says so
                self.stats.batches_dropped += 1
                self.stats.events_dropped += len(batch.events)
            else:
                self.stats.batches_published += 1
                self.stats.events_published += len(batch.events)
            self._buffer.append((seq, payload))

    def _serve_replays(self) -> None:
        assert self._replay is not None
        for _ in range(_REPLAYS_PER_PASS):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                self.stats.bad_replay_requests += 1
                self._bad.event("shape", f"ignored a KV event replay request of {len(frames) - 1} frames "
                                         f"({[len(f) for f in frames[1:]]} bytes); a replay request is an empty "
                                         "delimiter and the 8-byte big-endian start seq, from a DEALER or REQ")
                continue
            self.stats.replay_requests += 1
            self._replay_from(frames[0], int.from_bytes(frames[2], "big"))

    def _replay_from(self, peer: bytes, start: int) -> None:
        assert self._replay is not None
        try:
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart([peer, b"", seq.to_bytes(8, "big"), payload], zmq.NOBLOCK, copy=False)
                    self.stats.replayed_batches += 1
            self._replay.send_multipart([peer, b"", END_SEQ, b""], zmq.NOBLOCK)
        except zmq.ZMQError:  # its queue is full (EAGAIN) or it left (EHOSTUNREACH)
            self.stats.replays_cut += 1

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(0)
        self._pub = self._replay = None
        self._ctx.destroy(linger=0)
        self._waker_r.close()
        self._waker_w.close()
