"""The handshake side channel: a producer rank's ROUTER server and the
consumer's handshake request.

The server answers :class:`~atom_kv.wire.HandshakeRequest` with a
:class:`~atom_kv.wire.HandshakeReply` (backend descriptor, region list,
compat info); with an ``auth_token`` it first runs the challenge-response of
:mod:`atom_kv.connector.handshake_auth` and seals the reply. It answers
:class:`~atom_kv.wire.PeerProofRequest`, and hands
:class:`~atom_kv.wire.DoneReading` and :class:`~atom_kv.wire.Release` (checked:
signed, fresh, never replayed) to callbacks; a confirmation
(:class:`~atom_kv.wire.DoneAck`) goes back to the sender, signed, whenever the
callback answers (at once, or later from another thread). Anything else on
the port, and every refusal, is counted and logged at a bounded rate.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
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
from atom_kv.connector.endpoints import connect_socket, tcp_endpoint
from atom_kv.connector.handshake_auth import (
    Challenge,
    ChallengeTable,
    ack_mac,
    answer_mac,
    client_proof,
    client_proof_of_digest,
    peer_proof,
    reply_mac,
    request_digest,
    server_proof,
)
from atom_kv.connector.stats import TransferStats
from atom_kv.wire import (
    HANDSHAKE_PROTOCOL_VERSION,
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
    "HandshakeServer",
    "MAX_MESSAGE_BYTES",
    "compat_mismatch",
    "handshake_port",
    "request_handshake",
    "version_refusal",
]

logger = logging.getLogger(__name__)

#: Largest frame the handshake port accepts; bigger ones drop the connection.
MAX_MESSAGE_BYTES = 1 << 20
#: Challenges a producer rank remembers at once (a new one is refused past it; none is dropped early).
MAX_CHALLENGES = 4096
#: Challenges pending at once for one peer address (a decode engine has one per rank and handshake in flight).
MAX_CHALLENGES_PER_SOURCE = 64
_POLL_MS = 200
_BATCH = 64  # messages handled between two housekeeping passes


class HandshakeError(RuntimeError):
    """A handshake did not complete (timeout, bad reply); worth retrying."""


class HandshakeRejected(HandshakeError):
    """The peer answered and refused (auth, compat, version), or did not prove
    the auth token; retrying won't help."""


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


def version_refusal(peer_version: Any) -> str:
    """The one line that refuses a peer speaking another handshake protocol version."""
    return (f"handshake protocol version {peer_version} (peer) is not version {HANDSHAKE_PROTOCOL_VERSION} "
            "(here): run the same atom-kv release on the prefill and decode engines")


def _peer_address(frame: zmq.Frame) -> str:
    """The sending peer's IP address (ZeroMQ's ``Peer-Address`` property), or "" where unknown."""
    try:
        return frame.get("Peer-Address") or ""
    except (zmq.ZMQError, AttributeError, TypeError, UnicodeDecodeError):
        return ""


