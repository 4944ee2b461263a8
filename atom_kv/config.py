"""The schema of ``--kv-transfer-config '<json>'``, its validation, and the
constrained field types the rest of the package shares.

Every bad input becomes one :class:`ConfigError` whose message is a single
line naming the key and saying what is allowed. Use :func:`parse_kv_transfer_config`
for JSON text and :meth:`KVTransferConfig.from_dict` for a mapping.

Ranges live in the types (``Annotated[int, msgspec.Meta(ge=..., le=...)]``,
declared once below); msgspec checks them, and :func:`convert_fields` turns a
failure into a line naming the key by converting the fields one at a time.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import sys
import types
from typing import Annotated, Any, Literal, Mapping, Optional, Union, get_args, get_origin

import msgspec

from atom_kv._netaddr import is_unspecified, parse_port_range
from atom_kv.token_sources import TokenSource, TokenSourceError, inline_warning, read_token_file, resolve_token

__all__ = [
    "AUTH_TOKEN_ENV",
    "MAX_PORT",
    "MAX_RANGES_PER_REQUEST",
    "ConfigError",
    "FieldError",
    "KVTransferConfig",
    "NonEmptyStr",
    "NonNegativeFloat",
    "NonNegativeInt",
    "PeerPort",
    "Port",
    "PositiveInt",
    "PositiveSeconds",
    "RangesPerRequest",
    "convert_fields",
    "describe_type",
    "is_port",
    "parse_kv_transfer_config",
    "validate_fields",
]

# --------------------------------------------------------------------------
# Constrained types: the one place each range is written down. The
# description is what an error message says is allowed.
# --------------------------------------------------------------------------
MAX_PORT = 65535
_MAX_FLOAT = sys.float_info.max  # an upper bound keeps inf out (nan fails every bound)

#: a port to listen on; 0 lets the OS pick
Port = Annotated[int, msgspec.Meta(ge=0, le=MAX_PORT, description=f"a TCP port in 0..{MAX_PORT}")]
#: a port to connect to
PeerPort = Annotated[int, msgspec.Meta(ge=1, le=MAX_PORT, description=f"a TCP port in 1..{MAX_PORT}")]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=_MAX_FLOAT, description="a positive number of seconds")]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0, le=_MAX_FLOAT, description=">= 0")]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0, description=">= 0")]
PositiveInt = Annotated[int, msgspec.Meta(ge=1, description=">= 1")]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1, description="a non-empty string")]
#: ranges one tcp read request may name (bounds the request frames a read server accepts)
MAX_RANGES_PER_REQUEST = 1 << 20
RangesPerRequest = Annotated[
    int, msgspec.Meta(ge=1, le=MAX_RANGES_PER_REQUEST, description=f"an integer in 1..{MAX_RANGES_PER_REQUEST}")
]

#: bytes per staging buffer (one piece of a staged tcp request)
MIN_STAGING_PIECE_BYTES, MAX_STAGING_PIECE_BYTES = 64 << 10, 1 << 30
StagingPieceBytes = Annotated[int, msgspec.Meta(
    ge=MIN_STAGING_PIECE_BYTES, le=MAX_STAGING_PIECE_BYTES,
    description=f"a number of bytes in {MIN_STAGING_PIECE_BYTES}..{MAX_STAGING_PIECE_BYTES}")]

#: how long a gpu_ipc ``wait()`` may query its fences before it blocks
MAX_WAIT_SPIN_US = 1000.0
SpinMicroseconds = Annotated[float, msgspec.Meta(
    ge=0, le=MAX_WAIT_SPIN_US, description=f"a number of microseconds in 0..{MAX_WAIT_SPIN_US:g}")]

#: staging buffers in one ring (one connection's pipeline)
StagingRingBuffers = Annotated[int, msgspec.Meta(ge=2, le=16, description="an integer in 2..16")]

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
PollCqMode = Literal["polling", "event"]
MoriIOTransport = Literal["rdma", "xgmi"]
NixlPlugins = Annotated[
    list[NonEmptyStr], msgspec.Meta(min_length=1, description="a non-empty list of NIXL plugin names, e.g. [\"UCX\"]")
]


def is_port(value: Any, *, allow_zero: bool = True) -> bool:
    """True when ``value`` is an int in 0..65535 (1..65535 without ``allow_zero``)."""
    try:
        msgspec.convert(value, Port if allow_zero else PeerPort)
    except msgspec.ValidationError:
        return False
    return True


# --------------------------------------------------------------------------
# Field-by-field conversion: msgspec validates, we name the key.
# --------------------------------------------------------------------------
class FieldError(ValueError):
    """One field of a mapping failed validation; ``key`` names it and the
    message says what is allowed: "`key` must be <allowed>, got <value>"."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def describe_type(tp: Any) -> str:
    """What values of type ``tp`` look like, in words ("an integer or null")."""
    origin = get_origin(tp)
    if origin is Annotated:
        return describe_type(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        words = " or ".join(describe_type(a) for a in args if a is not type(None))
        return f"{words} or null" if type(None) in args else words
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in get_args(tp))
    return _TYPE_WORDS.get(origin or tp, getattr(tp, "__name__", str(tp)))


