"""The registration pings the proxy accepts (ATOM's and vLLM MoRIIO's): decoding, bounds, normalising.

ATOM's ping is :class:`atom_kv.wire.RegisterPing` (``type`` "register"); its
``HELLO`` is ignored. MoRIIO's newer ping carries ``type`` "P"/"D",
``http_address`` "ip:port" and ``zmq_address``
"host:IP,handshake:PORT,notify:PORT"; its Structs live here because only the
proxy receives it.

:data:`MAX_PING_BYTES` is derived from the largest legitimate ping (every
field at its bound, every character 4 bytes of UTF-8), so the discovery
socket can refuse anything larger before it is read.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Optional, Union
from urllib.parse import urlsplit

import msgspec

from atom_kv.config import is_port
from atom_kv.proxy.fleet.registry import Registration, Role
from atom_kv.proxy.kv_events.endpoints import events_endpoint
from atom_kv.wire import MAX_KV_FEATURES, HelloPing, Name, RegisterPing, UrlText, WireError, encode

__all__ = [
    "MAX_PING_BYTES", "DiscoveryMessage", "MoriioDecodePing", "MoriioPrefillPing", "UnspecifiedAddress",
    "decode_discovery", "decode_discovery_map", "largest_ping_bytes", "to_registration", "KnownPings",
]

REQUIRED_TRANSFER_MODE = "read"


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


class UnspecifiedAddress(WireError):
    """A ping advertises an address nobody can connect to (``0.0.0.0``, ``::``)."""


def largest_ping_bytes() -> int:
    """The encoded size of the largest ping a legitimate engine can send: ATOM's format with every
    bounded field at its bound in 4-byte characters (MoRIIO's ping has fewer, shorter fields)."""
    wide = "\U0001F600"  # 4 bytes of UTF-8
    name, url = wide * 256, wide * 1024
    ping = RegisterPing(role="P", index=name, request_address=url, handshake_port=65535, dp_size=(1 << 63) - 1,
                        tp_size=(1 << 63) - 1, transfer_mode=name, engine_id=name, model=name,
                        kv_features=[wide * 64] * MAX_KV_FEATURES, kv_events=wide * 300,
                        kv_events_replay=wide * 300, answers=True, ts=1e12, nonce=name, mac=name)
    return len(encode(ping))


#: the discovery socket's ZMQ_MAXMSGSIZE: the largest legitimate ping, plus 2 KiB for keys a newer
#: release may add, rounded up to 4 KiB
MAX_PING_BYTES = (largest_ping_bytes() + 2048 + 4095) // 4096 * 4096


def decode_discovery_map(data: bytes) -> tuple[dict[str, Any], DiscoveryMessage]:
    """Decode any ping the proxy accepts, as its raw map (what a MAC covers) and its Struct.
    Anything else raises :class:`WireError`."""
    return to_message(decode_raw(data), len(data))


def decode_raw(data: bytes) -> dict[str, Any]:
    """A ping's raw map; :class:`WireError` if it is not a msgpack map (or not UTF-8)."""
    try:
        raw = _any_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise WireError(f"bad registration message ({len(data)} bytes): {exc}") from None
    if not isinstance(raw, dict):
        raise WireError(f"bad registration message ({len(data)} bytes): not a map")
    return raw


def to_message(raw: dict[str, Any], size: int) -> tuple[dict[str, Any], DiscoveryMessage]:
    """``raw`` (from :func:`decode_raw`) as the Struct of its format; :class:`WireError` if it is none."""
    try:
        return raw, msgspec.convert(raw, DiscoveryMessage)
    except msgspec.ValidationError as exc:
        raise WireError(f"bad registration message ({size} bytes): {exc}") from None


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


def _check_host(host: str, what: str, text: str) -> None:
    try:
        unspecified = ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return  # a name
    if unspecified:
        raise UnspecifiedAddress(
            f"{what} {text!r} names the unspecified address {host}, which nobody can connect to: the engine "
            "must advertise the address other hosts reach it at, not its bind address")


def to_registration(msg: RegisterPing | _MoriioPing) -> Registration:
    """Normalise either ping format; raises :class:`WireError` on bad addresses
    (:class:`UnspecifiedAddress` on ``0.0.0.0`` or ``::``)."""
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
        _check_host(parts.hostname, "request_address", msg.request_address)
        try:  # a bind address (tcp://*:PORT) means the engine's own host
            events = (None if msg.kv_events is None
                      else events_endpoint(msg.kv_events, "kv_events", host_for_any=parts.hostname))
            replay = (None if msg.kv_events_replay is None or events is None
                      else events_endpoint(msg.kv_events_replay, "kv_events_replay", host_for_any=parts.hostname))
        except ValueError as exc:
            raise WireError(str(exc)) from None
        return Registration(
            role=msg.role, base_url=f"{parts.scheme}://{parts.netloc}", host=parts.hostname, http_port=port,
            handshake_port=msg.handshake_port, dp_size=msg.dp_size, tp_size=msg.tp_size, index=msg.index,
            engine_id=msg.engine_id, model=msg.model, source="atom",
            features=None if msg.kv_features is None else frozenset(msg.kv_features),
            draining=msg.draining,
            kv_events=events, kv_events_replay=replay,
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
    _check_host(host, "http_address", msg.http_address)
    if fields.get("host"):
        _check_host(fields["host"], "zmq_address host", msg.zmq_address)
    role: Role = "P" if isinstance(msg, MoriioPrefillPing) else "D"
    return Registration(
        role=role, base_url=f"http://{host}:{http_port}", host=fields.get("host") or host, http_port=http_port,
        handshake_port=handshake, dp_size=msg.dp_size, tp_size=msg.tp_size, model=msg.model,
        notify_port=notify, source="moriio",
    )


def _ping_key(msg: RegisterPing | _MoriioPing) -> tuple:
    """What :func:`to_registration` reads of ``msg``: every field but the signature's (``ts``, ``nonce``,
    ``mac``: new in every signed ping) and ``answers``."""
    values = [getattr(msg, name) for name in _KEY_FIELDS[type(msg)]]
    return (type(msg), *(tuple(v) if isinstance(v, list) else v for v in values))


_UNREAD = frozenset({"answers", "ts", "nonce", "mac"})
_KEY_FIELDS: dict[type, tuple[str, ...]] = {kind: tuple(f for f in kind.__struct_fields__ if f not in _UNREAD)
               for kind in (RegisterPing, MoriioPrefillPing, MoriioDecodePing)}


class KnownPings:
    """Owns the registrations made from pings already seen: a repeat ping (the same fields, a new signature)
    gets the same :class:`Registration` object back, with no URL parsed again, and the registry then only
    refreshes its instance's timestamp. Holds at most ``limit`` (then starts afresh); only pings that passed
    the signature and bounds checks reach it."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._known: dict[tuple, Registration] = {}

    def registration(self, msg: RegisterPing | _MoriioPing) -> Registration:
        """``to_registration(msg)``, from what an earlier ping with the same fields made when there was one."""
        key = _ping_key(msg)
        reg = self._known.get(key)
        if reg is None:
            reg = to_registration(msg)  # raises WireError: nothing kept
            if len(self._known) >= self.limit:
                self._known.clear()
            self._known[key] = reg
        return reg

    def __len__(self) -> int:
        return len(self._known)