def _decode(data: bytes, type_: Any) -> Any:
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
    engine's own scheduler; ``on_blocks(query, respond)`` every checked
    blocks query (the rendezvous; ``respond`` may be called later, from any
    thread); ``on_tick()`` runs on the server thread between
    polls (at least every 0.2 s).
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
        on_blocks: Optional[Callable[[BlocksQuery, Callable[[BlocksAnswer], None]], None]] = None,
        name: str,
        challenge_ttl_s: float = 10.0,
        auth_window_s: float = 30.0,
        replay_entries: int = 65536,
        log_interval_s: float = 10.0,
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
        self._challenges = ChallengeTable(MAX_CHALLENGES, challenge_ttl_s, MAX_CHALLENGES_PER_SOURCE)
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
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, 1024)
        try:
            endpoint, ipv6 = tcp_endpoint(bind_host, port)
            if ipv6:
                self._sock.setsockopt(zmq.IPV6, 1)
            self._sock.bind(endpoint)
            if port == 0:  # the OS picked it (a port plan with handshake_port 0)
                self.port = int(self._sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        except (zmq.ZMQError, ValueError) as exc:
            self._close_fds()
            raise HandshakeError(
                f"cannot listen for handshakes on {bind_host}:{port} "
                f"(handshake_port + pp_rank*dp_size*tp_size + dp_rank*tp_size + tp_rank): {exc}"
            ) from None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    # -- the serving thread ------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(_POLL_MS))
                if self._wake_r in events:
                    self._drain_wake()
                self._send_outbox()
                if self._sock in events:
                    self._receive_batch()
                self._housekeeping()
        finally:
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
                self._handle([part.bytes for part in parts], _peer_address(parts[-1]))
            except Exception as exc:  # a bug in a handler must not kill the server, nor let a peer flood the log
                self._refuse("internal", f"failed to handle a message: {type(exc).__name__}: {exc}")
                logger.debug("handshake server: failed to handle a message", exc_info=True)

    def _housekeeping(self) -> None:
        for ch in self._challenges.expire():
            req = ch.request
            self._refuse("unanswered", f"handshake from engine {req.engine_id} rank {req.tp_rank} "
                                       f"({req.host or 'unknown host'}) never answered the challenge: the "
                                       "decode engine could not verify this engine's proof (different auth_token?)")
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
    def _handle(self, frames: list[bytes], source: str = "") -> None:
        identity, payloads = frames[0], frames[1:]
        if len(payloads) == 2 and payloads[0] == b"":
            payloads = payloads[1:]  # REQ-style envelope
        if len(payloads) != 1:
            self._refuse("frames", f"expected 1 payload frame, got {len(payloads)}")
            return
        data = payloads[0]
        try:
            msg = _decode(data, wire.HandshakeMessage)
        except HandshakeRejected as exc:  # another protocol version: say so to a handshake
            self._refuse("version", str(exc))
            self._send(identity, wire.encode(HandshakeReply(ok=False, error=str(exc))))
            return
        except WireError as exc:
            self._refuse("decode", str(exc))
            return
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
            self._on_blocks_query(identity, msg)
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
        full = self._challenges.add(p_nonce, Challenge(identity, req.nonce, request_digest(data), wire.encode(req),
                                                       self._challenges.new_deadline(), source))
        if full is not None:
            limit = (f"{MAX_CHALLENGES} handshakes in flight" if full == "full" else
                     f"{MAX_CHALLENGES_PER_SOURCE} handshakes in flight from {source or 'one address'}")
            self._refuse("challenges_" + full, f"handshake from {who} refused: more than {limit}")
            self._send(identity, wire.encode(HandshakeReply(
                ok=False, error="handshake rejected: too many handshakes in flight; retry the handshake")))
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
        if ch is None or ch.identity != identity:
            self._refuse("challenge", "handshake proof for an unknown or expired challenge")
            self._send(identity, wire.encode(HandshakeReply(
                ok=False, error="handshake rejected: unknown or expired challenge; retry the handshake")))
            return
        expected = client_proof_of_digest(self._token, ch.c_nonce, msg.nonce, ch.request_digest)
        request = ch.request
        if not same_mac(expected, msg.proof):
            self._refuse("auth", f"handshake from engine {request.engine_id} rank {request.tp_rank} "
                                 f"({request.host or 'unknown host'}): wrong auth_token")
            self._send(identity, wire.encode(HandshakeReply(ok=False, error="handshake rejected: wrong auth_token")))
            return
        reply = wire.encode(self._responder(request))
        sealed = SealedHandshakeReply(reply=reply, mac=reply_mac(self._token, ch.c_nonce, msg.nonce, reply))
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

    def _on_blocks_query(self, identity: bytes, msg: BlocksQuery) -> None:
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
        self._on_blocks(msg, respond)

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
        return True

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


# ---------------------------------------------------------------------------
# consumer side
# ---------------------------------------------------------------------------
class _Exchange:
    """One handshake connection: a DEALER socket and bounded receives."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, timeout_s: float,
                 stop: Optional[threading.Event]) -> None:
        self.where = f"{host}:{port}"
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._stop = stop
        self.sock = connect_socket(ctx, zmq.DEALER, host, port, {zmq.MAXMSGSIZE: 64 * MAX_MESSAGE_BYTES})

    def send(self, msg: msgspec.Struct) -> bytes:
        data = wire.encode(msg)
        self.sock.send(data, zmq.NOBLOCK)
        return data

    def receive(self) -> Any:
        while True:
            left = self._deadline - time.monotonic()
            if left <= 0 or (self._stop is not None and self._stop.is_set()):
                raise HandshakeError(f"no handshake reply from {self.where} within {self._timeout_s:g} s")
            if self.sock.poll(min(left, 0.25) * 1000, zmq.POLLIN):
                frames = self.sock.recv_multipart()
                try:
                    return _decode(frames[-1], wire.HandshakeReplyMessage)
                except WireError as exc:
                    raise HandshakeError(f"bad handshake reply from {self.where}: {exc}") from None


def request_handshake(
    ctx: zmq.Context,
    host: str,
    port: int,
    request: HandshakeRequest,
    timeout_s: float,
    stop: Optional[threading.Event] = None,
    auth_token: Optional[str] = None,
) -> HandshakeReply:
    """Handshake with the producer rank at ``host:port`` (at most ``timeout_s``).

    With ``auth_token``: the request carries a fresh nonce, and nothing derived
    from the token is sent unless the peer first proves it knows the token
    (:mod:`atom_kv.connector.handshake_auth`). Raises :class:`HandshakeRejected`
    for refusals and peers that cannot prove the token, :class:`HandshakeError`
    for timeouts and garbage."""
    if auth_token is not None:
        request = msgspec.structs.replace(request, nonce=new_nonce())
    try:
        ex = _Exchange(ctx, host, port, timeout_s, stop)
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
        ex.sock.close(0)


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
    ex.send(HandshakeProof(nonce=first.nonce, proof=client_proof(token, request.nonce, first.nonce, sent)))
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
        return _decode(second.reply, HandshakeReply)
    except WireError as exc:
        raise HandshakeError(f"bad handshake reply from {ex.where}: {exc}") from None
