"""The handshake side channel: a producer rank's ROUTER server (the
consumer's handshake request is :mod:`atom_kv.connector.handshake_client`,
re-exported here).

The server answers :class:`~atom_kv.wire.HandshakeRequest` with a
:class:`~atom_kv.wire.HandshakeReply` (backend descriptor, region list,
compat info); with an ``auth_token`` it first runs the challenge-response of
:mod:`atom_kv.connector.handshake_auth` and seals the reply. It answers
:class:`~atom_kv.wire.PeerProofRequest`, and hands
:class:`~atom_kv.wire.DoneReading` and :class:`~atom_kv.wire.Release` (checked:
signed, fresh, never replayed) to the rank's
:class:`~atom_kv.connector.handshake_port.PortHandler`, one handler per message
type; a confirmation (:class:`~atom_kv.wire.DoneAck`) goes back to the sender,
signed, whenever the rank answers (at once, or later from another thread).
Anything else on the port (a message type without a handler included), and
every refusal, is counted and logged at a bounded rate. Constructing a server
does no I/O: :meth:`HandshakeServer.start` binds the port and starts the thread,
:meth:`HandshakeServer.close` stops it. What a
stranger can make the port hold before proving the token is bounded by
:mod:`atom_kv.connector.handshake_limits` (frame size, queued frames,
connections per address) and the fair shares of its
:class:`~atom_kv.connector.handshake_auth.ChallengeTable`.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Optional

import msgspec
import zmq

from atom_kv import wire
from atom_kv._ratelimit import RateLimitedLog
from atom_kv._waker import Waker
from atom_kv.auth import PURPOSE_BLOCKS, PURPOSE_DONE, PURPOSE_ISSUED, PURPOSE_RELEASE, AuthError, ReplayWindow
from atom_kv.auth import new_nonce, same_mac, verify_struct
from atom_kv.connector.confirm import DealerCache, DoneAckClient
from atom_kv.connector.handshake_auth import Challenge, ChallengeTable, ack_mac, answer_mac, challenge_binding
from atom_kv.connector.handshake_auth import client_proof_of_digest, peer_proof, reply_mac, request_digest, server_proof
from atom_kv.connector.handshake_client import MAX_MESSAGE_BYTES, HandshakeError, HandshakeRejected, HandshakeUnreachable
from atom_kv.connector.handshake_client import compat_mismatch, decode_checked, request_handshake, version_refusal
from atom_kv.connector.handshake_limits import ConnectionGuard, open_port
from atom_kv.connector.handshake_port import BasePortHandler, MessageContext, PortHandler, PortSettings
from atom_kv.connector.stats import TransferStats
from atom_kv.wire import BlocksAnswer, BlocksQuery, DoneAck, DoneReading, HandshakeChallenge, HandshakeProof
from atom_kv.wire import HandshakeReply, HandshakeRequest, Issued, PeerProof, PeerProofRequest, Release
from atom_kv.wire import SealedHandshakeReply, WireError, handshake_port

__all__ = [
    "DealerCache",
    "DoneAckClient",
    "HandshakeError",
    "HandshakeRejected",
    "HandshakeUnreachable",
    "BasePortHandler",
    "HandshakeServer",
    "MAX_MESSAGE_BYTES",
    "MessageContext",
    "PortHandler",
    "PortSettings",
    "compat_mismatch",
    "handshake_port",
    "request_handshake",
    "version_refusal",
]

logger = logging.getLogger(__name__)

#: Challenges a producer rank remembers at once (see :class:`~atom_kv._fairshare.FairShares`).
MAX_CHALLENGES = 4096
#: Challenges pending at once for one peer address (a decode engine has one per rank and handshake in flight).
MAX_CHALLENGES_PER_SOURCE = 64
_POLL_MS = 200
_BATCH = 64  # messages handled between two housekeeping passes


# ---------------------------------------------------------------------------
# producer side
# ---------------------------------------------------------------------------
class HandshakeServer:
    """Owns a producer rank's ROUTER socket, the thread that serves it, the
    outstanding challenges, the replay window of signed notices and the
    rate-limited log of refusals. ``handler`` answers each checked message
    (:class:`~atom_kv.connector.handshake_port.PortHandler`); ``settings`` holds
    the port's timings and pre-authentication bounds. Nothing binds or runs
    until :meth:`start`; :meth:`close` is safe at any point."""

    def __init__(self, ctx: zmq.Context, handler: PortHandler, *, bind_host: str, port: int,
                 auth_token: Optional[str], stats: TransferStats, name: str,
                 settings: Optional[PortSettings] = None) -> None:
        self._ctx = ctx
        self._handler = handler
        self._bind_host = bind_host
        self._token = auth_token
        self._stats = stats
        self._name = name
        self._settings = settings = settings if settings is not None else PortSettings()
        limits = settings.limits
        self._stop = threading.Event()
        self._challenges = ChallengeTable(MAX_CHALLENGES, settings.challenge_ttl_s, limits.challenges_per_source,
                                          reserved=limits.challenges_reserved, on_evict=self._evicted)
        self._replay = ReplayWindow(settings.auth_window_s, settings.replay_entries)
        #: the port asked for until :meth:`start`, then the one bound
        self.port = port
        self.warnings = RateLimitedLog(logger, f"refused messages on handshake port {port}",
                                       interval_s=settings.log_interval_s)
        self._outbox: "queue.SimpleQueue[tuple[bytes, bytes]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waker: Optional[Waker] = None
        self._sock: Optional[zmq.Socket] = None
        self.guard: Optional[ConnectionGuard] = None
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._handlers: dict[type, Callable[[MessageContext, Any], None]] = {
            HandshakeRequest: self._on_request,
            HandshakeProof: self._on_proof,
            PeerProofRequest: self._on_peer_proof,
            DoneReading: self._on_done_reading,
            BlocksQuery: self._on_blocks_query,
            Issued: self._on_issued,
            Release: self._on_release,
        }

    def start(self) -> "HandshakeServer":
        """Bind the port and start serving (once); raises :class:`HandshakeError` when it cannot listen."""
        with self._lock:
            if self._closed or self._thread is not None:
                raise RuntimeError(f"handshake server {self._name}: start() runs once, before close()")
            try:
                sock, guard, self.port = open_port(self._ctx, self._bind_host, self.port, self._settings.limits,
                                                   on_refuse=self._refuse_quietly)
            except (zmq.ZMQError, ValueError) as exc:
                raise HandshakeError(
                    f"cannot listen for handshakes on {self._bind_host}:{self.port} "
                    f"(handshake_port + pp_rank*dp_size*tp_size + dp_rank*tp_size + tp_rank): {exc}"
                ) from None
            self._sock, self.guard, self._waker = sock, guard, Waker()
            self._thread = threading.Thread(target=self._serve, args=(sock, guard, self._waker), name=self._name,
                                            daemon=True)
            self._thread.start()
        return self

    # -- the serving thread ------------------------------------------------
    def _serve(self, sock: zmq.Socket, guard: ConnectionGuard, waker: Waker) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(waker.fileno(), zmq.POLLIN)
        poller.register(guard.monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(_POLL_MS))
                if guard.monitor in events:
                    guard.poll_events()
                if waker.fileno() in events:
                    waker.drain()
                self._send_outbox()
                if sock in events:
                    self._receive_batch(sock)
                self._housekeeping()
        finally:
            guard.close()
            sock.close(0)

    def _receive_batch(self, sock: zmq.Socket) -> None:
        for _ in range(_BATCH):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                if not self._stop.is_set():
                    logger.warning("handshake server: receive failed: %s", exc)
                return
            try:
                self._handle([part.bytes for part in parts], *MessageContext.origin(parts[-1]))
            except Exception as exc:  # a bug in a handler must not kill the server, nor let a peer flood the log
                self._refuse("internal", f"failed to handle a message: {type(exc).__name__}: {exc}")
                logger.debug("handshake server: failed to handle a message", exc_info=True)

    def _housekeeping(self) -> None:
        for ch in self._challenges.expire():
            self._refuse("unanswered", f"a handshake from {ch.source or 'an unknown address'} never answered the "
                                       "challenge: the decode engine could not verify this engine's proof "
                                       "(different auth_token?), or it was not a decode engine")
        self.warnings.flush()
        try:
            self._handler.on_tick()
        except Exception:
            logger.exception("handshake server: periodic callback failed")

    def _send_outbox(self) -> None:
        while True:
            try:
                identity, data = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send(identity, data)

    def _send(self, identity: bytes, data: bytes) -> None:
        try:
            if self._sock is not None:
                self._sock.send_multipart([identity, data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._refuse("send", f"answer dropped: {exc}")

    def post(self, identity: bytes, data: bytes) -> None:
        """Send ``data`` to ``identity`` from any thread (queued for the server thread)."""
        if threading.current_thread() is self._thread:
            self._send(identity, data)
            return
        self._outbox.put((identity, data))
        if self._waker is not None:
            self._waker.wake()

    # -- messages ------------------------------------------------------------
    def _handle(self, frames: list[bytes], source: str = "", fd: Optional[int] = None) -> None:
        identity, payloads = frames[0], frames[1:]
        if len(payloads) == 2 and payloads[0] == b"":
            payloads = payloads[1:]  # REQ-style envelope
        if len(payloads) != 1:
            self._refuse("frames", f"expected 1 payload frame, got {len(payloads)}")
            return
        ctx = MessageContext(identity, payloads[0], source, fd)
        try:
            msg = decode_checked(ctx.data, wire.HandshakeMessage)
        except HandshakeRejected as exc:  # another protocol version: say so to a handshake
            self._refuse("version", str(exc))
            self._send(identity, wire.encode(HandshakeReply(ok=False, error=str(exc))))
            return
        except WireError as exc:
            self._refuse("decode", str(exc))
            return
        self._dispatch(ctx, msg)

    def _dispatch(self, ctx: MessageContext, msg: Any) -> None:
        """Hand ``msg`` to the handler of its type; a type without one is refused (counted, logged)."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._refuse("type", f"a {type(msg).__name__} from {ctx.where}: this port has no handler for it")
            return
        if self._token is None and self.guard is not None:  # nothing to prove: it speaks the protocol
            self.guard.proven(ctx.fd)
        handler(ctx, msg)

    def _reply(self, ctx: MessageContext, msg: Any) -> None:
        self._send(ctx.identity, wire.encode(msg))

    def _on_request(self, ctx: MessageContext, req: HandshakeRequest) -> None:
        if self._token is None:
            self._reply(ctx, self._handler.answer_handshake(req))
            return
        who = f"engine {req.engine_id} rank {req.tp_rank} ({req.host or 'unknown host'})"
        if len(req.nonce) < 16:
            self._refuse("auth", f"handshake from {who} without a challenge: it has no auth_token")
            self._reply(ctx, HandshakeReply(
                ok=False, error="handshake rejected: this prefill engine requires an auth_token; configure the "
                                "same auth_token on the decode engine"))
            return
        p_nonce = new_nonce()
        engine_id, rank = self._handler.identity()
        full = self._challenges.add(p_nonce, Challenge.of(ctx.identity, ctx.data, ctx.source,
                                                          self._challenges.new_deadline()))
        if full is not None:
            why = (f"{len(self._challenges)} handshakes in flight, all from addresses that proved the auth_token "
                   "before (strangers' share is empty)")
            self._refuse("challenges_full", f"handshake from {who} refused: {why}")
            self._reply(ctx, HandshakeReply(ok=False, error=f"handshake rejected: {why}; retry the handshake"))
            return
        self._reply(ctx, HandshakeChallenge(engine_id=engine_id, tp_rank=rank, nonce=p_nonce,
                                            proof=server_proof(self._token, req.nonce, p_nonce, engine_id, rank)))

    def _on_proof(self, ctx: MessageContext, msg: HandshakeProof) -> None:
        if self._token is None:
            self._refuse("auth", "handshake proof, but no auth_token is configured here")
            self._reply(ctx, HandshakeReply(ok=False, error="handshake rejected: this prefill engine has no auth_token"))
            return
        ch = self._challenges.take(msg.nonce)
        if ch is None or ch.binding != challenge_binding(ctx.identity, msg.request):
            why = ("it carries no request (the decode engine runs an older atom-kv: run the same release on both)"
                   if ch is not None and not msg.request else "an unknown or expired challenge")
            self._refuse("challenge", f"handshake proof from {ctx.where}: {why}")
            self._reply(ctx, HandshakeReply(ok=False, error=f"handshake rejected: {why}; retry the handshake"))
            return
        request = decode_checked(msg.request, HandshakeRequest)  # decoded when it was received: it still decodes
        expected = client_proof_of_digest(self._token, request.nonce, msg.nonce, request_digest(msg.request))
        if not same_mac(expected, msg.proof):
            self._refuse("auth", f"handshake from engine {request.engine_id} rank {request.tp_rank} "
                                 f"({request.host or 'unknown host'}): wrong auth_token")
            self._reply(ctx, HandshakeReply(ok=False, error="handshake rejected: wrong auth_token"))
            return
        self._proved(ctx)
        reply = wire.encode(self._handler.answer_handshake(request))
        self._reply(ctx, SealedHandshakeReply(reply=reply, mac=reply_mac(self._token, request.nonce, msg.nonce, reply)))

    def _on_peer_proof(self, ctx: MessageContext, msg: PeerProofRequest) -> None:
        engine_id, rank = self._handler.identity()
        proof = peer_proof(self._token, msg.nonce, engine_id, rank) if self._token is not None else ""
        self._reply(ctx, PeerProof(engine_id=engine_id, tp_rank=rank, proof=proof))

    def _on_done_reading(self, ctx: MessageContext, msg: DoneReading) -> None:
        if not 0 <= msg.tp_rank < msg.tp_size <= 4096:
            self._refuse("rank", f"done-reading for transfer {msg.transfer_id}: rank {msg.tp_rank} of {msg.tp_size}")
            return
        if not self._checked(ctx, PURPOSE_DONE, msg, f"done-reading for transfer {msg.transfer_id} "
                                                     f"from engine {msg.engine_id} rank {msg.tp_rank}"):
            return
        self._stats.add(done_received=1)
        respond = None
        if msg.want_ack:
            identity, nonce = ctx.identity, msg.nonce or ""

            def respond(ack: DoneAck) -> None:
                if self._token is not None:
                    ack = msgspec.structs.replace(ack, mac=ack_mac(self._token, ack, nonce))
                self.post(identity, wire.encode(ack))

        self._handler.on_done(msg, respond)

    def _on_blocks_query(self, ctx: MessageContext, msg: BlocksQuery) -> None:
        if not 0 <= msg.tp_rank < msg.tp_size <= 4096:
            self._refuse("rank", f"blocks query for transfer {msg.transfer_id}: rank {msg.tp_rank} of {msg.tp_size}")
            return
        if not self._checked(ctx, PURPOSE_BLOCKS, msg, f"blocks query for transfer {msg.transfer_id} "
                                                       f"from engine {msg.engine_id} rank {msg.tp_rank}"):
            return
        identity, nonce = ctx.identity, msg.nonce or ""

        def respond(answer: BlocksAnswer) -> None:
            if self._token is not None:
                answer = msgspec.structs.replace(answer, mac=answer_mac(self._token, answer, nonce))
            self.post(identity, wire.encode(answer))

        self._handler.on_blocks(msg, respond, ctx.source)

    def _on_issued(self, ctx: MessageContext, msg: Issued) -> None:
        if self._checked(ctx, PURPOSE_ISSUED, msg, f"issue of transfer {msg.transfer_id}"):
            self._handler.on_issued(msg)

    def _on_release(self, ctx: MessageContext, msg: Release) -> None:
        if not self._checked(ctx, PURPOSE_RELEASE, msg, f"release of transfer {msg.transfer_id} "
                                                        f"from {msg.sender or 'an unnamed sender'}"):
            return
        self._stats.add(releases_received=1)
        self._handler.on_release(msg)

    def _checked(self, ctx: MessageContext, purpose: str, msg: Any, what: str) -> bool:
        if self._token is None:
            return True
        try:
            verify_struct(self._token, purpose, msg, self._replay)
        except AuthError as exc:
            self._refuse(exc.reason, f"{what}: {exc}")
            return False
        self._proved(ctx)
        return True

    def _proved(self, ctx: MessageContext) -> None:
        """``ctx``'s message proved the token: its connection and its address are a peer's."""
        if self.guard is not None:
            self.guard.proven(ctx.fd)
        self._challenges.proven.proved(ctx.source)

    def _evicted(self, challenge: Challenge, why: str) -> None:
        where = challenge.source or "an unknown address"
        self._refuse("challenges_" + why, f"forgot the oldest pending challenge of {where}: " + (
            "a newer one came from there and it holds the most, or limits.handshake_max_challenges_per_source"
            if why == "source" else f"{MAX_CHALLENGES} are pending and {where} holds the most"))

    def _refuse_quietly(self, reason: str, why: str) -> None:
        self.warnings.event(reason, f"handshake port {self.port}: {why}")

    def _refuse(self, reason: str, why: str) -> None:
        self._stats.add(bad_messages=1)
        self.warnings.event(reason, f"handshake port {self.port}: refused: {why}")

    def refusals(self) -> dict[str, int]:
        """Every refusal so far, by reason (``auth``, ``stale``, ``replay``, ``version``, ``decode``, ``type``...)."""
        return self.warnings.counts()

    # -- lifecycle -------------------------------------------------------------
    def close(self) -> None:
        """Stop the thread (it closes the socket). Idempotent; safe before :meth:`start`."""
        with self._lock:
            self._closed = True
            thread, waker = self._thread, self._waker
        self._stop.set()
        if thread is None:
            return
        if thread.is_alive() and thread is not threading.current_thread():
            if waker is not None:
                waker.wake()
            thread.join(timeout=5)
        if waker is not None:
            waker.close()
