"""The sections of ``--kv-transfer-config``: one msgspec Struct per backend
or concern (``{"tcp": {"streams": 8}}``), each with its own defaults, and the
flat keys of 0.1 they replace.

A section validates itself when it is made: a bad value is one
:class:`~atom_kv.config_types.ConfigError` naming the dotted key
("`tcp.streams` must be >= 1, got 0"). :func:`section_from` makes one from a
mapping, refusing what is not an object and unknown keys (with the closest
key of that section). :data:`FLAT_KEYS` maps each deprecated flat key
(``tcp_streams``) to its section and field; they are read for one release.
"""

from __future__ import annotations

import difflib
import json
import types
from typing import Annotated, Any, ClassVar, Literal, Mapping, Optional

import msgspec

from atom_kv.config_types import (
    ConfigError,
    FieldError,
    NonEmptyStr,
    NonNegativeInt,
    PositiveInt,
    PositiveSeconds,
    RangesPerRequest,
    convert_fields,
)

__all__ = [
    "FLAT_KEYS",
    "MAX_CHALLENGES",
    "SECTIONS",
    "CmaConfig",
    "GpuIpcConfig",
    "LimitsConfig",
    "MoriioConfig",
    "NixlConfig",
    "StagingConfig",
    "TcpConfig",
    "section_from",
]

#: bytes per staging buffer (one piece of a staged tcp request)
MIN_STAGING_PIECE_BYTES, MAX_STAGING_PIECE_BYTES = 64 << 10, 1 << 30
StagingPieceBytes = Annotated[int, msgspec.Meta(
    ge=MIN_STAGING_PIECE_BYTES, le=MAX_STAGING_PIECE_BYTES,
    description=f"a number of bytes in {MIN_STAGING_PIECE_BYTES}..{MAX_STAGING_PIECE_BYTES}")]
#: staging buffers in one ring (one connection's pipeline)
StagingRingBuffers = Annotated[int, msgspec.Meta(ge=2, le=16)]
#: how long a gpu_ipc ``wait()`` may query its fences before it blocks
MAX_WAIT_SPIN_US = 1000.0
SpinMicroseconds = Annotated[float, msgspec.Meta(
    ge=0, le=MAX_WAIT_SPIN_US, description=f"a number of microseconds in 0..{MAX_WAIT_SPIN_US:g}")]
NixlPlugins = Annotated[
    list[NonEmptyStr], msgspec.Meta(min_length=1, description="a non-empty list of NIXL plugin names, e.g. [\"UCX\"]")
]
PollCqMode = Literal["polling", "event"]
MoriIOTransport = Literal["rdma", "xgmi"]

#: challenges a producer rank's handshake port keeps pending in all (atom_kv.connector.handshake.MAX_CHALLENGES)
MAX_CHALLENGES = 4096
GRANT_TIMEOUT_S = 3.0
GRANT_MAX_CONNECTIONS = 64


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One section of the config: its fields validated when it is made, each
    error naming the dotted key. ``key`` is the section's name in the JSON;
    ``flat_prefix`` what its fields' deprecated flat keys start with."""

    key: ClassVar[str]
    flat_prefix: ClassVar[str]
    #: field -> its deprecated flat key, where that is not ``flat_prefix + field``
    flat_renames: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __post_init__(self) -> None:
        try:
            values = convert_fields({n: getattr(self, n) for n in self.__struct_fields__}, type(self),
                                    prefix=f"{self.key}.")
        except FieldError as exc:
            raise ConfigError(str(exc)) from None
        for name, value in values.items():
            setattr(self, name, value)  # e.g. an int given for a float key becomes a float
        self._check()

    def _check(self) -> None:
        """The rules of this section that its types cannot say."""


class TcpConfig(Section, kw_only=True, forbid_unknown_fields=True):
    """The ``tcp`` backend: the reader's connections per peer, and its read
    server's threads, connection bounds and timeouts."""

    key = "tcp"
    flat_prefix = "tcp_"
    streams: PositiveInt = 4
    server_threads: PositiveInt = 4
    max_connections: PositiveInt = 512
    max_ranges_per_request: RangesPerRequest = 8192
    read_timeout_s: PositiveSeconds = 10.0
    hello_timeout_s: PositiveSeconds = 2.0
    max_unauthenticated_per_source: PositiveInt = 64
    idle_timeout_s: PositiveSeconds = 300.0


class StagingConfig(Section, kw_only=True, forbid_unknown_fields=True):
    """Staged ``tcp`` (GPU memory through pinned host buffers): the buffers' size and how many."""

    key = "staging"
    flat_prefix = "staging_"
    piece_bytes: StagingPieceBytes = 1 << 20
    pool_pairs: Optional[PositiveInt] = None  # rings; None: tcp.server_threads + tcp.streams
    ring_buffers: StagingRingBuffers = 4


