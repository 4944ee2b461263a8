"""``--kv-events-config '<json>'``: vLLM's ``KVEventsConfig`` keys and defaults, and the endpoints they give.

Keys (vLLM's): ``enable_kv_cache_events`` (false), ``publisher`` (``"zmq"``
when enabled, else ``"null"``), ``endpoint`` (``"tcp://*:5557"``),
``replay_endpoint`` (null: no replay), ``buffer_steps`` (10000),
``hwm`` (100000), ``max_queue_size`` (100000), ``topic`` (``""``).

The reference engine always binds its endpoints (vLLM connects instead when
the host is an address); DP rank N binds port + N, the replay endpoint too
(vLLM's rule). Port 0 lets the OS pick, with one DP rank only. An endpoint
beyond loopback (``tcp://*:PORT``, an interface's address) follows the rule
of every other listener (:func:`atom_kv.addresses.check_listeners_secured`).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Literal, Optional

import msgspec

from atom_kv._netaddr import is_loopback, is_unspecified
from atom_kv.addresses import check_listeners_secured
from atom_kv.config import MAX_PORT, ConfigError, FieldError, KVTransferConfig, PositiveInt, convert_fields

__all__ = ["KVEventsConfig", "ZmqEndpoint", "check_kv_events_listeners", "parse_kv_events_config"]

_WHAT = "--kv-events-config"


class KVEventsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything ``--kv-events-config`` can set (vLLM's keys, with vLLM's defaults)."""

    enable_kv_cache_events: bool = False
    publisher: Optional[Literal["null", "zmq"]] = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: PositiveInt = 10_000
    hwm: PositiveInt = 100_000
    max_queue_size: PositiveInt = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"

    @property
    def publishing(self) -> bool:
        """Events go out (enabled, on the ``zmq`` publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


@dataclass(frozen=True)
class ZmqEndpoint:
    """A ``tcp://HOST:PORT`` the engine binds; ``host`` may be ``*`` (every interface)."""

    key: str  # the config key it came from, for messages
    host: str
    port: int

    @classmethod
    def parse(cls, key: str, text: str) -> "ZmqEndpoint":
        shape = f"`{key}` must be tcp://HOST:PORT (HOST an address, `localhost` or `*` for every interface)"
        if not text.startswith("tcp://"):
            raise ConfigError(f"{_WHAT}: {shape}, got {text!r}")
        host, sep, port_text = text[len("tcp://"):].rpartition(":")
        if not sep or not host or not port_text.isdigit() or len(port_text) > 5 or int(port_text) > MAX_PORT:
            raise ConfigError(f"{_WHAT}: {shape}, with PORT in 0..{MAX_PORT} (0: the OS picks), got {text!r}")
        if host.startswith("[") != host.endswith("]"):
            raise ConfigError(f"{_WHAT}: {shape}, an IPv6 address in brackets, got {text!r}")
        return cls(key, host, int(port_text))

    @property
    def is_loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def is_ipv6(self) -> bool:
        return self.host.startswith("[") or ":" in self.host

    def for_rank(self, dp_rank: int) -> "ZmqEndpoint":
        """DP rank ``dp_rank``'s endpoint: port + rank (port 0 stays 0: the OS picks)."""
        return ZmqEndpoint(self.key, self.host, self.port + dp_rank if self.port else 0)

    @property
    def bind_address(self) -> str:
        return f"tcp://{self.host}:{self.port}" if self.port else f"tcp://{self.host}:*"

    def announced(self, port: int, advertise_host: str) -> str:
        """What a subscriber connects to once bound on ``port``: the bound address, or for every
        interface (``*``, ``0.0.0.0``, ``::``) the engine's advertised one."""
        host = self.host
        if host == "*" or is_unspecified(host):
            bare = ":" in advertise_host and not advertise_host.startswith("[")
            host = f"[{advertise_host}]" if bare else advertise_host
        return f"tcp://{host}:{port}"


