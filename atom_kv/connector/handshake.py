"""The handshake side channel: a producer rank's ROUTER server, the
consumer's one-shot handshake request, and the done-reading notifier.

The server answers :class:`~atom_kv.wire.HandshakeRequest` with a
:class:`~atom_kv.wire.HandshakeReply` (backend descriptor, region list,
compat info) and hands :class:`~atom_kv.wire.DoneReading` to a callback;
when the callback returns a :class:`~atom_kv.wire.DoneAck` (the consumer asked
for one with ``want_ack``), it goes back to the sender on the same identity.
Anything else on the port is logged, counted and dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional

import zmq

from atom_kv import wire
from atom_kv._lru import BoundedDict
from atom_kv.connector.stats import TransferStats
from atom_kv.wire import CompatInfo, DoneAck, DoneReading, HandshakeReply, HandshakeRequest, WireError

__all__ = [
    "HandshakeError",
    "HandshakeRejected",
    "HandshakeServer",
    "DoneNotifier",
    "DoneAckClient",
    "compat_mismatch",
    "request_handshake",
    "MAX_MESSAGE_BYTES",
]

logger = logging.getLogger(__name__)

#: Largest frame the handshake port accepts; bigger ones drop the connection.
MAX_MESSAGE_BYTES = 1 << 20
_POLL_MS = 200
_CLOSE_LINGER_MS = 500


class HandshakeError(RuntimeError):
    """A handshake did not complete (timeout, bad reply); worth retrying."""


class HandshakeRejected(HandshakeError):
    """The peer answered and refused (auth, compat); retrying won't help."""


def compat_mismatch(here: CompatInfo, peer: CompatInfo, here_is: str = "here", peer_is: str = "peer") -> Optional[str]:
    """``"KV layout mismatch: block_size 16 (here) vs 32 (peer)"`` or None when compatible.

    ``here_is``/``peer_is`` name the sides in the message (a refusal sent to the
    other engine says ``prefill``/``decode``, so it reads right in either log).
    """
    diffs = [
        f"{name} {getattr(here, name)!r} ({here_is}) vs {getattr(peer, name)!r} ({peer_is})"
        for name in here.__struct_fields__
        if getattr(here, name) != getattr(peer, name)
    ]
    return "KV layout mismatch: " + "; ".join(diffs) if diffs else None


def handshake_port(base: int, dp_rank: int, tp_size: int, tp_rank: int) -> int:
    """Rank ``tp_rank`` of data-parallel group ``dp_rank`` listens on ``base + dp_rank*tp_size + tp_rank``."""
    return base + dp_rank * tp_size + tp_rank


