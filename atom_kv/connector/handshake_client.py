"""The consumer's half of the handshake side channel: :func:`request_handshake`
asks a producer rank for its descriptor and regions (proving the auth token
both ways when there is one, :mod:`atom_kv.connector.handshake_auth`), over
one DEALER connection with bounded receives; and what both halves share
(the errors, the version refusal, the checked decoder, the KV layout check
:func:`compat_mismatch`).

A DEALER connects in the background and never says that it could not: with a
``connect_timeout_s``, the connection's monitor (:mod:`atom_kv._zmq_watch`)
tells, and a handshake whose connection was never made within it ends with
:class:`HandshakeUnreachable` rather than waiting out ``timeout_s``."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import msgspec
import zmq

from atom_kv import wire
from atom_kv._zmq_watch import ConnectionWatch
from atom_kv.auth import new_nonce, same_mac
from atom_kv.connector.endpoints import connect_socket
from atom_kv.connector.handshake_auth import client_proof, reply_mac, server_proof
from atom_kv.wire import (
    HANDSHAKE_PROTOCOL_VERSION,
    CompatInfo,
    HandshakeChallenge,
    HandshakeProof,
    HandshakeReply,
    HandshakeRequest,
    SealedHandshakeReply,
    WireError,
)

__all__ = ["HandshakeError", "HandshakeRejected", "HandshakeUnreachable", "MAX_MESSAGE_BYTES", "compat_mismatch",
           "decode_checked", "request_handshake", "version_refusal"]

#: Largest frame a consumer accepts from a handshake port (a handshake reply names every region).
MAX_MESSAGE_BYTES = 1 << 20


class HandshakeError(RuntimeError):
    """A handshake did not complete (timeout, bad reply); worth retrying."""


class HandshakeRejected(HandshakeError):
    """The peer answered and refused (auth, compat, version), or did not prove
    the auth token; retrying won't help."""


class HandshakeUnreachable(HandshakeError):
    """No connection to the peer could be made within the connect timeout (its
    packets dropped, or refused): the path to it is closed, so the load that
    needed it fails at once instead of trying again."""


def version_refusal(peer_version: Any) -> str:
    """The one line that refuses a peer speaking another handshake protocol version."""
    return (f"handshake protocol version {peer_version} (peer) is not version {HANDSHAKE_PROTOCOL_VERSION} "
            "(here): run the same atom-kv release on the prefill and decode engines")


def decode_checked(data: bytes, type_: Any) -> Any:
    """``wire.decode`` that also names a version mismatch (``HandshakeRejected``)
    and survives msgpack nested too deeply (``WireError``)."""
    try:
        msg = wire.decode(data, type_)
    except (WireError, RecursionError) as exc:
        v = wire.peek_version(data)
        if v is not None and v != HANDSHAKE_PROTOCOL_VERSION:
            raise HandshakeRejected(version_refusal(v)) from None
        raise WireError(str(exc) if isinstance(exc, WireError) else "message nested too deeply") from None
    if msg.v != HANDSHAKE_PROTOCOL_VERSION:
        raise HandshakeRejected(version_refusal(msg.v))
    return msg


