"""The port plan: every TCP port an engine's connector listens on, from its
``--kv-transfer-config`` and its parallel sizes alone.

Each listener kind (:data:`LISTENERS`, the one list of them: a new listener
is added there) has a block of ports. The block starts at its own key
(``tcp_port``, ``cma_grant_port``, ...) or, when that key is unset, at
``handshake_port + slot * STRIDE``; inside a block, rank ``(pp, dp, tp)``
takes ATOM main's side-channel offset
``pp_rank*(dp_size*tp_size) + dp_rank*tp_size + tp_rank``. So two engines
whose ``handshake_port`` ranges do not overlap have plans that do not
overlap either (for blocks under :data:`STRIDE` ranks).

``0`` means "the OS picks": ``handshake_port`` 0 makes every derived port 0,
and a kind's own key set to 0 makes that kind's ports 0. UCX's TCP ports
(the ``nixl`` backend) are a range UCX picks from, ``nixl_ucx_tcp_port_range``.

:func:`planned_ports` lists the plan (``python -m atom_kv.ports`` prints it);
:func:`rank_ports` is what one rank binds; both refuse a plan whose blocks
collide or run past 65535, in one line naming the keys.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple, Optional, TypeVar

from atom_kv._netaddr import parse_port_range as _parse_range
from atom_kv._plural import counted
from atom_kv.config import MAX_PORT, ConfigError

if TYPE_CHECKING:
    from atom_kv.config import KVTransferConfig

__all__ = [
    "LISTENERS",
    "STRIDE",
    "ListenerKind",
    "PlannedListener",
    "FirewallRow",
    "PortInUse",
    "Rank",
    "RankPorts",
    "firewall_rows",
    "listening",
    "parse_port_range",
    "planned_ports",
    "rank_ports",
]

#: ports between the start of one listener kind's block and the next one's
STRIDE = 1000

_PRODUCER = frozenset({"kv_producer"})
_BOTH = frozenset({"kv_producer", "kv_consumer"})


@dataclass(frozen=True)
class ListenerKind:
    """One kind of listener a rank may open: the key that places it, its slot
    (default base ``handshake_port + slot*STRIDE``), the roles and backends
    that open it, and what it serves."""

    name: str
    key: str
    slot: int
    roles: frozenset[str]
    backends: frozenset[str]
    what: str
    #: its ports are a range UCX picks from (the same range for every rank), not one port per rank
    is_range: bool = False
    #: only processes on the same host connect to it (no firewall rule between hosts needed)
    same_host: bool = False
    #: who connects to it: the firewall rule's source
    clients: str = "decode engines"


#: Every listener an engine's connector opens. A new listener must be added here.
LISTENERS: tuple[ListenerKind, ...] = (
    ListenerKind("handshake", "handshake_port", 0, _PRODUCER,
                 frozenset({"auto", "tcp", "cma", "gpu_ipc", "nixl", "moriio"}),
                 "side channel (ZeroMQ): handshakes, done-reading, release, issue and blocks queries",
                 clients="decode engines, and the proxy (releases of prefills it gave up on; none with --no-release)"),
    ListenerKind("tcp", "tcp_port", 1, _PRODUCER, frozenset({"auto", "tcp"}), "tcp backend's read server"),
    ListenerKind("cma", "cma_grant_port", 2, _PRODUCER, frozenset({"auto", "cma"}), "cma grant endpoint",
                 same_host=True, clients="decode engines on this host"),
    ListenerKind("gpu_ipc", "gpu_ipc_grant_port", 3, _PRODUCER, frozenset({"auto", "gpu_ipc"}),
                 "gpu_ipc grant endpoint", same_host=True, clients="decode engines on this host"),
    ListenerKind("moriio", "moriio_port", 4, _BOTH, frozenset({"moriio"}), "MORI-IO IOEngine",
                 clients="peer engines, both ways"),
    ListenerKind("ucx", "nixl_ucx_tcp_port_range", -1, _BOTH, frozenset({"auto", "nixl"}),
                 "UCX TCP transport of the nixl backend (under auto: GPU memory only), one port per UCX "
                 "worker and network device", is_range=True, clients="peer engines, both ways"),
)
_BY_NAME = {k.name: k for k in LISTENERS}


class Rank(NamedTuple):
    """One rank's place: pipeline stage, data-parallel rank, tensor-parallel rank."""

    pp: int
    dp: int
    tp: int

    def __str__(self) -> str:
        return f"pp{self.pp}/dp{self.dp}/tp{self.tp}"


@dataclass(frozen=True)
class PlannedListener:
    """One listener of one rank: ``port`` (0: OS-assigned), or for a range
    listener the range ``port..last_port``; ``key`` is the config key that
    places it. ``rank`` is None for the engine's HTTP port."""

    name: str
    rank: Optional[Rank]
    port: int
    key: str = ""
    last_port: int = -1  # -1: port alone
    offset: int = 0  # the rank's offset inside its kind's block
    what: str = ""

    @property
    def ports(self) -> range:
        """The ports it may bind (empty when OS-assigned)."""
        if self.port == 0:
            return range(0)
        return range(self.port, (self.last_port if self.last_port >= 0 else self.port) + 1)

    def covers(self, port: int) -> bool:
        return port in self.ports

    def describe(self) -> str:
        """``"tcp listener of rank pp0/dp0/tp1 (`tcp_port` + 1)"``."""
        where = f" of rank {self.rank}" if self.rank is not None else ""
        how = f"`{self.key}`" + (f" + {self.offset}" if self.offset else "")
        return f"{self.name} listener{where} ({how})"


