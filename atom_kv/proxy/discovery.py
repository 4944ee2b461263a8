"""ZeroMQ ROUTER listener for engine registration pings (ATOM's and vLLM MoRIIO's), on the event loop.

ATOM's ping is :class:`atom_kv.wire.RegisterPing` (``type`` "register"); its
``HELLO`` is ignored. MoRIIO's newer ping carries ``type`` "P"/"D",
``http_address`` "ip:port" and ``zmq_address``
"host:IP,handshake:PORT,notify:PORT"; its Structs live here because only the
proxy receives it.

With a registration token, a ping is accepted only if it is signed
(:mod:`atom_kv.auth`: ``ts``, ``nonce``, ``mac`` over the rest of the map)
within the replay window. Every refusal is counted by reason
(``atom_kv_proxy_rejected_registrations``) and logged at a bounded rate.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional, Union
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from atom_kv._ratelimit import RateLimitedLog
from atom_kv.auth import PURPOSE_REGISTER, AuthError, ReplayWindow, verify_fields
from atom_kv.config import is_port
from atom_kv.proxy.metrics import ProxyMetrics
from atom_kv.proxy.registry import Registration, Registry, RegistryFull
from atom_kv.proxy.settings import is_loopback
from atom_kv.wire import PROTOCOL_VERSION, HelloPing, Name, RegisterPing, UrlText, WireError

logger = logging.getLogger(__name__)

REQUIRED_TRANSFER_MODE = "read"
MAX_PING_BYTES = 64 * 1024
_BURST = 256  # pings handled per wake-up before yielding to the loop


class _MoriioPing(msgspec.Struct, tag_field="type", kw_only=True):
    http_address: UrlText
    zmq_address: UrlText
    dp_size: int = 1
    tp_size: int = 1
    transfer_mode: Name = "read"
    model: Optional[Name] = None


class MoriioPrefillPing(_MoriioPing, tag="P"):
    """vLLM MoRIIO registration ping of a prefill instance."""


class MoriioDecodePing(_MoriioPing, tag="D"):
    """vLLM MoRIIO registration ping of a decode instance."""


DiscoveryMessage = Union[RegisterPing, HelloPing, MoriioPrefillPing, MoriioDecodePing]
_any_decoder = msgspec.msgpack.Decoder()


def decode_discovery_map(data: bytes) -> tuple[dict[str, Any], DiscoveryMessage]:
    """Decode any ping the proxy accepts, as its raw map (what a MAC covers) and its Struct.
    Anything else raises :class:`WireError`."""
    try:
        raw = _any_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise WireError(f"bad registration message ({len(data)} bytes): {exc}") from None
    if not isinstance(raw, dict):
        raise WireError(f"bad registration message ({len(data)} bytes): not a map")
    try:
        return raw, msgspec.convert(raw, DiscoveryMessage)
    except msgspec.ValidationError as exc:
        raise WireError(f"bad registration message ({len(data)} bytes): {exc}") from None


def decode_discovery(data: bytes) -> DiscoveryMessage:
    """Decode any ping the proxy accepts; anything else raises :class:`WireError`."""
    return decode_discovery_map(data)[1]


def _port(text: str, what: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise WireError(f"{what}: not a port number: {text!r}") from None
    if not is_port(port, allow_zero=False):
        raise WireError(f"{what}: port out of range: {port}")
    return port


def _check_sizes(dp_size: int, tp_size: int) -> None:
    if dp_size < 1 or tp_size < 1:
        raise WireError(f"dp_size/tp_size must be >= 1, got dp_size={dp_size} tp_size={tp_size}")


def to_registration(msg: RegisterPing | _MoriioPing) -> Registration:
    """Normalise either ping format; raises :class:`WireError` on bad addresses."""
    if isinstance(msg, RegisterPing):
        _check_sizes(msg.dp_size, msg.tp_size)
        try:
            parts = urlsplit(msg.request_address)
        except ValueError as exc:  # e.g. an unclosed IPv6 bracket
            raise WireError(f"request_address: {exc}: {msg.request_address!r}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise WireError(f"request_address: not an http URL: {msg.request_address!r}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise WireError(f"request_address: bad port in {msg.request_address!r}") from None
        if not is_port(msg.handshake_port):
            raise WireError(f"handshake_port: port out of range: {msg.handshake_port}")
        return Registration(
            role=msg.role, base_url=f"{parts.scheme}://{parts.netloc}", host=parts.hostname, http_port=port,
            handshake_port=msg.handshake_port, dp_size=msg.dp_size, tp_size=msg.tp_size, index=msg.index,
            engine_id=msg.engine_id, model=msg.model, source="atom",
            features=None if msg.kv_features is None else frozenset(msg.kv_features),
        )
    _check_sizes(msg.dp_size, msg.tp_size)
    host, sep, port_text = msg.http_address.rpartition(":")
    if not sep or not host:
        raise WireError(f"http_address: expected 'ip:port', got {msg.http_address!r}")
    http_port = _port(port_text, "http_address")
    fields: dict[str, str] = {}
    for item in msg.zmq_address.split(","):
        key, sep, value = item.strip().partition(":")
        if not sep:
            raise WireError(f"zmq_address: expected 'host:IP,handshake:PORT,notify:PORT', got {msg.zmq_address!r}")
        fields[key] = value
    if "handshake" not in fields:
        raise WireError(f"zmq_address: no handshake port in {msg.zmq_address!r}")
    handshake = _port(fields["handshake"], "zmq_address handshake")
    notify = _port(fields["notify"], "zmq_address notify") if "notify" in fields else None
    role = "P" if isinstance(msg, MoriioPrefillPing) else "D"
    return Registration(
        role=role, base_url=f"http://{host}:{http_port}", host=fields.get("host") or host, http_port=http_port,
        handshake_port=handshake, dp_size=msg.dp_size, tp_size=msg.tp_size, model=msg.model,
        notify_port=notify, source="moriio",
    )


class DiscoveryError(Exception):
    """Discovery could not start (the message says where and why)."""


class DiscoveryListener:
    """Owns the ROUTER socket and the loop task that turns pings into :class:`Registry` entries.

    ``start()``/``close()`` belong to the proxy's lifespan (:class:`~atom_kv.proxy.app.ProxyState`)."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: Registry,
        metrics: ProxyMetrics,
        *,
        registration_token: str | None = None,
        window_s: float = 30.0,
        max_tp_size: int = 512,
        max_dp_size: int = 512,
        poll_s: float = 0.5,
        log_interval_s: float = 10.0,
    ) -> None:
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self.registry = registry
        self.metrics = metrics
        self.registration_token = registration_token
        self.max_tp_size = max_tp_size
        self.max_dp_size = max_dp_size
        self.poll_s = poll_s
        self.replay = ReplayWindow(window_s)
        self.warnings = RateLimitedLog(logger, "refused registrations", interval_s=log_interval_s)
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind and start receiving; raises :class:`DiscoveryError` if the address is not usable."""
        if self._task is not None:
            assert self.port is not None
            return self.port
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PING_BYTES)  # a peer sending more is disconnected
        try:
            if self.requested_port == 0:
                self.port = sock.bind_to_random_port(f"tcp://{self.host}")
            else:
                sock.bind(f"tcp://{self.host}:{self.requested_port}")
                self.port = self.requested_port
        except zmq.ZMQError as exc:
            sock.close(0)
            ctx.term()
            raise DiscoveryError(f"cannot listen for discovery on {self.host}:{self.requested_port}: {exc}") from None
        self._ctx, self._sock = ctx, sock
        self._task = asyncio.create_task(self._run(), name="atom-kv-proxy-discovery")
        logger.info("discovery listening on tcp://%s:%d%s", self.host, self.port,
                    " (signed pings only)" if self.registration_token else "")
        if self.registration_token is None:
            reach = "any local process" if is_loopback(self.host) else "ANY HOST THAT CAN REACH IT"
            logger.warning("REGISTRATION IS OPEN on tcp://%s:%d: %s can register an engine and receive client "
                           "requests; set --registration-token to accept signed pings only", self.host, self.port,
                           reach)
        return self.port

    async def close(self) -> None:
        """Stop receiving and close the socket. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        sock, self._sock = self._sock, None
        ctx, self._ctx = self._ctx, None
        if sock is not None:
            sock.close(0)
        if ctx is not None:
            ctx.term()

    async def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        timeout_ms = max(1, int(self.poll_s * 1000))
        while True:
            try:
                if await sock.poll(timeout_ms):
                    for _ in range(_BURST):
                        try:
                            frames = await sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.handle(frames[-1] if frames else b"")
                    else:
                        await asyncio.sleep(0)  # a burst: let requests run before the next one
                self.warnings.flush()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                logger.error("discovery socket error: %s", exc)
                await asyncio.sleep(self.poll_s)
            except Exception as exc:  # keep discovery alive whatever one message does; counted, rate-limited
                self._refuse("internal", "a discovery message", f"{type(exc).__name__}: {exc}")
                logger.debug("unexpected error in discovery", exc_info=True)

    def _refuse(self, reason: str, who: str, detail: str) -> None:
        self.metrics.rejected_registrations.labels(reason).inc()
        self.warnings.event(reason, f"refused registration from {who}: {detail}")

    def handle(self, data: bytes) -> None:
        """Apply one ping; never raises for bad input."""
        try:
            raw, msg = decode_discovery_map(data)
        except WireError as exc:
            self.metrics.bad_discovery_messages.inc()
            self.warnings.event("bad_message", f"ignoring discovery message: {exc}")
            return
        if isinstance(msg, HelloPing):
            logger.debug("HELLO ping ignored")
            return
        who = msg.request_address if isinstance(msg, RegisterPing) else msg.http_address
        if isinstance(msg, RegisterPing) and msg.v != PROTOCOL_VERSION:
            self._refuse("version", who, f"registration protocol version {msg.v} (engine) is not version "
                                         f"{PROTOCOL_VERSION} (proxy): run the same atom-kv release on both")
            return
        if self.registration_token is not None:
            if not isinstance(msg, RegisterPing):
                self._refuse("auth", who, "unsigned (MoRIIO) ping while --registration-token is set")
                return
            try:
                verify_fields(self.registration_token, PURPOSE_REGISTER, raw, self.replay)
            except AuthError as exc:
                self._refuse(exc.reason, who, str(exc))
                return
        if msg.transfer_mode.lower() != REQUIRED_TRANSFER_MODE:  # vLLM MoRIIO sends "READ", ATOM "read"
            self._refuse("transfer_mode", who,
                         f"transfer_mode {msg.transfer_mode!r} is not supported (expected {REQUIRED_TRANSFER_MODE!r})")
            return
        if msg.tp_size > self.max_tp_size or msg.dp_size > self.max_dp_size:
            self._refuse("limits", who, f"tp_size={msg.tp_size} dp_size={msg.dp_size} exceed the limits "
                                        f"(--max-tp-size {self.max_tp_size}, --max-dp-size {self.max_dp_size})")
            return
        try:
            reg = to_registration(msg)
        except WireError as exc:
            self.metrics.bad_discovery_messages.inc()
            self.warnings.event("bad_message", f"ignoring registration from {who}: {exc}")
            return
        try:
            self.registry.upsert(reg)
        except RegistryFull as exc:
            self._refuse("capacity", who, str(exc))