class HandshakeServer:
    """Owns a producer rank's ROUTER socket and the thread that serves it."""

    def __init__(
        self,
        ctx: zmq.Context,
        *,
        bind_host: str,
        port: int,
        auth_token: Optional[str],
        responder: Callable[[HandshakeRequest], HandshakeReply],
        on_done: Callable[[DoneReading], Optional[DoneAck]],
        stats: TransferStats,
        name: str,
    ) -> None:
        self._auth = auth_token
        self._responder = responder
        self._on_done = on_done
        self._stats = stats
        self._stop = threading.Event()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, 1024)
        try:
            self._sock.bind(f"tcp://{bind_host}:{port}")
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise HandshakeError(
                f"cannot listen for handshakes on {bind_host}:{port} "
                f"(handshake_port + dp_rank*tp_size + tp_rank): {exc}"
            ) from None
        self.port = port
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(_POLL_MS):
                    continue
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                except zmq.ZMQError as exc:
                    if self._stop.is_set():
                        break
                    logger.warning("handshake server: receive failed: %s", exc)
                    continue
                try:
                    self._handle(frames)
                except Exception:  # a bug in a handler must not kill the server
                    self._stats.add(bad_messages=1)
                    logger.exception("handshake server: failed to handle a message")
        finally:
            self._sock.close(0)

    def _handle(self, frames: list[bytes]) -> None:
        identity, payloads = frames[0], frames[1:]
        if len(payloads) == 2 and payloads[0] == b"":
            payloads = payloads[1:]  # REQ-style envelope
        if len(payloads) != 1:
            self._bad(f"expected 1 payload frame, got {len(payloads)}")
            return
        try:
            msg = wire.decode(payloads[0], wire.HandshakeMessage)
        except WireError as exc:
            self._bad(str(exc))
            return
        if isinstance(msg, DoneReading):
            if self._auth is not None and msg.auth_token != self._auth:
                self._bad(f"done-reading for transfer {msg.transfer_id} with a wrong auth token")
                return
            if not 0 <= msg.tp_rank < msg.tp_size <= 4096:
                self._bad(f"done-reading for transfer {msg.transfer_id}: rank {msg.tp_rank} of {msg.tp_size}")
                return
            self._stats.add(done_received=1)
            ack = self._on_done(msg)
            if ack is not None:
                try:
                    self._sock.send_multipart([identity, wire.encode(ack)], zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    logger.warning("handshake server: done ack for transfer %s dropped: %s", msg.transfer_id, exc)
            return
        if self._auth is not None and msg.auth_token != self._auth:
            self._stats.add(bad_messages=1)
            logger.warning("handshake from engine %s rank %d rejected: wrong auth token", msg.engine_id, msg.tp_rank)
            reply = HandshakeReply(ok=False, error="handshake rejected: wrong auth_token")
        else:
            reply = self._responder(msg)
        try:
            self._sock.send_multipart([identity, wire.encode(reply)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("handshake server: reply to engine %s dropped: %s", msg.engine_id, exc)

    def _bad(self, why: str) -> None:
        self._stats.add(bad_messages=1)
        logger.warning("handshake port %d: dropped a bad message: %s", self.port, why)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


def request_handshake(
    ctx: zmq.Context,
    host: str,
    port: int,
    request: HandshakeRequest,
    timeout_s: float,
    stop: Optional[threading.Event] = None,
) -> HandshakeReply:
    """Send one handshake and wait (at most ``timeout_s``) for the reply."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 64 * MAX_MESSAGE_BYTES)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(wire.encode(request), zmq.NOBLOCK)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (stop is not None and stop.is_set()):
                raise HandshakeError(f"no handshake reply from {host}:{port} within {timeout_s:g} s")
            if sock.poll(min(left, 0.25) * 1000, zmq.POLLIN):
                frames = sock.recv_multipart()
                try:
                    return wire.decode(frames[-1], wire.HandshakeReply)
                except WireError as exc:
                    raise HandshakeError(f"bad handshake reply from {host}:{port}: {exc}") from None
    except zmq.ZMQError as exc:
        raise HandshakeError(f"handshake with {host}:{port} failed: {exc}") from None
    finally:
        sock.close(0)


class DealerCache:
    """Owns connected DEALER sockets keyed by (host, port), least recently used
    first out past ``max_sockets``. Single-threaded, like the sockets."""

    def __init__(self, ctx: zmq.Context, max_sockets: int, options: dict[int, int]) -> None:
        self._ctx = ctx
        self._options = options
        self._socks: BoundedDict[tuple[str, int], zmq.Socket] = BoundedDict(
            max_sockets, on_evict=lambda _key, sock: sock.close(0)
        )

    def get(self, host: str, port: int) -> zmq.Socket:
        key = (host, port)
        sock = self._socks.get(key)
        if sock is not None:
            self._socks.touch(key)
            return sock
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        for option, value in self._options.items():
            sock.setsockopt(option, value)
        sock.connect(f"tcp://{host}:{port}")
        self._socks[key] = sock
        return sock

    def drop(self, host: str, port: int) -> None:
        sock = self._socks.pop((host, port), None)
        if sock is not None:
            sock.close(0)

    def close(self, linger_ms: int = 0) -> None:
        for sock in self._socks.values():
            sock.close(linger=linger_ms)
        self._socks.clear()


class DoneNotifier:
    """Owns the DEALER sockets that carry done-reading notices to producer
    ranks, and the one thread that uses them (sockets are single-threaded)."""

    def __init__(self, ctx: zmq.Context, *, name: str, stats: TransferStats, max_sockets: int = 256) -> None:
        self._stats = stats
        self._queue: "queue.Queue[Optional[tuple[str, int, bytes]]]" = queue.Queue()
        self._socks = DealerCache(ctx, max_sockets, {zmq.SNDHWM: 4096, zmq.SNDTIMEO: 0})
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def send(self, host: str, port: int, msg: DoneReading) -> None:
        if not self._closed:
            self._queue.put((host, port, wire.encode(msg)))

    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=1.0)
                except queue.Empty:
                    if self._closed:
                        break
                    continue
                if item is None:
                    break
                host, port, data = item
                try:
                    self._socks.get(host, port).send(data, zmq.NOBLOCK)
                    self._stats.add(done_sent=1)
                except zmq.ZMQError as exc:
                    logger.warning("done-reading notice to %s:%d dropped: %s", host, port, exc)
        finally:
            self._socks.close(linger_ms=_CLOSE_LINGER_MS)  # let queued notices go out, briefly

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


class DoneAckClient:
    """Owns one thread's DEALER sockets (one per producer rank, LRU-bounded)
    for done-reading confirmations. Only the thread that uses it may call it."""

    def __init__(self, ctx: zmq.Context, *, stats: TransferStats, max_sockets: int = 64) -> None:
        self._stats = stats
        self._socks = DealerCache(ctx, max_sockets, {zmq.MAXMSGSIZE: MAX_MESSAGE_BYTES, zmq.SNDHWM: 1024})

    def _socket(self, host: str, port: int) -> zmq.Socket:
        return self._socks.get(host, port)

    def _drop(self, host: str, port: int) -> None:
        self._socks.drop(host, port)

    def confirm(
        self,
        targets: dict[int, tuple[str, int]],
        msg: DoneReading,
        timeout_s: float,
        stop: threading.Event,
    ) -> Optional[str]:
        """Send ``msg`` (``want_ack=True``) to every producer rank in ``targets``
        (rank -> host, port) and wait up to ``timeout_s`` for each one's
        :class:`DoneAck`. Returns None when every rank confirmed the read as
        valid, else the reason the read cannot be trusted."""
        data = wire.encode(msg)
        waiting: dict[zmq.Socket, tuple[int, str, int]] = {}
        poller = zmq.Poller()
        for rank, (host, port) in targets.items():
            try:
                sock = self._socket(host, port)
                sock.send(data, zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                self._drop(host, port)
                return f"cannot ask producer rank {rank} at {host}:{port} to confirm the read: {exc}"
            self._stats.add(done_sent=1)
            waiting[sock] = (rank, host, port)
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                rank, host, port = next(iter(waiting.values()))
                for _, h, p in list(waiting.values()):
                    self._drop(h, p)  # a late ack must not linger in a reused socket
                return f"no confirmation from producer rank {rank} at {host}:{port} within {timeout_s:g} s"
            if stop.is_set():
                return "connector closing"
            for sock, _ in poller.poll(min(left, 0.25) * 1000):
                rank, host, port = waiting[sock]
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                except zmq.ZMQError as exc:
                    self._drop(host, port)
                    return f"no confirmation from producer rank {rank} at {host}:{port}: {exc}"
                try:
                    ack = wire.decode(frames[-1], wire.DoneAck)
                except WireError as exc:
                    self._stats.add(bad_messages=1)
                    logger.warning("done ack from %s:%d for transfer %s: %s", host, port, msg.transfer_id, exc)
                    self._drop(host, port)
                    return f"bad confirmation from producer rank {rank} at {host}:{port}: {exc}"
                if ack.transfer_id != msg.transfer_id or ack.tp_rank != rank:
                    logger.debug("ignoring a stale done ack for transfer %s from %s:%d", ack.transfer_id, host, port)
                    continue
                if not ack.valid:
                    return ack.reason or f"producer rank {rank} at {host}:{port} no longer holds transfer {ack.transfer_id}"
                poller.unregister(sock)
                del waiting[sock]
        return None

    def close(self) -> None:
        self._socks.close()