_TYPE_WORDS: dict[Any, str] = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    type(None): "null",
    list: "a list",
    dict: "an object",
}


def _constraint_words(tp: Any) -> Optional[str]:
    """The ``Meta(description=...)`` of the first constrained part of ``tp``."""
    origin = get_origin(tp)
    if origin is Annotated:
        for meta in get_args(tp)[1:]:
            if isinstance(meta, msgspec.Meta) and meta.description:
                return meta.description
        return _constraint_words(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        return next((w for a in get_args(tp) if (w := _constraint_words(a))), None)
    return None


def _unconstrained(tp: Any) -> Any:
    """``tp`` with every ``Annotated`` constraint removed (same shape)."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _unconstrained(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        return Union[tuple(_unconstrained(a) for a in get_args(tp))]
    if origin is list:
        return list[_unconstrained(get_args(tp)[0])]  # type: ignore[misc]
    return tp


class _Field(msgspec.Struct, frozen=True):
    type: Any
    bare: Any
    type_words: str
    range_words: str


@functools.lru_cache(maxsize=None)
def _fields_of(cls: type) -> dict[str, _Field]:
    out = {}
    for f in msgspec.structs.fields(cls):
        words = describe_type(f.type)
        out[f.name] = _Field(f.type, _unconstrained(f.type), words, _constraint_words(f.type) or words)
    return out


def convert_fields(data: Mapping[str, Any], cls: type) -> dict[str, Any]:
    """``data``'s values for the fields of Struct ``cls``, each converted by
    msgspec to its declared (constrained) type; other keys are left out.

    Raises :class:`FieldError` for the first key whose value has the wrong
    type ("`key` must be an integer, got '7'") or, when all types are right,
    the first one out of range ("`key` must be a TCP port in 0..65535, got 70000",
    showing the value as converted).
    """
    out, errors = validate_fields(data, cls)
    if errors:
        raise errors[0]
    return out


def validate_fields(data: Mapping[str, Any], cls: type) -> tuple[dict[str, Any], list[FieldError]]:
    """Each of ``data``'s values for the fields of Struct ``cls`` checked on its
    own: the converted values of the keys that validate (other keys are left
    out), and one :class:`FieldError` per key that does not, those of the wrong
    type first, then those out of range, each group in ``data``'s order (so
    the first is what :func:`convert_fields` raises)."""
    fields = _fields_of(cls)
    out: dict[str, Any] = {}
    wrong_type: list[FieldError] = []
    out_of_range: list[FieldError] = []
    for key, value in data.items():
        field = fields.get(key)
        if field is None:
            continue
        try:
            out[key] = msgspec.convert(value, field.type)
            continue
        except msgspec.ValidationError:
            pass
        try:
            shown = msgspec.convert(value, field.bare)
        except msgspec.ValidationError:
            wrong_type.append(FieldError(key, f"`{key}` must be {field.type_words}, got {value!r}"))
        else:
            out_of_range.append(FieldError(key, f"`{key}` must be {field.range_words}, got {shown!r}"))
    return out, wrong_type + out_of_range


# --------------------------------------------------------------------------
# The config
# --------------------------------------------------------------------------
#: challenges a producer rank's handshake port keeps pending in all (atom_kv.connector.handshake.MAX_CHALLENGES)
_MAX_CHALLENGES = 4096


class ConfigError(ValueError):
    """A ``--kv-transfer-config`` problem, phrased for the operator in one line."""


log = logging.getLogger(__name__)

_GRANT_TIMEOUT_S = 3.0
_GRANT_MAX_CONNECTIONS = 64
#: gpu_ipc's grant keys, each with the cma key it took its value from before it had its own, and the default
_GPU_IPC_GRANT_ALIASES = (
    ("gpu_ipc_grant_timeout_s", "cma_grant_timeout_s", _GRANT_TIMEOUT_S),
    ("gpu_ipc_grant_max_connections", "cma_grant_max_connections", _GRANT_MAX_CONNECTIONS),
)


class KVTransferConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything ``--kv-transfer-config`` can set; owns the defaults.

    The first group of keys is ATOM's, with ATOM main's defaults (its MoRIIO
    and Mooncake connectors', checked at ffdf3bb5d) so an ATOM launch line
    works unchanged; the second group is ours. Constructing one validates
    every field (:class:`ConfigError` naming the key).

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
    auth_token: Optional[str] = None
    # a file holding auth_token (mode 0600; read at construction when auth_token is unset)
    auth_token_file: Optional[NonEmptyStr] = None
    auth_window_s: PositiveSeconds = 30.0
    auth_replay_entries: PositiveInt = 65536
    tcp_streams: PositiveInt = 4
    tcp_server_threads: PositiveInt = 4
    tcp_max_connections: PositiveInt = 512
    tcp_max_ranges_per_request: RangesPerRequest = 8192
    tcp_read_timeout_s: PositiveSeconds = 10.0
    tcp_hello_timeout_s: PositiveSeconds = 2.0
    tcp_max_unauthenticated_per_source: PositiveInt = 64
    tcp_idle_timeout_s: PositiveSeconds = 300.0
    cma_grant_timeout_s: PositiveSeconds = _GRANT_TIMEOUT_S
    cma_grant_max_connections: PositiveInt = _GRANT_MAX_CONNECTIONS
    # None: the default above, or (deprecated) the cma_grant_* value when that was changed
    gpu_ipc_grant_timeout_s: Optional[PositiveSeconds] = None
    gpu_ipc_grant_max_connections: Optional[PositiveInt] = None
    gpu_ipc_wait_spin_us: SpinMicroseconds = 50.0
    staging_piece_bytes: StagingPieceBytes = 1 << 20
    staging_pool_pairs: Optional[PositiveInt] = None  # rings; None: tcp_server_threads + tcp_streams
    staging_ring_buffers: StagingRingBuffers = 4
    # --- pre-authentication fair shares (docs/security.md) ---
    handshake_max_connections: PositiveInt = 1024
    handshake_max_unproven_connections_per_source: PositiveInt = 64
    handshake_max_challenges_per_source: PositiveInt = 64
    handshake_reserved_challenges: NonNegativeInt = 1024
    tcp_reserved_connections: Optional[NonNegativeInt] = None  # None: tcp_max_connections // 8
    rendezvous_max_waiting_per_source: PositiveInt = 256
    moriio_backend: MoriIOTransport = "rdma"
    poll_cq_mode: PollCqMode = "polling"
    nixl_plugins: NixlPlugins = msgspec.field(default_factory=lambda: ["UCX"])
    nixl_progress_threads: NonNegativeInt = 0
    nixl_ucx_tls: Optional[NonEmptyStr] = None
    nixl_ucx_proto_info: bool = False
    # --- listeners and addresses (the port plan: atom_kv.ports) -------------
    advertise_host: Optional[NonEmptyStr] = None
    bind_host: Optional[NonEmptyStr] = None
    allow_open_listeners: bool = False
    tcp_port: Optional[Port] = None
    cma_grant_port: Optional[Port] = None
    gpu_ipc_grant_port: Optional[Port] = None
    moriio_port: Optional[Port] = None
    nixl_ucx_tcp_port_range: Optional[NonEmptyStr] = None

    def __post_init__(self) -> None:
        names = self.__struct_fields__
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
        self._check_shares()
        _check_listener_keys(self)
        _resolve_gpu_ipc_grant_keys(self)
        if self.protocol is not None:
            wanted = _PROTOCOL_BACKEND[self.protocol]
            if self.backend == "auto":
                self.backend = wanted
            elif self.backend != wanted:
                raise ConfigError(f"`protocol` {self.protocol!r} means `backend` {wanted!r}, but `backend` is "
                                  f"{self.backend!r}; give only one of them")

    def _check_shares(self) -> None:
        """The pre-authentication reserves must leave room for strangers' connections and challenges."""
        if self.handshake_reserved_challenges >= _MAX_CHALLENGES:
            raise ConfigError(f"`handshake_reserved_challenges` must be below {_MAX_CHALLENGES} (the challenges a "
                              f"producer rank keeps in all), got {self.handshake_reserved_challenges}")
        if self.tcp_reserved_connections is not None and self.tcp_reserved_connections >= self.tcp_max_connections:
            raise ConfigError(f"`tcp_reserved_connections` must be below `tcp_max_connections` "
                              f"({self.tcp_max_connections}), got {self.tcp_reserved_connections}")

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
        fields = set(cls.__struct_fields__)
        for key in data:
            if key not in fields:
                hint = difflib.get_close_matches(str(key), sorted(fields), n=1, cutoff=0.5)
                suggestion = f"; did you mean `{hint[0]}`?" if hint else ""
                raise ConfigError(f"kv-transfer-config: unknown key `{key}`{suggestion}")
        if "kv_role" not in data:
            if default_role is None:
                raise ConfigError(KV_ROLE_REQUIRED)
            data = {**data, "kv_role": default_role}
        try:
            return cls(**_with_auth_token(data))
        except ConfigError as exc:
            raise ConfigError(f"kv-transfer-config: {exc}") from None

    @classmethod
    def from_resolved(cls, data: Mapping[str, Any]) -> "KVTransferConfig":
        """A config this package built, back from :meth:`to_dict` (e.g. in a rank's process): validated
        again, its token as resolved then (no file or variable read, no warning)."""
        return msgspec.convert(data, cls)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


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
    """Fill the unset ``gpu_ipc_grant_*`` keys: from the ``cma_grant_*`` key that
    was changed (the old way to set them: one deprecation line per config,
    when gpu_ipc may run), else from the default."""
    borrowed = []
    for new, old, default in _GPU_IPC_GRANT_ALIASES:
        if getattr(cfg, new) is not None:
            continue
        value = getattr(cfg, old)
        if value != default:
            borrowed.append((new, old))
        setattr(cfg, new, value)
    if borrowed and cfg.backend in ("auto", "gpu_ipc"):
        old = ", ".join(f"`{o}` ({getattr(cfg, o)})" for _, o in borrowed)
        new = ", ".join(f"`{n}`" for n, _ in borrowed)
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
        if key in merged and merged[key] != value:
            raise ConfigError(f"kv-transfer-config: `{key}` is {merged[key]!r} at the top level but {value!r} in "
                              f"`{_EXTRA}`; give it once")
        merged[key] = value
    return merged


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
