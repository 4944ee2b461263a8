"""ZeroMQ ROUTER listener for engine registration pings (ATOM's and vLLM MoRIIO's), on the event loop.

What a ping may be is :mod:`atom_kv.proxy.fleet.pings`. Registration needs a
registration token (a ping is accepted only if it is signed, see
:mod:`atom_kv.auth`: ``ts``, ``nonce``, ``mac`` over the rest of the map,
within the replay window), or the operator's ``--allow-open-registration``;
with neither, every ping is refused (loopback is no trust boundary: any local
process could register). Every refusal is counted by reason
(``atom_kv_proxy_rejected_registrations``) and logged at a bounded rate.

A ping that asks for it (``answers``, set by atom-kv's pinger) gets a
:class:`~atom_kv.wire.RegisterAnswer`: registered (``unreachable`` while the
proxy's probes or requests cannot reach the engine's URL), refused and why,
or stale.
ATOM's and MoRIIO's pings never do, and get nothing back.

Before anything is decoded, the socket bounds what a stranger can make it
hold: one message of at most :data:`~atom_kv.proxy.fleet.pings.MAX_PING_BYTES`
(larger: the connection is dropped), :data:`RCV_HWM` queued messages per
connection, and a :class:`~atom_kv.proxy.fleet.discovery_guard.ConnectionGuard` on
the number of connections.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from atom_kv._netaddr import is_loopback
from atom_kv._ratelimit import RateLimitedLog
from atom_kv.auth import PURPOSE_REGISTER, AuthError, ReplayWindow, verify_fields
from atom_kv.proxy.fleet.discovery_guard import ConnectionGuard
from atom_kv.proxy.fleet.pings import (  # noqa: F401 - re-exported: the names tests and tools import from here
    MAX_PING_BYTES, REQUIRED_TRANSFER_MODE, DiscoveryMessage, MoriioDecodePing, MoriioPrefillPing,
    KnownPings, UnspecifiedAddress, decode_discovery, decode_discovery_map, decode_raw, to_message, to_registration,
)
from atom_kv.proxy.fleet.registry import UP, Registry, RegistryFull, Withdrawn
from atom_kv.proxy.observability.metrics import ProxyMetrics
from atom_kv.wire import (
    PROTOCOL_VERSION, REFUSED, REGISTERED, STALE, HelloPing, RegisterAnswer, RegisterPing, RegisterStatus, WireError,
    encode,
)

logger = logging.getLogger(__name__)

RCV_HWM = 2  # pings queued per connection (an engine sends one every few seconds)
SND_HWM = 16  # answers queued per connection (under 1 KiB each); more are dropped (ROUTER never blocks)
HANDSHAKE_MS = 5000  # a connection must finish ZeroMQ's greeting within this
_BURST = 256  # pings handled per wake-up before yielding to the loop

#: what the operator must do when registration is refused for want of a token
ENABLE_REGISTRATION = ("set --registration-token (the engines' auth_token), or --allow-open-registration to "
                       "accept unsigned pings from anyone who can reach the discovery port")
#: why an unsigned ping is refused by a proxy with a token: the engine has none
UNSIGNED = ("the ping is not signed: the engine has no auth_token, and this proxy accepts only pings signed with its "
            "--registration-token; set the engine's auth_token to the proxy's --registration-token")


def _peer(frame: zmq.Frame) -> Optional[str]:
    """The source address a message came from (ZeroMQ's ``Peer-Address`` property), if known."""
    try:
        peer = frame.get("Peer-Address")
        return peer if isinstance(peer, str) else None
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return None


class DiscoveryError(Exception):
    """Discovery could not start (the message says where and why)."""


class DiscoveryListener:
    """Owns the ROUTER socket, its connection guard and the loop tasks that turn pings into
    :class:`Registry` entries and answer them.

    ``start()``/``close()`` belong to the proxy's lifespan (:class:`~atom_kv.proxy.app.ProxyState`)."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: Registry,
        metrics: ProxyMetrics,
        *,
        registration_token: str | None = None,
        allow_open: bool = False,
        window_s: float = 30.0,
        max_tp_size: int = 512,
        max_dp_size: int = 512,
        max_connections: int = 512,
        max_connections_per_source: int = 32,
        poll_s: float = 0.5,
        log_interval_s: float = 10.0,
    ) -> None:
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self.registry = registry
        self.metrics = metrics
        self.registration_token = registration_token
        self.allow_open = allow_open
        self.max_tp_size = max_tp_size
        self.max_dp_size = max_dp_size
        self.max_connections = max_connections
        self.max_connections_per_source = max_connections_per_source
        self.poll_s = poll_s
        self.replay = ReplayWindow(window_s)
        self.warnings = RateLimitedLog(logger, "refused registrations", interval_s=log_interval_s)
        self.guard: ConnectionGuard | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._raw: zmq.Socket | None = None  # a plain shadow of ``_sock``, read by ``_drain`` while running
        self._more: asyncio.Handle | None = None  # the next turn's drain, after a full burst
        # the registrations repeat pings map to (every engine's, and their changes: bounded by the registry's cap)
        self.known_pings = KnownPings(4 * registry.max_instances + 64)

    @property
    def refuses_all(self) -> bool:
        """No token and no ``allow_open``: every ping is refused."""
        return self.registration_token is None and not self.allow_open

    async def start(self) -> int:
        """Bind and start receiving; raises :class:`DiscoveryError` if the address is not usable."""
        if self._tasks:
            assert self.port is not None
            return self.port
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PING_BYTES)  # a peer sending more is disconnected, nothing allocated
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.SNDHWM, SND_HWM)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        try:
            if self.requested_port == 0:
                self.port = sock.bind_to_random_port(f"tcp://{self.host}")
            else:
                sock.bind(f"tcp://{self.host}:{self.requested_port}")
                self.port = self.requested_port
        except zmq.ZMQError as exc:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            ctx.term()
            raise DiscoveryError(f"cannot listen for discovery on {self.host}:{self.requested_port}: {exc}") from None
        self._ctx, self._sock, self._monitor = ctx, sock, monitor
        self.guard = ConnectionGuard(self.port, self.max_connections, self.max_connections_per_source)
        self._tasks = [asyncio.create_task(self._run(), name="atom-kv-proxy-discovery"),
                       asyncio.create_task(self._watch(), name="atom-kv-proxy-discovery-guard")]
        logger.info("discovery listening on tcp://%s:%d%s", self.host, self.port,
                    " (signed pings only)" if self.registration_token else "")
        if self.refuses_all:
            logger.warning("REGISTRATION IS REFUSED on tcp://%s:%d: no --registration-token; engines are refused "
                           "(and told why) until you %s; engines given by --prefill/--decode still work",
                           self.host, self.port, ENABLE_REGISTRATION)
        elif self.registration_token is None:
            reach = "any local process" if is_loopback(self.host) else "ANY HOST THAT CAN REACH IT"
            logger.warning("REGISTRATION IS OPEN on tcp://%s:%d (--allow-open-registration): %s can register an "
                           "engine and receive client requests; set --registration-token to accept signed pings "
                           "only", self.host, self.port, reach)
        return self.port

    async def close(self) -> None:
        """Stop receiving and close the sockets. Idempotent."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sock, self._sock = self._sock, None
        monitor, self._monitor = self._monitor, None
        ctx, self._ctx = self._ctx, None
        if sock is not None:
            sock.disable_monitor()
        if monitor is not None:
            monitor.close(0)
        if sock is not None:
            sock.close(0)
        if ctx is not None:
            ctx.term()

    async def _run(self) -> None:
        """Drain the socket whenever its descriptor says so (:meth:`_drain`, from the loop's reader callback),
        and every ``poll_s`` as well: the summaries of refused pings are flushed then."""
        sock = self._sock
        assert sock is not None
        loop = asyncio.get_running_loop()
        # a plain view of the socket: a message read or an answer sent costs no future and no loop round trip
        self._raw = zmq.Socket.shadow(sock.underlying)
        fd = cast(int, self._raw.getsockopt(zmq.FD))  # ZMQ_FD is an int option; pyzmq types every option int | bytes
        loop.add_reader(fd, self._drain)
        try:
            while True:
                self._drain()  # ZeroMQ's descriptor signals edges: a look now and then misses nothing
                self.warnings.flush()
                await asyncio.sleep(self.poll_s)
        finally:
            loop.remove_reader(fd)
            if self._more is not None:
                self._more.cancel()
                self._more = None
            self._raw = None

    def _drain(self) -> None:
        """Handle the pings queued on the socket, at most ``_BURST`` of them: more wait for the loop's next
        turn (requests run in between). Never blocks and never raises."""
        self._more = None
        raw = self._raw
        if raw is None:
            return
        try:
            for _ in range(_BURST):
                if not cast(int, raw.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # an int option, as ZMQ_FD
                    return
                try:
                    frames = raw.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                try:
                    answer = self.handle(frames[-1].bytes, _peer(frames[-1]))
                except Exception as exc:  # keep discovery alive whatever one message does; counted, rate-limited
                    self._count("internal", "a discovery message", f"{type(exc).__name__}: {exc}")
                    logger.debug("unexpected error in discovery", exc_info=True)
                    continue
                if answer is not None and len(frames) >= 2:
                    self._answer(raw, frames[0].bytes, answer)
            self._more = asyncio.get_running_loop().call_soon(self._drain)  # a burst: the rest on the next turn
        except zmq.ZMQError as exc:
            logger.error("discovery socket error: %s", exc)

    @staticmethod
    def _answer(sock: zmq.Socket, identity: bytes, answer: RegisterAnswer) -> None:
        try:
            sock.send_multipart([identity, encode(answer)], zmq.NOBLOCK)  # dropped if the peer's queue is full
        except zmq.ZMQError as exc:
            logger.debug("could not answer a registration ping: %s", exc)

    async def _watch(self) -> None:
        """Follow the ROUTER's connections; shut down those past the guard's caps."""
        monitor, guard = self._monitor, self.guard
        assert monitor is not None and guard is not None
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_ACCEPTED:
                    problem = guard.accepted(int(event["value"]))
                    if problem is not None:
                        self._count("connections", "a discovery connection", problem)
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    guard.disconnected(int(event["value"]))
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                logger.error("discovery monitor error: %s", exc)
                await asyncio.sleep(self.poll_s)
            except Exception:  # a malformed event: ours to fix, never fatal
                logger.debug("unexpected discovery monitor event", exc_info=True)

    def _count(self, reason: str, who: str, detail: str) -> None:
        self.metrics.rejected_registrations.labels(reason).inc()
        self.warnings.event(reason, f"refused registration from {who}: {detail}")

    def _refuse(self, wants: bool, reason: str, who: str, detail: str, answer_reason: str,
                status: RegisterStatus = REFUSED) -> Optional[RegisterAnswer]:
        self._count(reason, who, detail)
        return RegisterAnswer(status=status, reason=answer_reason, detail=detail[:512]) if wants else None

    def _bad(self, wants: bool, who: str, exc: WireError) -> Optional[RegisterAnswer]:
        self.metrics.bad_discovery_messages.inc()
        return self._refuse(wants, "decode", who, str(exc), "format")

    def handle(self, data: bytes, peer: Optional[str] = None) -> Optional[RegisterAnswer]:
        """Apply one ping (from source address ``peer``); returns the answer for the sender when it asked for
        one. Never raises for bad input."""
        try:
            raw = decode_raw(data)
        except WireError as exc:
            return self._bad(False, "a discovery message", exc)
        wants = raw.get("answers") is True and raw.get("type") == "register"
        try:
            _, msg = to_message(raw, len(data))
        except WireError as exc:
            return self._bad(wants, "a discovery message", exc)
        if isinstance(msg, HelloPing):
            logger.debug("HELLO ping ignored")
            return None
        who = msg.request_address if isinstance(msg, RegisterPing) else msg.http_address
        if isinstance(msg, RegisterPing) and msg.v != PROTOCOL_VERSION:
            return self._refuse(wants, "version", who, f"registration protocol version {msg.v} (engine) is not "
                                f"version {PROTOCOL_VERSION} (proxy): run the same atom-kv release on both", "version")
        if self.registration_token is not None:
            if not isinstance(msg, RegisterPing):
                return self._refuse(wants, "auth", who, "unsigned (MoRIIO) ping while --registration-token is set",
                                    "token")
            if raw.get("mac") is None:  # no mac, or the null an engine without auth_token sends
                return self._refuse(wants, "auth", who, UNSIGNED, "token")
            try:
                verify_fields(self.registration_token, PURPOSE_REGISTER, raw, self.replay)
            except AuthError as exc:
                return self._auth_refusal(wants, who, exc)
        elif not self.allow_open:
            return self._refuse(wants, "open", who, "this proxy has no --registration-token and refuses every "
                                "registration: its operator must " + ENABLE_REGISTRATION, "token")
        if msg.transfer_mode.lower() != REQUIRED_TRANSFER_MODE:  # vLLM MoRIIO sends "READ", ATOM "read"
            return self._refuse(wants, "transfer_mode", who, f"transfer_mode {msg.transfer_mode!r} is not supported "
                                f"(expected {REQUIRED_TRANSFER_MODE!r})", "format")
        if msg.tp_size > self.max_tp_size or msg.dp_size > self.max_dp_size:
            return self._refuse(wants, "limits", who, f"tp_size={msg.tp_size} dp_size={msg.dp_size} exceed the "
                                f"limits (--max-tp-size {self.max_tp_size}, --max-dp-size {self.max_dp_size})",
                                "limits")
        try:
            reg = self.known_pings.registration(msg)
        except UnspecifiedAddress as exc:
            return self._refuse(wants, "address", who, str(exc), "address")
        except WireError as exc:
            self.metrics.bad_discovery_messages.inc()
            self.warnings.event("bad_message", f"ignoring registration from {who}: {exc}")
            return RegisterAnswer(status=REFUSED, reason="format", detail=str(exc)[:512]) if wants else None
        try:
            self.registry.upsert(reg)
        except RegistryFull as exc:
            return self._refuse(wants, "capacity", who, str(exc), "limits")
        except Withdrawn as exc:
            return self._refuse(wants, "withdrawn", who, str(exc), "withdrawn")
        if self.guard is not None and peer:
            self.guard.trust(peer)
        if not wants:
            return None
        inst = self.registry.get(reg.role, reg.base_url)
        if inst is not None and inst.state != UP and inst.down_reason:  # a probe or a request did not reach it
            return RegisterAnswer(status=REGISTERED, reason="unreachable", detail=(
                f"but the proxy cannot reach {reg.base_url} ({inst.down_reason}): it gets no requests until it "
                "can; the engine must advertise the address the proxy's host reaches it at, and a firewall must let "
                "the proxy reach that port")[:512])
        return RegisterAnswer(status=REGISTERED)

    def _auth_refusal(self, wants: bool, who: str, exc: AuthError) -> Optional[RegisterAnswer]:
        if exc.reason == "stale":
            return self._refuse(wants, "stale", who, f"{exc}: the engine's and the proxy's clocks differ by more than "
                                f"the proxy's --registration-window {self.replay.window_s:g}s (synchronise them, "
                                "e.g. NTP)", "stale", status=STALE)
        if exc.reason == "replay":
            return self._refuse(wants, "replay", who, str(exc), "replay")
        return self._refuse(wants, exc.reason, who, f"{exc}: the ping is not signed with this proxy's "
                            "--registration-token (the engine's auth_token must be the same value)", "token")
