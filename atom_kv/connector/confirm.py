"""Asking producer ranks to confirm a finished read.

A consumer rank that finished reading a load sends a signed
:class:`~atom_kv.wire.DoneReading` (``want_ack``) to every producer rank it
read from (ranks that proved the token in their handshake) and waits for each
one's :class:`~atom_kv.wire.DoneAck`, which must be signed over that notice's
nonce. :class:`DealerCache` is the LRU of DEALER sockets it (and other
senders) use.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import msgspec
import zmq

from atom_kv import wire
from atom_kv._lru import BoundedDict
from atom_kv.auth import PURPOSE_DONE, sign_struct
from atom_kv.connector.endpoints import connect_socket
from atom_kv.connector.handshake_auth import verify_ack
from atom_kv.connector.stats import TransferStats
from atom_kv.wire import HANDSHAKE_PROTOCOL_VERSION, DoneReading, WireError

__all__ = ["DealerCache", "DoneAckClient"]

logger = logging.getLogger(__name__)

#: Largest confirmation accepted (they are tiny).
MAX_ACK_BYTES = 1 << 20


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
        """The socket connected to ``host:port`` (made now if not cached); raises
        :class:`ValueError` for a host name that does not resolve."""
        key = (host, port)
        sock = self._socks.get(key)
        if sock is not None:
            self._socks.touch(key)
            return sock
        sock = connect_socket(self._ctx, zmq.DEALER, host, port, self._options)
        self._socks[key] = sock
        return sock

    def find(self, sock: zmq.Socket) -> Optional[tuple[str, int]]:
        """The (host, port) of a cached socket."""
        for key, cached in self._socks.items():
            if cached is sock:
                return key
        return None

    def sockets(self) -> list[zmq.Socket]:
        return list(self._socks.values())

    def drop(self, host: str, port: int) -> None:
        sock = self._socks.pop((host, port), None)
        if sock is not None:
            sock.close(0)

    def close(self, linger_ms: int = 0) -> None:
        for sock in self._socks.values():
            sock.close(linger=linger_ms)
        self._socks.clear()


class DoneAckClient:
    """Owns one thread's DEALER sockets (one per producer rank, LRU-bounded)
    for done-reading confirmations. Only the thread that uses it may call it."""

    def __init__(self, ctx: zmq.Context, *, stats: TransferStats, auth_token: Optional[str] = None,
                 max_sockets: int = 64) -> None:
        self._stats = stats
        self._token = auth_token
        # RCVHWM: what a peer (any host a client named) can make this socket queue
        self._socks = DealerCache(ctx, max_sockets, {zmq.MAXMSGSIZE: MAX_ACK_BYTES, zmq.SNDHWM: 1024, zmq.RCVHWM: 64})

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
        tp_size: int = 0,
    ) -> Optional[str]:
        """Send ``msg`` (``want_ack=True``; signed here when there is a token) to
        every producer rank in ``targets`` (rank -> host, port) and wait up to
        ``timeout_s`` for each one's :class:`DoneAck`. Returns None when every
        rank confirmed the read as valid, else the reason the read cannot be trusted.
        With ``tp_size``, a rank is ``pp_rank*tp_size + tp_rank`` (pipeline stages)."""
        if self._token is not None:
            msg = sign_struct(self._token, PURPOSE_DONE, msg)
        data = wire.encode(msg)
        waiting: dict[zmq.Socket, tuple[int, str, int]] = {}
        poller = zmq.Poller()
        for rank, (host, port) in targets.items():
            try:
                sock = self._socket(host, port)
                sock.send(data, zmq.NOBLOCK)
            except (zmq.ZMQError, ValueError) as exc:
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
            for sock, _ in poller.poll(int(min(left, 0.25) * 1000)):
                rank, host, port = waiting[sock]
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                except zmq.ZMQError as exc:
                    self._drop(host, port)
                    return f"no confirmation from producer rank {rank} at {host}:{port}: {exc}"
                verdict = self._judge(frames[-1], msg, rank, host, port, rank % tp_size if tp_size else rank)
                if verdict is None:
                    continue  # a stale ack of an earlier question
                if verdict:
                    return verdict
                poller.unregister(sock)
                del waiting[sock]
        return None

    def notify(self, targets: dict[int, tuple[str, int]], msg: DoneReading) -> int:
        """Send ``msg`` (``want_ack=False``; signed here when there is a token) to every producer
        rank in ``targets`` without waiting for an answer; how many were sent. A notice that cannot
        be sent costs nothing but time: the engine's release, sent at every end of a load, and the
        producer's lease free the blocks all the same."""
        msg = msgspec.structs.replace(msg, want_ack=False)
        if self._token is not None:
            msg = sign_struct(self._token, PURPOSE_DONE, msg)
        data = wire.encode(msg)
        sent = 0
        for rank, (host, port) in targets.items():
            try:
                self._socket(host, port).send(data, zmq.NOBLOCK)
            except (zmq.ZMQError, ValueError) as exc:
                self._drop(host, port)
                logger.debug("done-reading notice for transfer %s to producer rank %d at %s:%d not sent: %s",
                             msg.transfer_id, rank, host, port, exc)
                continue
            self._stats.add(done_sent=1)
            sent += 1
        return sent

    def _judge(self, data: bytes, msg: DoneReading, rank: int, host: str, port: int,
               tp_rank: Optional[int] = None) -> Optional[str]:
        """"" for a valid confirmation of ``msg``, the reason for any other
        answer, or None for an ack that answers an older question."""
        try:
            ack = wire.decode(data, wire.DoneAck)
        except (WireError, RecursionError) as exc:
            self._stats.add(bad_messages=1)
            self._drop(host, port)
            v = wire.peek_version(data)
            if v is not None and v != HANDSHAKE_PROTOCOL_VERSION:
                return (f"producer rank {rank} at {host}:{port} speaks handshake protocol version {v}, "
                        f"this engine version {HANDSHAKE_PROTOCOL_VERSION}")
            logger.warning("done ack from %s:%d for transfer %s: %s", host, port, msg.transfer_id, exc)
            return f"bad confirmation from producer rank {rank} at {host}:{port}: {exc}"
        if ack.v != HANDSHAKE_PROTOCOL_VERSION:
            self._drop(host, port)
            return (f"producer rank {rank} at {host}:{port} speaks handshake protocol version {ack.v}, "
                    f"this engine version {HANDSHAKE_PROTOCOL_VERSION}")
        if self._token is not None and not verify_ack(self._token, ack, msg.nonce or ""):
            logger.debug("ignoring a done ack for transfer %s from %s:%d that does not answer this notice",
                         ack.transfer_id, host, port)
            return None
        if ack.transfer_id != msg.transfer_id or ack.tp_rank != (rank if tp_rank is None else tp_rank):
            logger.debug("ignoring a stale done ack for transfer %s from %s:%d", ack.transfer_id, host, port)
            return None
        if not ack.valid:
            return ack.reason or f"producer rank {rank} at {host}:{port} no longer holds transfer {ack.transfer_id}"
        return ""

    def close(self) -> None:
        self._socks.close()