def parse_kv_events_config(text: Optional[str]) -> Optional[KVEventsConfig]:
    """Parse ``--kv-events-config``; None (or empty) means no events. Raises :class:`ConfigError`
    (one line naming the key)."""
    if text is None or not text.strip():
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{_WHAT}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f'{_WHAT}: expected a JSON object like {{"enable_kv_cache_events": true}}, '
                          f"got {type(data).__name__}")
    fields = sorted(KVEventsConfig.__struct_fields__)
    for key in data:
        if key not in fields:
            hint = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.5)
            suggestion = f"; did you mean `{hint[0]}`?" if hint else f"; the keys are {', '.join(fields)}"
            raise ConfigError(f"{_WHAT}: unknown key `{key}`{suggestion}")
    try:
        cfg = KVEventsConfig(**convert_fields(data, KVEventsConfig))
    except FieldError as exc:
        raise ConfigError(f"{_WHAT}: {exc}") from None
    if cfg.publishing:
        endpoints(cfg)  # refuse a malformed endpoint now
    return cfg


def endpoints(cfg: KVEventsConfig) -> tuple[ZmqEndpoint, Optional[ZmqEndpoint]]:
    """The publishing and the replay endpoint (DP rank 0's)."""
    pub = ZmqEndpoint.parse("endpoint", cfg.endpoint)
    replay = ZmqEndpoint.parse("replay_endpoint", cfg.replay_endpoint) if cfg.replay_endpoint is not None else None
    return pub, replay


def check_kv_events_listeners(cfg: KVEventsConfig, kv_config: Optional[KVTransferConfig], *, dp_size: int,
                              http_port: int) -> None:
    """Refuse endpoints that cannot work for ``dp_size`` ranks (past 65535, overlapping each other
    or the HTTP port, port 0 with several ranks) or that would listen beyond loopback without the
    cluster's ``auth_token`` or ``allow_open_listeners`` (a colocated engine has neither: it
    publishes on loopback only). One :class:`ConfigError` line naming the key."""
    if not cfg.publishing:
        return
    pub, replay = endpoints(cfg)
    ranges: list[tuple[ZmqEndpoint, range]] = []
    for ep in (pub, replay):
        if ep is None:
            continue
        if ep.port == 0 and dp_size > 1:
            raise ConfigError(f"{_WHAT}: `{ep.key}` port 0 (the OS picks) needs one DP rank: rank N publishes on "
                              f"port + N; give a port for --data-parallel-size {dp_size}")
        if ep.port and ep.port + dp_size - 1 > MAX_PORT:
            raise ConfigError(f"{_WHAT}: `{ep.key}` port {ep.port} + {dp_size - 1} (DP rank N binds port + N) "
                              f"passes {MAX_PORT}; pick a lower port")
        if ep.port:
            ports = range(ep.port, ep.port + dp_size)
            if http_port in ports:
                raise ConfigError(f"{_WHAT}: `{ep.key}` ports {ports.start}..{ports.stop - 1} include the HTTP "
                                  f"--port {http_port}; pick another port")
            for other, taken in ranges:
                if set(ports) & set(taken):
                    raise ConfigError(f"{_WHAT}: `{ep.key}` ports {ports.start}..{ports.stop - 1} overlap "
                                      f"`{other.key}`'s {taken.start}..{taken.stop - 1}; pick ports apart")
            ranges.append((ep, ports))
        _check_secured(ep, kv_config)


def _check_secured(ep: ZmqEndpoint, kv_config: Optional[KVTransferConfig]) -> None:
    if ep.is_loopback:
        return
    what = f"{_WHAT}'s `{ep.key}`"
    exposes = "read the token ids of every prompt this engine caches (KV events are not authenticated)"
    if kv_config is None:
        raise ConfigError(f"{what} would bind {ep.host!r}, beyond loopback: anyone who reaches it could {exposes}; "
                          f"a colocated engine publishes on loopback only (tcp://127.0.0.1:PORT); a P/D engine needs "
                          f"`auth_token` or `allow_open_listeners: true` in --kv-transfer-config")
    check_listeners_secured(kv_config, ep.host, what=what, exposes=exposes)