class PortInUse(ConfigError):
    """A planned port another process holds (one line naming the key)."""


@dataclass(frozen=True)
class RankPorts:
    """The ports one rank's listeners bind, by listener name (0: OS-assigned)."""

    rank: Rank
    listeners: dict[str, PlannedListener] = field(default_factory=dict)

    def _planned(self, name: str) -> Optional[PlannedListener]:
        if name not in _BY_NAME:  # a listener outside the plan: add its kind to LISTENERS
            raise ValueError(f"listener {name!r} is not in atom_kv.ports.LISTENERS")
        return self.listeners.get(name)

    def port(self, name: str) -> int:
        """The port listener ``name`` binds (0 when unplanned: the OS picks)."""
        planned = self._planned(name)
        return planned.port if planned is not None else 0

    def port_range(self, name: str) -> Optional[tuple[int, int]]:
        """A range listener's ``(first, last)`` port (None: the OS picks)."""
        planned = self._planned(name)
        if planned is None or planned.port == 0:
            return None
        return planned.port, planned.ports[-1]

    def in_use(self, name: str, host: str, exc: BaseException) -> Optional[PortInUse]:
        """The one-line error for listener ``name`` failing to bind ``host`` with ``exc``
        when the cause is a port in use (else None: the caller keeps its own error)."""
        if not _is_addr_in_use(exc):
            return None
        planned = self._planned(name)
        if planned is None or planned.port == 0:
            return None
        move = ("`handshake_port` moves every derived port" if planned.key == "handshake_port" else
                f"`{planned.key}`, or `handshake_port` for every derived port")
        return PortInUse(f"kv-transfer-config: `{planned.key}`: port {planned.port} on {host} is already in use; "
                         f"it is the {planned.describe()}; stop what holds it, or move this engine's ports "
                         f"({move}; `python -m atom_kv.ports` prints the plan)")


_T = TypeVar("_T")


def listening(ports: Optional[RankPorts], name: str, host: str, start: Callable[[int], _T]) -> _T:
    """``start(port)`` with listener ``name``'s planned port (0 without a plan);
    a planned port in use becomes :class:`PortInUse` (one line naming the key)."""
    port = ports.port(name) if ports is not None else 0
    try:
        return start(port)
    except OSError as exc:
        busy = ports.in_use(name, host, exc) if ports is not None else None
        if busy is None:
            raise
        raise busy from None