class LimitsConfig(Section, kw_only=True, forbid_unknown_fields=True):
    """The pre-authentication fair shares of a producer rank's ports (docs/security.md):
    what strangers may make them hold, and what is kept for peers that proved the token before."""

    key = "limits"
    flat_prefix = ""
    handshake_max_connections: PositiveInt = 1024
    handshake_max_unproven_connections_per_source: PositiveInt = 64
    handshake_max_challenges_per_source: PositiveInt = 64
    handshake_reserved_challenges: NonNegativeInt = 1024
    tcp_reserved_connections: Optional[NonNegativeInt] = None  # None: tcp.max_connections // 8
    rendezvous_max_waiting_per_source: PositiveInt = 256

    def _check(self) -> None:
        if self.handshake_reserved_challenges >= MAX_CHALLENGES:
            raise ConfigError(f"`limits.handshake_reserved_challenges` must be below {MAX_CHALLENGES} (the "
                              f"challenges a producer rank keeps in all), got {self.handshake_reserved_challenges}")


class CmaConfig(Section, kw_only=True, forbid_unknown_fields=True):
    """The ``cma`` backend's grant endpoint: how long a request may take, how many connections at once."""

    key = "cma"
    flat_prefix = "cma_"
    grant_timeout_s: PositiveSeconds = GRANT_TIMEOUT_S
    grant_max_connections: PositiveInt = GRANT_MAX_CONNECTIONS


class GpuIpcConfig(Section, kw_only=True, forbid_unknown_fields=True):
    """The ``gpu_ipc`` backend: its grant endpoint, and how long a read handle polls before it blocks."""

    key = "gpu_ipc"
    flat_prefix = "gpu_ipc_"
    # None: the default, or (deprecated, one release) the cma value when that was changed
    grant_timeout_s: Optional[PositiveSeconds] = None
    grant_max_connections: Optional[PositiveInt] = None
    wait_spin_us: SpinMicroseconds = 50.0


class NixlConfig(Section, kw_only=True, forbid_unknown_fields=True):
    """The ``nixl`` backend: the NIXL agent's plugins and threads, and UCX's hints."""

    key = "nixl"
    flat_prefix = "nixl_"
    plugins: NixlPlugins = msgspec.field(default_factory=lambda: ["UCX"])
    progress_threads: NonNegativeInt = 0
    ucx_tls: Optional[NonEmptyStr] = None
    ucx_proto_info: bool = False


class MoriioConfig(Section, kw_only=True, forbid_unknown_fields=True):
    """The ``moriio`` backend's own keys (ATOM's RDMA tuning keys stay at the top level, as ATOM writes them)."""

    key = "moriio"
    flat_prefix = "moriio_"
    flat_renames = (("transport", "moriio_backend"), ("poll_cq_mode", "poll_cq_mode"))
    transport: MoriIOTransport = "rdma"
    poll_cq_mode: PollCqMode = "polling"


#: every section by its key, in the order the docs list them
SECTIONS: dict[str, type[Section]] = {
    cls.key: cls for cls in (TcpConfig, StagingConfig, LimitsConfig, CmaConfig, GpuIpcConfig, NixlConfig,
                             MoriioConfig)
}


def _flat_keys() -> dict[str, tuple[str, str]]:
    out = {}
    for cls in SECTIONS.values():
        renames = dict(cls.flat_renames)
        for name in cls.__struct_fields__:
            out[renames.get(name, cls.flat_prefix + name)] = (cls.key, name)
    return out


#: deprecated flat key (0.1) -> (section, field)
FLAT_KEYS: Mapping[str, tuple[str, str]] = types.MappingProxyType(_flat_keys())


def _example(cls: type[Section]) -> str:
    """``{"streams": 4}``: the section's first field and its default, as JSON."""
    first = cls.__struct_fields__[0]
    return json.dumps({first: msgspec.to_builtins(getattr(cls(), first))})


def section_from(key: str, value: Any) -> Section:
    """Section ``key`` made from ``value`` (an instance is taken as it is, a mapping validated); a value that is
    not an object, or an unknown key in it, is one :class:`ConfigError` line."""
    cls = SECTIONS[key]
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"`{key}` must be an object of {key} keys like {_example(cls)}, got {value!r}")
    for name in value:
        if name not in cls.__struct_fields__:
            hint = difflib.get_close_matches(str(name), cls.__struct_fields__, n=1, cutoff=0.5)
            suggestion = f"; did you mean `{key}.{hint[0]}`?" if hint else ""
            raise ConfigError(f"unknown key `{key}.{name}`{suggestion}")
    return cls(**value)
