"""ZeroMQ ROUTER listener for engine registration pings (ATOM's and vLLM MoRIIO's).

ATOM's ping is :class:`atom_kv.wire.RegisterPing` (``type`` "register"); its
``HELLO`` is ignored. MoRIIO's newer ping carries ``type`` "P"/"D",
``http_address`` "ip:port" and ``zmq_address``
"host:IP,handshake:PORT,notify:PORT"; its Structs live here because only the
proxy receives it.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from typing import Optional, Union
from urllib.parse import urlsplit

import msgspec
import zmq

from atom_kv.proxy.metrics import ProxyMetrics
from atom_kv.proxy.registry import Registration, Registry
from atom_kv.wire import HelloPing, RegisterPing, WireError

logger = logging.getLogger(__name__)

REQUIRED_TRANSFER_MODE = "read"
MAX_PING_BYTES = 64 * 1024


class _MoriioPing(msgspec.Struct, tag_field="type", kw_only=True):
    http_address: str
    zmq_address: str
    dp_size: int = 1
    tp_size: int = 1
    transfer_mode: str = "read"
    auth_token: Optional[str] = None
    model: Optional[str] = None


class MoriioPrefillPing(_MoriioPing, tag="P"):
    """vLLM MoRIIO registration ping of a prefill instance."""


class MoriioDecodePing(_MoriioPing, tag="D"):
    """vLLM MoRIIO registration ping of a decode instance."""


DiscoveryMessage = Union[RegisterPing, HelloPing, MoriioPrefillPing, MoriioDecodePing]
_decoder = msgspec.msgpack.Decoder(DiscoveryMessage)


def decode_discovery(data: bytes) -> DiscoveryMessage:
    """Decode any ping the proxy accepts; anything else raises :class:`WireError`."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"bad registration message ({len(data)} bytes): {exc}") from None


def _port(text: str, what: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise WireError(f"{what}: not a port number: {text!r}") from None
    if not 0 < port < 65536:
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
        if not 0 <= msg.handshake_port < 65536:
            raise WireError(f"handshake_port: port out of range: {msg.handshake_port}")
        return Registration(
            role=msg.role, base_url=f"{parts.scheme}://{parts.netloc}", host=parts.hostname, http_port=port,
            handshake_port=msg.handshake_port, dp_size=msg.dp_size, tp_size=msg.tp_size, index=msg.index,
            engine_id=msg.engine_id, model=msg.model, source="atom",
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


class DiscoveryListener:
    """Owns the ROUTER socket and the named thread that receives pings,
    updates the :class:`Registry` and evicts silent instances."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: Registry,
        metrics: ProxyMetrics,
        registration_token: str | None = None,
        poll_s: float = 0.5,
    ) -> None:
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self.registry = registry
        self.metrics = metrics
        self.registration_token = registration_token
        self.poll_s = poll_s
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._warned: set[tuple[str, str]] = set()

    def start(self) -> int:
        """Bind (raising ``zmq.ZMQError`` if the port is taken) and start the thread. Idempotent."""
        with self._lock:
            if self._thread is not None:
                assert self.port is not None
                return self.port
            ctx = zmq.Context()
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_PING_BYTES)  # a peer sending more is disconnected
            try:
                if self.requested_port == 0:
                    self.port = sock.bind_to_random_port(f"tcp://{self.host}")
                else:
                    sock.bind(f"tcp://{self.host}:{self.requested_port}")
                    self.port = self.requested_port
            except zmq.ZMQError:
                sock.close(0)
                ctx.term()
                raise
            self._ctx, self._sock = ctx, sock
            self._thread = threading.Thread(target=self._run, name="atom-kv-proxy-discovery", daemon=True)
            self._thread.start()
            logger.info("discovery listening on tcp://%s:%d", self.host, self.port)
            return self.port

    def close(self) -> None:
        """Stop the thread and close the socket. Idempotent."""
        with self._lock:
            self._stop.set()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=self.poll_s * 4 + 1.0)
            if thread.is_alive():
                logger.error("discovery thread did not stop within %.1fs", self.poll_s * 4 + 1.0)
        sock, self._sock = self._sock, None
        ctx, self._ctx = self._ctx, None
        if sock is not None and (thread is None or not thread.is_alive()):
            sock.close(0)
        if ctx is not None and (thread is None or not thread.is_alive()):
            ctx.term()

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        timeout_ms = max(1, int(self.poll_s * 1000))
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(timeout_ms))
                if sock in events:
                    for _ in range(256):  # drain a burst without starving eviction
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.handle(frames[-1] if frames else b"")
                for inst in self.registry.evict_expired():
                    self.metrics.evictions.labels("prefill" if inst.role == "P" else "decode").inc()
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                logger.error("discovery socket error: %s", exc)
                time.sleep(self.poll_s)
            except Exception:  # keep discovery alive whatever one message does
                logger.exception("unexpected error in discovery loop")

    def _refuse(self, reason: str, who: str, detail: str) -> None:
        self.metrics.rejected_registrations.labels(reason).inc()
        key = (reason, who)
        if key in self._warned:
            logger.debug("refused registration from %s: %s", who, detail)
            return
        if len(self._warned) >= 1024:  # bounded: a flood of distinct senders cannot grow it forever
            self._warned.clear()
        self._warned.add(key)
        logger.warning("refused registration from %s: %s", who, detail)

    def handle(self, data: bytes) -> None:
        """Apply one ping; never raises for bad input."""
        try:
            msg = decode_discovery(data)
        except WireError as exc:
            self.metrics.bad_discovery_messages.inc()
            logger.warning("ignoring discovery message: %s", exc)
            return
        if isinstance(msg, HelloPing):
            logger.debug("HELLO ping ignored")
            return
        who = msg.request_address if isinstance(msg, RegisterPing) else msg.http_address
        if self.registration_token is not None:
            token = msg.auth_token or ""
            if not hmac.compare_digest(token.encode(), self.registration_token.encode()):
                self._refuse("auth", who, "missing or wrong registration token")
                return
        if msg.transfer_mode.lower() != REQUIRED_TRANSFER_MODE:  # vLLM MoRIIO sends "READ", ATOM "read"
            self._refuse(
                "transfer_mode", who,
                f"transfer_mode {msg.transfer_mode!r} is not supported (expected {REQUIRED_TRANSFER_MODE!r})",
            )
            return
        try:
            reg = to_registration(msg)
        except WireError as exc:
            self.metrics.bad_discovery_messages.inc()
            logger.warning("ignoring registration from %s: %s", who, exc)
            return
        self.registry.upsert(reg)
