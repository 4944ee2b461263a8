"""The schema of ``--kv-transfer-config '<json>'`` and its validation.

Every bad input becomes one :class:`ConfigError` whose message is a single
line naming the key and saying what is allowed. Use :func:`parse_kv_transfer_config`
for JSON text and :meth:`KVTransferConfig.from_dict` for a mapping.

ATOM's keys and our general ones are flat; each backend's tuning and the
pre-authentication fair shares are sections (``{"tcp": {"streams": 8}}``,
atom_kv.config_sections). The flat keys those sections replace
(``tcp_streams``) are read for one release, each with one deprecation line.
The constrained types and the field-by-field conversion that names a bad key
live in atom_kv.config_types and are re-exported here.
"""

from __future__ import annotations

import difflib
import json
import logging
from typing import Annotated, Any, Literal, Mapping, Optional

import msgspec

from atom_kv._netaddr import is_unspecified, parse_port_range
from atom_kv.config_sections import (
    FLAT_KEYS,
    GRANT_MAX_CONNECTIONS,
    GRANT_TIMEOUT_S,
    SECTIONS,
    CmaConfig,
    GpuIpcConfig,
    LimitsConfig,
    MoriioConfig,
    NixlConfig,
    StagingConfig,
    TcpConfig,
    section_from,
)
from atom_kv.config_types import (
    MAX_PORT,
    MAX_RANGES_PER_REQUEST,
    ConfigError,
    FieldError,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PeerPort,
    Port,
    PositiveInt,
    PositiveSeconds,
    RangesPerRequest,
    convert_fields,
    describe_type,
    is_port,
    validate_fields,
)
from atom_kv.token_sources import TokenSource, TokenSourceError, inline_warning, read_token_file, resolve_token

__all__ = [
    "AUTH_TOKEN_ENV",
    "MAX_PORT",
    "MAX_RANGES_PER_REQUEST",
    "CmaConfig",
    "ConfigError",
    "FieldError",
    "GpuIpcConfig",
    "KVTransferConfig",
    "LimitsConfig",
    "MoriioConfig",
    "NixlConfig",
    "NonEmptyStr",
    "NonNegativeFloat",
    "NonNegativeInt",
    "PeerPort",
    "Port",
    "PositiveInt",
    "PositiveSeconds",
    "RangesPerRequest",
    "StagingConfig",
    "TcpConfig",
    "convert_fields",
    "describe_type",
    "is_port",
    "parse_kv_transfer_config",
    "validate_fields",
]

_POST_BATCH_DEFAULT = -1
_POST_BATCH_SIZE = f"{_POST_BATCH_DEFAULT} (library default) or >= 1"
PostBatchSize = Annotated[int, msgspec.Meta(ge=_POST_BATCH_DEFAULT, description=_POST_BATCH_SIZE)]

KVRole = Literal["kv_producer", "kv_consumer"]
#: The one-line answer to a ``--kv-transfer-config`` without ``kv_role`` (never guessed: a decode
#: engine that silently became a producer would lend blocks nobody reads and read none).
KV_ROLE_REQUIRED = ("kv-transfer-config: `kv_role` is required: 'kv_producer' (a prefill engine) or 'kv_consumer' "
                    "(a decode engine); 'kv_both' is not supported")
#: Mooncake's ``protocol`` key, which ATOM users write: the transport it names, as our ``backend``
Protocol = Literal["tcp", "rdma"]
_PROTOCOL_BACKEND: dict[str, "BackendName"] = {"tcp": "tcp", "rdma": "moriio"}
BackendName = Literal["auto", "tcp", "cma", "moriio", "gpu_ipc", "nixl"]
LoadFailurePolicy = Literal["fail", "recompute"]

log = logging.getLogger(__name__)

#: gpu_ipc's grant keys, each with the cma key it took its value from before it had its own, and the default
_GPU_IPC_GRANT_ALIASES = (
    ("grant_timeout_s", GRANT_TIMEOUT_S),
    ("grant_max_connections", GRANT_MAX_CONNECTIONS),
)


class KVTransferConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything ``--kv-transfer-config`` can set; owns the defaults.

    The first group of keys is ATOM's, with ATOM main's defaults (its MoRIIO
    and Mooncake connectors', checked at ffdf3bb5d) so an ATOM launch line
    works unchanged; the second group is ours, the third the sections
    (atom_kv.config_sections: read ``cfg.tcp.streams``). Constructing one
    validates every field (:class:`ConfigError` naming the key); a section
    may be given as a mapping (``tcp={"streams": 2}``).

    ``kv_role`` has no default: :meth:`from_dict` refuses a config without
    it, except where the caller says what the engine itself defaults to
    (ATOM: ``kv_producer``, as its own connectors do).

    Two more of ATOM's keys are read by :meth:`from_dict` only:
    ``kv_connector_extra_config`` (an object of our keys, merged in, as ATOM's
    offload connector reads its own) and ``connectors`` (ATOM's ``multi``
    connector's list, refused with how to use it).
    """

    # --- ATOM's keys -------------------------------------------------------
    kv_role: KVRole
    kv_connector: str = "atom_kv"
    proxy_ip: Optional[str] = None
    proxy_ping_port: Port = 36367
    http_port: Optional[Port] = 8000
    handshake_port: Port = 6301
    protocol: Optional[Protocol] = None
    qp_per_transfer: PositiveInt = 4
    num_worker_threads: PositiveInt = 4
    post_batch_size: PostBatchSize = _POST_BATCH_DEFAULT
    max_send_wr: NonNegativeInt = 0
    max_cqe_num: NonNegativeInt = 0
    max_msg_sge: NonNegativeInt = 0
    enable_notification: bool = False

    # --- our keys ----------------------------------------------------------
    backend: BackendName = "auto"
    engine_id: Optional[str] = None
    ping_interval_s: PositiveSeconds = 3.0
    registration_answer_timeout_s: PositiveSeconds = 5.0
    handshake_timeout_s: PositiveSeconds = 10.0
    # a decode rank's TCP connection to a producer rank (handshake port, tcp read port): not connected by then,
    # the load fails at once, without the retries (a firewall dropping the SYNs, nothing listening there)
    connect_timeout_s: PositiveSeconds = 5.0
    transfer_timeout_s: PositiveSeconds = 30.0
    abort_timeout_s: PositiveSeconds = 120.0
    release_close_wait_s: NonNegativeFloat = 2.0
    prefill_wait_timeout_s: PositiveSeconds = 30.0
    prefill_queue_timeout_s: PositiveSeconds = 300.0
    load_failure_policy: LoadFailurePolicy = "fail"
    transfer_retries: NonNegativeInt = 2
    transfer_retry_backoff_ms: NonNegativeFloat = 50.0
    peer_failure_threshold: PositiveInt = 3
    # a decode rank's producer peers: handshakes kept (least recently used dropped past it), handshakes at once
    max_producer_peers: PositiveInt = 256
    handshake_threads: PositiveInt = 8
    auth_token: Optional[str] = None
    # a file holding auth_token (mode 0600; read at construction when auth_token is unset)
    auth_token_file: Optional[NonEmptyStr] = None
    auth_window_s: PositiveSeconds = 30.0
    auth_replay_entries: PositiveInt = 65536
    # --- listeners and addresses (the port plan: atom_kv.ports) -------------
    advertise_host: Optional[NonEmptyStr] = None
    bind_host: Optional[NonEmptyStr] = None
    allow_open_listeners: bool = False
    tcp_port: Optional[Port] = None
    cma_grant_port: Optional[Port] = None
    gpu_ipc_grant_port: Optional[Port] = None
    moriio_port: Optional[Port] = None
    nixl_ucx_tcp_port_range: Optional[NonEmptyStr] = None

    # --- the sections (atom_kv.config_sections) ----------------------------
    tcp: TcpConfig = msgspec.field(default_factory=TcpConfig)
    staging: StagingConfig = msgspec.field(default_factory=StagingConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    cma: CmaConfig = msgspec.field(default_factory=CmaConfig)
    gpu_ipc: GpuIpcConfig = msgspec.field(default_factory=GpuIpcConfig)
    nixl: NixlConfig = msgspec.field(default_factory=NixlConfig)
    moriio: MoriioConfig = msgspec.field(default_factory=MoriioConfig)

    def __post_init__(self) -> None:
        for key in SECTIONS:
            setattr(self, key, section_from(key, getattr(self, key)))
        names = [n for n in self.__struct_fields__ if n not in SECTIONS]
        try:
            values = convert_fields({name: getattr(self, name) for name in names}, type(self))
        except FieldError as exc:
            raise ConfigError(str(exc)) from None
        for name, value in values.items():
            setattr(self, name, value)  # e.g. an int given for a float key becomes a float
        if self.auth_token is None and self.auth_token_file is not None:
            try:
                self.auth_token = read_token_file(self.auth_token_file, "`auth_token_file`")
            except TokenSourceError as exc:
                raise ConfigError(str(exc)) from None
        if self.post_batch_size == 0:  # the one rule a range cannot say
            raise ConfigError(f"`post_batch_size` must be {_POST_BATCH_SIZE}, got 0")
        reserved = self.limits.tcp_reserved_connections
        if reserved is not None and reserved >= self.tcp.max_connections:
            raise ConfigError(f"`limits.tcp_reserved_connections` must be below `tcp.max_connections` "
                              f"({self.tcp.max_connections}), got {reserved}")
        _check_listener_keys(self)
        _resolve_gpu_ipc_grant_keys(self)
        if self.protocol is not None:
            wanted = _PROTOCOL_BACKEND[self.protocol]
            if self.backend == "auto":
                self.backend = wanted
            elif self.backend != wanted:
                raise ConfigError(f"`protocol` {self.protocol!r} means `backend` {wanted!r}, but `backend` is "
                                  f"{self.backend!r}; give only one of them")

    # --- helpers -----------------------------------------------------------
    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"

    @property
    def is_consumer(self) -> bool:
        return self.kv_role == "kv_consumer"

    @property
    def proxy_addresses(self) -> list[str]:
        """``proxy_ip`` split on commas (one engine may ping several proxies)."""
        if not self.proxy_ip:
            return []
        return [p.strip() for p in self.proxy_ip.split(",") if p.strip()]

    @classmethod
    def from_dict(cls, data: Any, *, default_role: Optional[KVRole] = None) -> "KVTransferConfig":
        """Validate a mapping; raise :class:`ConfigError` with a one-line message.

        A mapping without ``kv_role`` takes ``default_role`` (only an engine
        whose own default that is passes one), else is refused.

        A deprecated flat key (``tcp_streams``) is moved into its section with
        one warning line; given there too with another value, it is refused.

        The token: ``auth_token`` and ``auth_token_file`` together are refused;
        ``auth_token`` inline logs one warning naming ``auth_token_file``; with
        neither, :data:`AUTH_TOKEN_ENV` is read (atom_kv.token_sources).
        """
        if not isinstance(data, dict):
            raise ConfigError(
                f"kv-transfer-config: expected a JSON object like "
                f'{{"kv_role": "kv_producer"}}, got {type(data).__name__}'
            )
        data = _with_extra_config(data)
        if "connectors" in data:
            raise ConfigError(
                "kv-transfer-config: `connectors` configures ATOM's `multi` connector; put atom-kv's keys in one "
                'entry of it, {"kv_connector": "atom_kv", ...}, and `connectors` under "kv_connector": "multi"'
            )
        _check_top_level_keys(data, cls.__struct_fields__)
        if "kv_role" not in data:
            if default_role is None:
                raise ConfigError(KV_ROLE_REQUIRED)
            data = {**data, "kv_role": default_role}
        try:
            return cls(**_with_auth_token(_nest_flat_keys(data)))
        except ConfigError as exc:
            raise ConfigError(f"kv-transfer-config: {exc}") from None

    @classmethod
    def from_resolved(cls, data: Mapping[str, Any]) -> "KVTransferConfig":
        """A config this package built, back from :meth:`to_dict` (e.g. in a rank's process): validated
        again, its token as resolved then (no file or variable read, no warning)."""
        return msgspec.convert(data, cls)

    def to_dict(self) -> dict[str, Any]:
        """Every key, the sections nested (what :meth:`from_resolved` and :meth:`from_dict` read back)."""
        return msgspec.to_builtins(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def _check_top_level_keys(data: Mapping[str, Any], fields: tuple[str, ...]) -> None:
    """Refuse an unknown top-level key in one line, with the closest key (a section's key written dotted)."""
    dotted = {old: f"{s}.{f}" for old, (s, f) in FLAT_KEYS.items()}
    dotted.update({f"{s}.{f}": f"{s}.{f}" for s, f in FLAT_KEYS.values()})
    for key in data:
        if key in fields or key in FLAT_KEYS:
            continue
        if key in dotted:  # "tcp.streams" as one key
            section, _, name = str(key).partition(".")
            raise ConfigError(f"kv-transfer-config: `{key}` is written nested: "
                              f"{json.dumps({section: {name: data[key]}})}")
        names = {**{f: f for f in fields}, **dotted}
        hint = difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.5)
        suggestion = f"; did you mean `{names[hint[0]]}`?" if hint else ""
        raise ConfigError(f"kv-transfer-config: unknown key `{key}`{suggestion}")


def _nest_flat_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with each deprecated flat key moved into its section (one warning line per key); a key given
    flat and nested with different values is an error naming both."""
    flat = [k for k in data if k in FLAT_KEYS]
    if not flat:
        return data
    out = {k: v for k, v in data.items() if k not in FLAT_KEYS}
    for old in flat:
        section, name = FLAT_KEYS[old]
        current = out.get(section, {})
        if not isinstance(current, Mapping):
            section_from(section, current)  # raises: not an object
        value = data[old]
        if name in current and current[name] != value:
            raise ConfigError(f"`{old}` is {value!r} but `{section}.{name}` is {current[name]!r}; give only "
                              f"`{section}.{name}` (`{old}` is deprecated)")
        out[section] = {**current, name: value}
        log.warning("kv-transfer-config: `%s` is deprecated: write %s", old,
                    json.dumps({section: {name: value}}, default=repr))
    return out


#: the engines' ``auth_token`` when the config gives neither ``auth_token`` nor ``auth_token_file``
AUTH_TOKEN_ENV = "ATOM_KV_AUTH_TOKEN"


def _with_auth_token(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with its token resolved (atom_kv.token_sources): ``auth_token_file`` read, else
    ``auth_token`` as given (with one warning), else :data:`AUTH_TOKEN_ENV`."""
    path = data.get("auth_token_file")
    if path is not None:
        try:
            convert_fields({"auth_token_file": path}, KVTransferConfig)
        except FieldError as exc:
            raise ConfigError(str(exc)) from None
    try:
        token = resolve_token(inline=data.get("auth_token"), file=path, env=AUTH_TOKEN_ENV,
                              inline_name="`auth_token`", file_name="`auth_token_file`")
    except TokenSourceError as exc:
        raise ConfigError(str(exc)) from None
    if token.source is TokenSource.INLINE:
        log.warning("kv-transfer-config: %s", inline_warning("`auth_token`", "`auth_token_file`", AUTH_TOKEN_ENV))
    if token.source in (TokenSource.FILE, TokenSource.ENV):
        return {**data, "auth_token": token.value}
    return data


def _check_listener_keys(cfg: "KVTransferConfig") -> None:
    """The rules of the listener keys that their types cannot say."""
    if cfg.advertise_host is not None and is_unspecified(cfg.advertise_host):
        raise ConfigError(f"`advertise_host` {cfg.advertise_host!r} is an unspecified address, which peers cannot "
                          "dial; set it to this host's reachable address (`bind_host` may be 0.0.0.0)")
    if cfg.nixl_ucx_tcp_port_range is not None:
        try:
            parse_port_range(cfg.nixl_ucx_tcp_port_range, "nixl_ucx_tcp_port_range")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _resolve_gpu_ipc_grant_keys(cfg: "KVTransferConfig") -> None:
    """Fill the unset ``gpu_ipc.grant_*`` keys: from the ``cma.grant_*`` key that
    was changed (the old way to set them: one deprecation line per config,
    when gpu_ipc may run), else from the default."""
    borrowed = []
    for name, default in _GPU_IPC_GRANT_ALIASES:
        if getattr(cfg.gpu_ipc, name) is not None:
            continue
        value = getattr(cfg.cma, name)
        if value != default:
            borrowed.append(name)
        setattr(cfg.gpu_ipc, name, value)
    if borrowed and cfg.backend in ("auto", "gpu_ipc"):
        old = ", ".join(f"`cma.{n}` ({getattr(cfg.cma, n)})" for n in borrowed)
        new = ", ".join(f"`gpu_ipc.{n}`" for n in borrowed)
        log.warning("kv-transfer-config: gpu_ipc's grant endpoint takes %s because %s is unset; the cma keys "
                    "are deprecated for gpu_ipc: set %s", old, new, new)


_EXTRA = "kv_connector_extra_config"


def _with_extra_config(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the keys of ``kv_connector_extra_config`` merged in (a key given in both places
    with different values is an error)."""
    if _EXTRA not in data:
        return data
    extra = data[_EXTRA]
    if not isinstance(extra, dict):
        raise ConfigError(f"kv-transfer-config: `{_EXTRA}` must be an object of atom-kv keys, got {extra!r}")
    merged = {k: v for k, v in data.items() if k != _EXTRA}
    for key, value in extra.items():
        if key in SECTIONS and isinstance(merged.get(key), dict) and isinstance(value, dict):
            merged[key] = _merged_section(key, merged[key], value)
            continue
        if key in merged and merged[key] != value:
            raise ConfigError(f"kv-transfer-config: `{key}` is {merged[key]!r} at the top level but {value!r} in "
                              f"`{_EXTRA}`; give it once")
        merged[key] = value
    return merged


def _merged_section(key: str, top: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Section ``key`` given at the top level and in ``kv_connector_extra_config``: their keys together."""
    for name, value in extra.items():
        if name in top and top[name] != value:
            raise ConfigError(f"kv-transfer-config: `{key}.{name}` is {top[name]!r} at the top level but {value!r} "
                              f"in `{_EXTRA}`; give it once")
    return {**top, **extra}


def parse_kv_transfer_config(text: str | None) -> KVTransferConfig | None:
    """Parse the ``--kv-transfer-config`` argument; ``None``/empty means colocated."""
    if text is None or not text.strip():
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"kv-transfer-config: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    return KVTransferConfig.from_dict(data)
