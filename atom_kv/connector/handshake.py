"""The handshake side channel: a producer rank's ROUTER server (the
consumer's handshake request is :mod:`atom_kv.connector.handshake_client`,
re-exported here).

The server answers :class:`~atom_kv.wire.HandshakeRequest` with a
:class:`~atom_kv.wire.HandshakeReply` (backend descriptor, region list,
compat info); with an ``auth_token`` it first runs the challenge-response of
:mod:`atom_kv.connector.handshake_auth` and seals the reply. It answers
:class:`~atom_kv.wire.PeerProofRequest`, and hands
:class:`~atom_kv.wire.DoneReading` and :class:`~atom_kv.wire.Release` (checked:
signed, fresh, never replayed) to callbacks; a confirmation
(:class:`~atom_kv.wire.DoneAck`) goes back to the sender, signed, whenever the
callback answers (at once, or later from another thread). Anything else on
the port, and every refusal, is counted and logged at a bounded rate. What a
stranger can make the port hold before proving the token is bounded by
:mod:`atom_kv.connector.handshake_limits` (frame size, queued frames,
connections per address) and the fair shares of its
:class:`~atom_kv.connector.handshake_auth.ChallengeTable`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any, Callable, Optional

import msgspec
import zmq

from atom_kv import wire
from atom_kv._ratelimit import RateLimitedLog
from atom_kv.auth import (
    PURPOSE_BLOCKS,
    PURPOSE_DONE,
    PURPOSE_ISSUED,
    PURPOSE_RELEASE,
    AuthError,
    ReplayWindow,
    new_nonce,
    same_mac,
    verify_struct,
)
from atom_kv.connector.confirm import DealerCache, DoneAckClient
from atom_kv.connector.endpoints import tcp_endpoint
from atom_kv.connector.handshake_auth import (
    Challenge,
    ChallengeTable,
    ack_mac,
    answer_mac,
    challenge_binding,
    client_proof_of_digest,
    peer_proof,
    reply_mac,
    request_digest,
    server_proof,
)
from atom_kv.connector.handshake_client import (
    MAX_MESSAGE_BYTES,
    HandshakeError,
    HandshakeRejected,
    HandshakeUnreachable,
    decode_checked,
    request_handshake,
    version_refusal,
)
from atom_kv.connector.handshake_limits import RECEIVE_HWM, ConnectionGuard, PortLimits, largest_message_bytes
from atom_kv.connector.stats import TransferStats
from atom_kv.wire import (
    BlocksAnswer,
    BlocksQuery,
    CompatInfo,
    DoneAck,
    DoneReading,
    HandshakeChallenge,
    HandshakeProof,
    HandshakeReply,
    HandshakeRequest,
    Issued,
    PeerProof,
    PeerProofRequest,
    Release,
    SealedHandshakeReply,
    WireError,
    handshake_port,
)

__all__ = [
    "DealerCache",
    "DoneAckClient",
    "HandshakeError",
    "HandshakeRejected",
    "HandshakeUnreachable",
    "HandshakeServer",
    "MAX_MESSAGE_BYTES",
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


def _peer_address(frame: zmq.Frame) -> str:
    """The sending peer's IP address (ZeroMQ's ``Peer-Address`` property), or "" where unknown."""
    try:
        return frame.get("Peer-Address") or ""
    except (zmq.ZMQError, AttributeError, TypeError, UnicodeDecodeError):
        return ""


def _source_fd(frame: zmq.Frame) -> Optional[int]:
    """The descriptor of the connection a message came on (ZeroMQ's ``ZMQ_SRCFD``), or None."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None


# ---------------------------------------------------------------------------
# producer side
# ---------------------------------------------------------------------------
class HandshakeServer:
    """Owns a producer rank's ROUTER socket, the thread that serves it, the
    outstanding challenges, the replay window of signed notices and the
    rate-limited log of refusals.

    ``identity()`` is the rank's current ``(engine_id, tp_rank)``; ``responder``
    builds the reply to a (proven) handshake; ``on_done(msg, respond)`` gets
    every checked done-reading notice (``respond`` is None unless it asked for
    a confirmation; it may be called later, from any thread); ``on_release``
    every checked release, ``on_issued`` every checked issue notice from the
    engine's own scheduler; ``on_blocks(query, respond, source)`` every checked
    blocks query (the rendezvous; ``respond`` may be called later, from any
    thread; ``source`` is the asker's address); ``on_tick()`` runs on the server
    thread between polls (at least every 0.2 s). ``limits``: the
    pre-authentication bounds (:class:`~atom_kv.connector.handshake_limits.PortLimits`).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        *,
        bind_host: str,
        port: int,
        auth_token: Optional[str],
        identity: Callable[[], tuple[str, int]],
        responder: Callable[[HandshakeRequest], HandshakeReply],
        on_done: Callable[[DoneReading, Optional[Callable[[DoneAck], None]]], None],
        on_release: Callable[[Release], None],
        stats: TransferStats,
        on_issued: Optional[Callable[[Issued], None]] = None,
        on_tick: Optional[Callable[[], None]] = None,
        on_blocks: Optional[Callable[[BlocksQuery, Callable[[BlocksAnswer], None], str], None]] = None,
        name: str,
        challenge_ttl_s: float = 10.0,
        auth_window_s: float = 30.0,
        replay_entries: int = 65536,
        log_interval_s: float = 10.0,
        limits: Optional[PortLimits] = None,
    ) -> None:
        self._token = auth_token
        self._identity = identity
        self._responder = responder
        self._on_done = on_done
        self._on_release = on_release
        self._on_issued = on_issued
        self._on_tick = on_tick
        self._on_blocks = on_blocks
        self._stats = stats
        self._stop = threading.Event()
        limits = limits if limits is not None else PortLimits()
        self._challenges = ChallengeTable(MAX_CHALLENGES, challenge_ttl_s, limits.challenges_per_source,
                                          reserved=limits.challenges_reserved, on_evict=self._evicted)
        self._replay = ReplayWindow(auth_window_s, replay_entries)
        self.port = port
        self.warnings = RateLimitedLog(logger, f"refused messages on handshake port {port}",
                                       interval_s=log_interval_s)
        self._outbox: "queue.SimpleQueue[tuple[bytes, bytes]]" = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, largest_message_bytes())
        self._sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        self._sock.setsockopt(zmq.HANDSHAKE_IVL, int(limits.zmq_handshake_s * 1000))
        self._sock.setsockopt(zmq.SNDHWM, 1024)
        self.guard = ConnectionGuard(self._sock, max_connections=limits.max_connections,
                                     per_source=limits.connections_per_source, on_refuse=self._refuse_quietly)
        try:
            endpoint, ipv6 = tcp_endpoint(bind_host, port)
            if ipv6:
                self._sock.setsockopt(zmq.IPV6, 1)
            self._sock.bind(endpoint)
            if port == 0:  # the OS picked it (a port plan with handshake_port 0)
                self.port = int(self._sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
            self.guard.port = self.port
        except (zmq.ZMQError, ValueError) as exc:
            self._close_fds()
            raise HandshakeError(
                f"cannot listen for handshakes on {bind_host}:{port} "
                f"(handshake_port + pp_rank*dp_size*tp_size + dp_rank*tp_size + tp_rank): {exc}"
            ) from None
        self._fd: Optional[int] = None  # the connection and address of the message being handled
        self._source = ""
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    # -- the serving thread ------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self.guard.monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(_POLL_MS))
                if self.guard.monitor in events:
                    self.guard.poll_events()
                if self._wake_r in events:
                    self._drain_wake()
                self._send_outbox()
                if self._sock in events:
                    self._receive_batch()
                self._housekeeping()
        finally:
            self.guard.close()
            self._sock.close(0)

    def _receive_batch(self) -> None:
        for _ in range(_BATCH):
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                if not self._stop.is_set():
                    logger.warning("handshake server: receive failed: %s", exc)
                return
            try:
                self._handle([part.bytes for part in parts], _peer_address(parts[-1]), _source_fd(parts[-1]))
            except Exception as exc:  # a bug in a handler must not kill the server, nor let a peer flood the log
                self._refuse("internal", f"failed to handle a message: {type(exc).__name__}: {exc}")
                logger.debug("handshake server: failed to handle a message", exc_info=True)

    def _housekeeping(self) -> None:
        for ch in self._challenges.expire():
            self._refuse("unanswered", f"a handshake from {ch.source or 'an unknown address'} never answered the "
                                       "challenge: the decode engine could not verify this engine's proof "
                                       "(different auth_token?), or it was not a decode engine")
        self.warnings.flush()
        if self._on_tick is not None:
            try:
                self._on_tick()
            except Exception:
                logger.exception("handshake server: periodic callback failed")

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _send_outbox(self) -> None:
        while True:
            try:
                identity, data = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send(identity, data)

    def _send(self, identity: bytes, data: bytes) -> None:
        try:
            self._sock.send_multipart([identity, data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._refuse("send", f"answer dropped: {exc}")

    def post(self, identity: bytes, data: bytes) -> None:
        """Send ``data`` to ``identity`` from any thread (queued for the server thread)."""
        if threading.current_thread() is self._thread:
            self._send(identity, data)
            return
        self._outbox.put((identity, data))
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is pending anyway) or closed

    # -- messages ------------------------------------------------------------
    def _handle(self, frames: list[bytes], source: str = "", fd: Optional[int] = None) -> None:
        identity, payloads = frames[0], frames[1:]
        if len(payloads) == 2 and payloads[0] == b"":
            payloads = payloads[1:]  # REQ-style envelope
        if len(payloads) != 1:
            self._refuse("frames", f"expected 1 payload frame, got {len(payloads)}")
            return
        data = payloads[0]
        try:
            msg = decode_checked(data, wire.HandshakeMessage)
        except HandshakeRejected as exc:  # another protocol version: say so to a handshake
            self._refuse("version", str(exc))
            self._send(identity, wire.encode(HandshakeReply(ok=False, error=str(exc))))
            return
        except WireError as exc:
            self._refuse("decode", str(exc))
            return
        self._fd, self._source = fd, source
        if self._token is None:  # nothing to prove: a connection that speaks the protocol is a peer's
            self.guard.proven(fd)
        if isinstance(msg, HandshakeRequest):
            self._on_request(identity, data, msg, source)
        elif isinstance(msg, HandshakeProof):
            self._on_proof(identity, msg)
        elif isinstance(msg, PeerProofRequest):
            engine_id, rank = self._identity()
            proof = peer_proof(self._token, msg.nonce, engine_id, rank) if self._token is not None else ""
            self._send(identity, wire.encode(PeerProof(engine_id=engine_id, tp_rank=rank, proof=proof)))
        elif isinstance(msg, DoneReading):
            self._on_done_reading(identity, msg)
        elif isinstance(msg, BlocksQuery):
            self._on_blocks_query(identity, msg, source)
        elif isinstance(msg, Issued):
            what = f"issue of transfer {msg.transfer_id}"
            if self._on_issued is not None and self._checked(PURPOSE_ISSUED, msg, what):
                self._on_issued(msg)
        else:
            self._on_release_msg(msg)

    def _on_request(self, identity: bytes, data: bytes, req: HandshakeRequest, source: str = "") -> None:
        if self._token is None:
            self._send(identity, wire.encode(self._responder(req)))
            return
        who = f"engine {req.engine_id} rank {req.tp_rank} ({req.host or 'unknown host'})"
        if len(req.nonce) < 16:
            self._refuse("auth", f"handshake from {who} without a challenge: it has no auth_token")
            self._send(identity, wire.encode(HandshakeReply(
                ok=False, error="handshake rejected: this prefill engine requires an auth_token; configure the "
                                "same auth_token on the decode engine")))
            return
        p_nonce = new_nonce()
        engine_id, rank = self._identity()
        full = self._challenges.add(p_nonce, Challenge.of(identity, data, source, self._challenges.new_deadline()))
        if full is not None:
            why = (f"{len(self._challenges)} handshakes in flight, all from addresses that proved the auth_token "
                   "before (strangers' share is empty)")
            self._refuse("challenges_full", f"handshake from {who} refused: {why}")
            self._send(identity, wire.encode(HandshakeReply(
                ok=False, error=f"handshake rejected: {why}; retry the handshake")))
            return
        challenge = HandshakeChallenge(engine_id=engine_id, tp_rank=rank, nonce=p_nonce,
                                       proof=server_proof(self._token, req.nonce, p_nonce, engine_id, rank))
        self._send(identity, wire.encode(challenge))

    def _on_proof(self, identity: bytes, msg: HandshakeProof) -> None:
        if self._token is None:
            self._refuse("auth", "handshake proof, but no auth_token is configured here")
            self._send(identity, wire.encode(HandshakeReply(
                ok=False, error="handshake rejected: this prefill engine has no auth_token")))
            return
        ch = self._challenges.take(msg.nonce)
        if ch is None or ch.binding != challenge_binding(identity, msg.request):
            why = ("it carries no request (the decode engine runs an older atom-kv: run the same release on both)"
                   if ch is not None and not msg.request else "an unknown or expired challenge")
            self._refuse("challenge", f"handshake proof from {self._source or 'an unknown address'}: {why}")
            self._send(identity, wire.encode(HandshakeReply(
                ok=False, error=f"handshake rejected: {why}; retry the handshake")))
            return
        request = decode_checked(msg.request, HandshakeRequest)  # decoded when it was received: it still decodes
        expected = client_proof_of_digest(self._token, request.nonce, msg.nonce, request_digest(msg.request))
        if not same_mac(expected, msg.proof):
            self._refuse("auth", f"handshake from engine {request.engine_id} rank {request.tp_rank} "
                                 f"({request.host or 'unknown host'}): wrong auth_token")
            self._send(identity, wire.encode(HandshakeReply(ok=False, error="handshake rejected: wrong auth_token")))
            return
        self._proved()
        reply = wire.encode(self._responder(request))
        sealed = SealedHandshakeReply(reply=reply, mac=reply_mac(self._token, request.nonce, msg.nonce, reply))
        self._send(identity, wire.encode(sealed))

    def _on_done_reading(self, identity: bytes, msg: DoneReading) -> None:
        if not 0 <= msg.tp_rank < msg.tp_size <= 4096:
            self._refuse("rank", f"done-reading for transfer {msg.transfer_id}: rank {msg.tp_rank} of {msg.tp_size}")
            return
        if not self._checked(PURPOSE_DONE, msg, f"done-reading for transfer {msg.transfer_id} "
                                                f"from engine {msg.engine_id} rank {msg.tp_rank}"):
            return
        self._stats.add(done_received=1)
        respond = None
        if msg.want_ack:
            nonce = msg.nonce or ""

            def respond(ack: DoneAck) -> None:
                if self._token is not None:
                    ack = msgspec.structs.replace(ack, mac=ack_mac(self._token, ack, nonce))
                self.post(identity, wire.encode(ack))

        self._on_done(msg, respond)

    def _on_blocks_query(self, identity: bytes, msg: BlocksQuery, source: str = "") -> None:
        if not 0 <= msg.tp_rank < msg.tp_size <= 4096:
            self._refuse("rank", f"blocks query for transfer {msg.transfer_id}: rank {msg.tp_rank} of {msg.tp_size}")
            return
        if not self._checked(PURPOSE_BLOCKS, msg, f"blocks query for transfer {msg.transfer_id} "
                                                  f"from engine {msg.engine_id} rank {msg.tp_rank}"):
            return
        nonce = msg.nonce or ""

        def respond(answer: BlocksAnswer) -> None:
            if self._token is not None:
                answer = msgspec.structs.replace(answer, mac=answer_mac(self._token, answer, nonce))
            self.post(identity, wire.encode(answer))

        if self._on_blocks is None:
            respond(BlocksAnswer(transfer_id=msg.transfer_id, tp_rank=self._identity()[1], found=False,
                                 reason="this engine is not a kv_producer"))
            return
        self._on_blocks(msg, respond, source)

    def _on_release_msg(self, msg: Release) -> None:
        if not self._checked(PURPOSE_RELEASE, msg, f"release of transfer {msg.transfer_id} "
                                                   f"from {msg.sender or 'an unnamed sender'}"):
            return
        self._stats.add(releases_received=1)
        self._on_release(msg)

    def _checked(self, purpose: str, msg: Any, what: str) -> bool:
        if self._token is None:
            return True
        try:
            verify_struct(self._token, purpose, msg, self._replay)
        except AuthError as exc:
            self._refuse(exc.reason, f"{what}: {exc}")
            return False
        self._proved()
        return True

    def _proved(self) -> None:
        """The message being handled proved the token: its connection and its address are a peer's."""
        self.guard.proven(self._fd)
        self._challenges.proven.proved(self._source)

    def _evicted(self, challenge: Challenge, why: str) -> None:
        where = challenge.source or "an unknown address"
        self._refuse("challenges_" + why, f"forgot the oldest pending challenge of {where}: " + (
            "a newer one came from there and it holds the most, or handshake_max_challenges_per_source"
            if why == "source" else f"{MAX_CHALLENGES} are pending and {where} holds the most"))

    def _refuse_quietly(self, reason: str, why: str) -> None:
        self.warnings.event(reason, f"handshake port {self.port}: {why}")

    def _refuse(self, reason: str, why: str) -> None:
        self._stats.add(bad_messages=1)
        self.warnings.event(reason, f"handshake port {self.port}: refused: {why}")

    def refusals(self) -> dict[str, int]:
        """Every refusal so far, by reason (``auth``, ``stale``, ``replay``, ``version``, ``decode``, ...)."""
        return self.warnings.counts()

    # -- lifecycle -------------------------------------------------------------
    def _close_fds(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.guard.close()
        self._sock.close(0)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