def _is_addr_in_use(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return True
    return getattr(exc, "errno", None) == errno.EADDRINUSE or "Address already in use" in str(exc)


def parse_port_range(text: str, key: str = "nixl_ucx_tcp_port_range") -> tuple[int, int]:
    """``"40000-40099"`` -> ``(40000, 40099)``; raises :class:`ConfigError` naming ``key``."""
    try:
        return _parse_range(text, key)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# --------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------
def _offset(rank: Rank, dp_size: int, tp_size: int) -> int:
    """ATOM main's side-channel offset (``wire.handshake_port`` uses the same)."""
    return rank.pp * (dp_size * tp_size) + rank.dp * tp_size + rank.tp


def _opened(kind: ListenerKind, config: "KVTransferConfig") -> bool:
    return config.kv_role in kind.roles and config.backend in kind.backends


def _bases(config: "KVTransferConfig", world: int) -> dict[str, tuple[int, str]]:
    """Each opened kind's (base port, how it was placed); refuses blocks past 65535 or colliding."""
    out: dict[str, tuple[int, str]] = {}
    for kind in LISTENERS:
        if not _opened(kind, config):
            continue
        own = getattr(config, kind.key)
        if kind.is_range:
            out[kind.name] = (parse_port_range(own, kind.key)[0], kind.key) if own else (0, kind.key)
            continue
        if own is not None:
            base, how = own, f"`{kind.key}`"
        elif config.handshake_port == 0:
            base, how = 0, f"`{kind.key}`"
        else:
            base, how = config.handshake_port + kind.slot * STRIDE, f"`handshake_port` + {kind.slot * STRIDE}"
        if base and base + world - 1 > MAX_PORT:
            hint = "" if own is not None else f"; set `{kind.key}` or a lower `handshake_port`"
            raise ConfigError(f"kv-transfer-config: the {kind.name} ports ({how} = {base}, one per rank, "
                              f"{counted(world, 'rank')}) run past {MAX_PORT}{hint}")
        out[kind.name] = (base, how)
    _check_collisions(config, out, world)
    return out


def _block(config: "KVTransferConfig", name: str, base: int, world: int) -> range:
    kind = _BY_NAME[name]
    if base == 0:
        return range(0)
    if kind.is_range:
        lo, hi = parse_port_range(getattr(config, kind.key), kind.key)
        return range(lo, hi + 1)
    return range(base, base + world)


def _check_collisions(config: "KVTransferConfig", bases: dict[str, tuple[int, str]], world: int) -> None:
    names = list(bases)
    for i, a in enumerate(names):
        ra = _block(config, a, bases[a][0], world)
        for b in names[i + 1:]:
            rb = _block(config, b, bases[b][0], world)
            if ra and rb and ra.start < rb.stop and rb.start < ra.stop:
                ka, kb = _BY_NAME[a].key, _BY_NAME[b].key
                raise ConfigError(
                    f"kv-transfer-config: the {a} ports {ra.start}..{ra.stop - 1} ({bases[a][1]}) and the {b} ports "
                    f"{rb.start}..{rb.stop - 1} ({bases[b][1]}) overlap ({counted(world, 'rank')}); set `{ka}` and "
                    f"`{kb}` to blocks at least {counted(world, 'port')} apart")


def _sizes(pp_size: int, dp_size: int, tp_size: int) -> int:
    for label, size in (("pp_size", pp_size), ("dp_size", dp_size), ("tp_size", tp_size)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{label} must be an integer >= 1, got {size!r}")
    world = pp_size * dp_size * tp_size
    if world > STRIDE:
        raise ConfigError(f"kv-transfer-config: {world} ranks (pp*dp*tp) do not fit the port plan's blocks of "
                          f"{STRIDE} ports per listener kind")
    return world


def _listeners_of(config: "KVTransferConfig", rank: Rank, bases: dict[str, tuple[int, str]], dp_size: int,
                  tp_size: int) -> list[PlannedListener]:
    out = []
    off = _offset(rank, dp_size, tp_size)
    for name, (base, _) in bases.items():
        kind = _BY_NAME[name]
        if kind.is_range:
            block = _block(config, name, base, 0)
            out.append(PlannedListener(name, rank, block.start if block else 0, kind.key,
                                       last_port=block.stop - 1 if block else -1, what=kind.what))
        else:
            out.append(PlannedListener(name, rank, base + off if base else 0, kind.key,
                                       offset=off if base else 0, what=kind.what))
    return out


def planned_ports(config: "KVTransferConfig", *, pp_size: int = 1, dp_size: int = 1, tp_size: int = 1,
                  http_port: Optional[int] = None) -> list[PlannedListener]:
    """Every listener of an engine with this config and these sizes, rank by rank
    (ranks in ATOM's order: pp, then dp, then tp); with ``http_port``, the
    engine's HTTP port first (rank None). A port 0 is OS-assigned (not planned).
    Raises :class:`~atom_kv.config.ConfigError` when blocks collide or run past 65535."""
    world = _sizes(pp_size, dp_size, tp_size)
    bases = _bases(config, world)
    out = []
    if http_port is not None:
        out.append(PlannedListener("http", None, http_port, "http_port", what="the engine's HTTP API"))
    for pp in range(pp_size):
        for dp in range(dp_size):
            for tp in range(tp_size):
                out.extend(_listeners_of(config, Rank(pp, dp, tp), bases, dp_size, tp_size))
    return out


def rank_ports(config: "KVTransferConfig", *, pp_rank: int = 0, dp_rank: int = 0, tp_rank: int = 0,
               pp_size: int = 1, dp_size: int = 1, tp_size: int = 1) -> RankPorts:
    """What one rank binds (see :func:`planned_ports`)."""
    world = _sizes(pp_size, dp_size, tp_size)
    bases = _bases(config, world)
    rank = Rank(pp_rank, dp_rank, tp_rank)
    return RankPorts(rank, {p.name: p for p in _listeners_of(config, rank, bases, dp_size, tp_size)})


class FirewallRow(NamedTuple):
    """One rule of a host's firewall: a listener kind, its ports, who must reach them, and what for."""

    listener: str
    ports: str
    allow_from: str
    what: str


#: who reaches the engine's HTTP port
HTTP_CLIENTS = "the proxy"


def firewall_rows(plan: Iterable[PlannedListener]) -> list[FirewallRow]:
    """One row per listener kind, ranks' ports merged into ranges."""
    by_name: dict[str, list[PlannedListener]] = {}
    for p in plan:
        by_name.setdefault(p.name, []).append(p)
    rows = []
    for name, items in by_name.items():
        ports = sorted({q for p in items for q in p.ports})
        if not ports:
            text = "OS-assigned (not planned)"
        elif ports == list(range(ports[0], ports[-1] + 1)):
            text = str(ports[0]) if len(ports) == 1 else f"{ports[0]}-{ports[-1]}"
        else:
            text = ",".join(str(q) for q in ports)
        kind = _BY_NAME.get(name)
        note = " (same host only)" if kind is not None and kind.same_host else ""
        rows.append(FirewallRow(name, text, kind.clients if kind is not None else HTTP_CLIENTS,
                                items[0].what + note))
    return rows