class _Exchange:
    """One handshake connection: a DEALER socket, bounded receives and, with a connect timeout,
    the socket's monitor (owned here, closed with the socket)."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, timeout_s: float,
                 stop: Optional[threading.Event], connect_timeout_s: Optional[float] = None) -> None:
        self.where = f"{host}:{port}"
        self._timeout_s = timeout_s
        now = time.monotonic()
        self._deadline = now + timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._connect_deadline = now + connect_timeout_s if connect_timeout_s is not None else None
        self._stop = stop
        self.watch: Optional[ConnectionWatch] = None

        def watch(sock: zmq.Socket) -> None:
            self.watch = ConnectionWatch(sock)

        # a handshake has two answers: a peer (any host a client named) can make it queue no more than 4
        try:
            self.sock = connect_socket(ctx, zmq.DEALER, host, port,
                                       {zmq.MAXMSGSIZE: 64 * MAX_MESSAGE_BYTES, zmq.RCVHWM: 4},
                                       before_connect=watch if connect_timeout_s is not None else None)
        except BaseException:
            if self.watch is not None:
                self.watch.monitor.close(0)
            raise
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        if self.watch is not None:
            self._poller.register(self.watch.monitor, zmq.POLLIN)

    def send(self, msg: msgspec.Struct) -> bytes:
        data = wire.encode(msg)
        self.sock.send(data, zmq.NOBLOCK)
        return data

    def receive(self) -> Any:
        while True:
            now = time.monotonic()
            left = self._deadline - now
            if left <= 0 or (self._stop is not None and self._stop.is_set()):
                raise HandshakeError(f"no handshake reply from {self.where} within {self._timeout_s:g} s")
            left = min(left, self._connect_left(now))
            ready = dict(self._poller.poll(int(min(left, 0.25) * 1000)))
            if self.watch is not None and self.watch.monitor in ready:
                self.watch.read()
            if self.sock in ready:
                frames = self.sock.recv_multipart()
                try:
                    return decode_checked(frames[-1], wire.HandshakeReplyMessage)
                except WireError as exc:
                    raise HandshakeError(f"bad handshake reply from {self.where}: {exc}") from None

    def _connect_left(self, now: float) -> float:
        """Seconds left for the connection to be made (infinite once it was, or without a connect
        timeout); raises :class:`HandshakeUnreachable` when none are left."""
        watch, deadline = self.watch, self._connect_deadline
        if watch is None or deadline is None or watch.connected_once:
            return float("inf")
        if now < deadline:
            return deadline - now
        watch.read()  # events that arrived with the deadline
        if watch.connected_once:
            return float("inf")
        raise HandshakeUnreachable(f"cannot connect to {self.where} within {self._connect_timeout_s:g} s "
                                   f"(connect_timeout_s): {watch.describe()}")

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close(self.sock)
        self.sock.close(0)


def request_handshake(
    ctx: zmq.Context,
    host: str,
    port: int,
    request: HandshakeRequest,
    timeout_s: float,
    stop: Optional[threading.Event] = None,
    auth_token: Optional[str] = None,
    connect_timeout_s: Optional[float] = None,
) -> HandshakeReply:
    """Handshake with the producer rank at ``host:port`` (at most ``timeout_s``; with
    ``connect_timeout_s``, :class:`HandshakeUnreachable` when no connection was made by then).

    With ``auth_token``: the request carries a fresh nonce, and nothing derived
    from the token is sent unless the peer first proves it knows the token
    (:mod:`atom_kv.connector.handshake_auth`). Raises :class:`HandshakeRejected`
    for refusals and peers that cannot prove the token, :class:`HandshakeError`
    for timeouts and garbage."""
    if auth_token is not None:
        request = msgspec.structs.replace(request, nonce=new_nonce())
    try:
        ex = _Exchange(ctx, host, port, timeout_s, stop, connect_timeout_s)
    except (zmq.ZMQError, ValueError) as exc:
        raise HandshakeError(f"handshake with {host}:{port} failed: {exc}") from None
    try:
        sent = ex.send(request)
        first = ex.receive()
        if auth_token is None:
            if isinstance(first, HandshakeReply):
                return first
            if isinstance(first, HandshakeChallenge):
                raise HandshakeRejected(f"{ex.where} requires an auth_token and none is configured here; set the "
                                        "prefill engine's auth_token on this engine too")
            raise HandshakeError(f"unexpected {type(first).__name__} from {ex.where}")
        return _proven_handshake(ex, auth_token, request, sent, first)
    except zmq.ZMQError as exc:
        raise HandshakeError(f"handshake with {host}:{port} failed: {exc}") from None
    finally:
        ex.close()


def _proven_handshake(ex: _Exchange, token: str, request: HandshakeRequest, sent: bytes, first: Any) -> HandshakeReply:
    if isinstance(first, HandshakeReply):
        if not first.ok:
            raise HandshakeRejected(f"handshake with {ex.where} refused: {first.error}")
        raise HandshakeRejected(f"{ex.where} answered without proving the auth token (is auth_token configured "
                                "on the prefill engine?); its reply is not trusted")
    if not isinstance(first, HandshakeChallenge):
        raise HandshakeError(f"unexpected {type(first).__name__} from {ex.where}")
    expected = server_proof(token, request.nonce, first.nonce, first.engine_id, first.tp_rank)
    if not same_mac(expected, first.proof):
        raise HandshakeRejected(f"{ex.where} did not prove it knows the auth token (a different auth_token, or "
                                "not a prefill engine of this cluster); nothing was sent to it")
    ex.send(HandshakeProof(nonce=first.nonce, proof=client_proof(token, request.nonce, first.nonce, sent),
                           request=sent))
    second = ex.receive()
    if isinstance(second, HandshakeReply):
        if not second.ok:
            raise HandshakeRejected(f"handshake with {ex.where} refused: {second.error}")
        raise HandshakeRejected(f"{ex.where} sent an unsealed reply after the challenge; not trusted")
    if not isinstance(second, SealedHandshakeReply):
        raise HandshakeError(f"unexpected {type(second).__name__} from {ex.where}")
    if not same_mac(reply_mac(token, request.nonce, first.nonce, second.reply), second.mac):
        raise HandshakeRejected(f"the handshake reply from {ex.where} was altered (wrong MAC); not trusted")
    try:
        return decode_checked(second.reply, HandshakeReply)
    except WireError as exc:
        raise HandshakeError(f"bad handshake reply from {ex.where}: {exc}") from None


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
