"""Known engine instances: registration, health state, liveness expiry, load counters, circuit state.

Everything here runs on the proxy's event loop (discovery, the health
monitor and the relay all live there), so there are no locks.

An instance is routable when it is *live* (heard from, by ping or probe,
within ``heartbeat_timeout``) and *up* (its last probe or request did not
fail at the connection level). New instances start *pending* (starting)
until a probe reaches them, whatever the probes before found: an engine may
register before its server listens, and that is not "down". An instance that
was up and whose connection is refused or reset goes *down* at once and comes
back on the next successful probe. A *draining* instance (:class:`Drain`: the operator's
``POST /workers/drain``, its own ping saying it is leaving, or its DNS name no longer naming it)
gets no new legs; the legs it has finish. Why a probe did not reach an instance is
its ``down_reason`` and, as a kind, its ``probe_failure``
(:class:`ProbeFailure`); a probe that times out (packets dropped on the way,
or an engine that accepts and never answers) is logged as a WARNING once per
instance and change, not once per probe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Callable

from yarl import URL

from atom_kv._ratelimit import RateLimitedLog
from atom_kv.proxy.fleet.breaker import CircuitBreaker
from atom_kv.proxy.fleet.static import Role, StaticEngine

logger = logging.getLogger(__name__)

ROLE_NAMES = {"P": "prefill", "D": "decode"}

PENDING, UP, DOWN = "pending", "up", "down"
STALE_INTERVALS = 3  # a ReportedLoad older than this many --engine-load-interval is stale


class ProbeFailure(Enum):
    """How a health probe failed to reach an instance (``down_reason`` says it in words)."""

    REFUSED = "refused"  # refused, reset or closed: nothing serves at that address
    ERROR = "error"  # the engine answered 5xx: there, but not serving
    TIMED_OUT = "timed out"  # no connection or no answer in time: packets dropped (a firewall), or a hung engine


class Origin(Enum):
    """Where the proxy learnt of an instance (``source`` in ``GET /workers``)."""

    STATIC = "static"  # --prefill/--decode
    PING = "ping"  # a registration ping (ATOM or MoRIIO format)
    DNS = "dns"  # an A record of --prefill-dns/--decode-dns
    API = "api"  # POST /workers (or /add_worker)


class Drain(Enum):
    """Why an instance takes no new legs while its in-flight ones finish."""

    OPERATOR = "operator"  # POST /workers/drain: kept across its pings until it is removed
    DNS = "dns"  # its address left its DNS name: removed once idle


class Withdrawn(Exception):
    """A ping from an engine the operator drained and removed: not registered again while it keeps pinging."""


class RegistryFull(Exception):
    """No room for another discovered instance (``max_instances`` live and up)."""


@dataclass(frozen=True)
class LastError:
    """An instance's latest failure as the operator sees it (its address and its own error text), shown
    in ``/instances``; a client is told less (:class:`~atom_kv.proxy.relay.errors.EngineFailures`)."""

    message: str
    at: float  # wall-clock seconds


@dataclass(frozen=True)
class Registration:
    """What an instance is, as its ping, its ``--prefill``/``--decode`` spec or its probes say (format-independent).

    An :class:`Instance` holds one and replaces it whole when it learns more (:meth:`Instance.learn`)."""

    role: Role
    base_url: str
    host: str
    http_port: int
    handshake_port: int | None
    dp_size: int
    tp_size: int
    index: str = "0"
    engine_id: str | None = None
    model: str | None = None
    notify_port: int | None = None
    source: str = "atom"  # "atom" / "moriio" ping, or "static"
    features: frozenset[str] | None = None  # ``kv_features`` (ping or /health); None: nothing said yet
    draining: bool = False  # its latest ping said it is leaving (first SIGTERM): no new legs
    kv_events: str | None = None  # the KV event publisher of DP rank 0 (checked tcp://HOST:PORT); None: none
    kv_events_replay: str | None = None  # ... and its replay endpoint


@dataclass(frozen=True)
class ReportedLoad:
    """What one DP rank of an engine says it is doing (its ``/health``, or ``/metrics`` for vLLM), read by
    the proxy at an interval: every request it runs or queues, whoever sent them (another proxy replica,
    traffic that bypasses the proxy), unlike the proxy's own in-flight counters.

    Filled by :class:`~atom_kv.proxy.fleet.load.LoadReader` every ``--engine-load-interval`` seconds (and by
    the health probes of static engines); a failed read keeps the last one, so a reading older than a few
    intervals (``STALE_INTERVALS``) is stale: the reader keeps ``at`` and the consumer decides. Readings are
    cleared when the engine restarts (a new engine id), goes down, or leaves."""

    requests: int  # running + waiting
    prompt_tokens: int  # the prompt tokens of those requests still to prefill (0 when the engine does not say)
    at: float  # time.monotonic() of the reading


@dataclass
class _Routable:
    """One role's live instances as last computed, and until when that list stays right without a change:
    the moment its least recently heard member would pass the heartbeat timeout."""

    instances: list["Instance"]
    computed_at: float
    valid_until: float


@dataclass
class Instance:
    """One engine (rank 0 of a P or D deployment): what it is (its :class:`Registration`), its health and its
    live load (the in-flight legs and their tokens per DP rank, changed only through
    :class:`~atom_kv.proxy.routing.pick.Charge`)."""

    reg: Registration
    breaker: CircuitBreaker
    state: str = PENDING
    origin: Origin = Origin.PING
    drain: Drain | None = None  # drained by the operator or by DNS (a ping's ``draining`` is ``reg.draining``)
    down_reason: str = ""
    last_error: LastError | None = None  # the latest failed exchange with it (set by the relay)
    probe_failure: ProbeFailure | None = None  # the kind of the last failed probe (None: reached, or not probed)
    expired: bool = False  # static only: silent past the heartbeat timeout (counted once)
    last_seen: float = 0.0
    last_seen_wall: float = 0.0
    max_model_len: int | None = None  # from the engine's /v1/models
    tokenize: bool | None = None  # None: not asked yet; False: the engine has no /tokenize
    inflight: int = 0
    outstanding_tokens: list[int] = field(default_factory=list)
    outstanding_requests: list[int] = field(default_factory=list)  # per DP rank
    dp_rank_field: bool = False  # static only: the engine takes the `data_parallel_rank` body field
    spec_dp_size: int | None = None  # static only: ``dp=`` from its spec (None: not given)
    health_dp_size: int | None = None  # static only: the dp_size its /health last reported
    dp_counter: int = 0
    #: per DP rank, the engine's own latest load report (None: not read yet, or the engine does not say)
    reported_load: list[ReportedLoad | None] = field(default_factory=list)
    pinned: frozenset[str] = frozenset()  # fields given by flag: never overwritten by what the engine reports
    # the latest ping's registration as it came, and the record it made (until a probe learns more)
    _ping: Registration | None = field(default=None, repr=False)
    _from_ping: Registration | None = field(default=None, repr=False)
    _urls: dict[str, URL] = field(default_factory=dict, repr=False)
    #: told when its DP ranks change in number (its registry's routable lists are rebuilt: a policy keeps
    #: per-rank structures for as long as the list it was given is the same object)
    on_reshape: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._fit_loads()

    # ------------------------------------------------------------------ what it is (its registration)
    @property
    def role(self) -> Role:
        return self.reg.role

    @property
    def base_url(self) -> str:
        return self.reg.base_url

    @property
    def host(self) -> str:
        return self.reg.host

    @property
    def http_port(self) -> int:
        return self.reg.http_port

    @property
    def handshake_port(self) -> int | None:
        return self.reg.handshake_port

    @property
    def dp_size(self) -> int:
        return self.reg.dp_size

    @property
    def tp_size(self) -> int:
        return self.reg.tp_size

    @property
    def index(self) -> str:
        return self.reg.index

    @property
    def engine_id(self) -> str | None:
        return self.reg.engine_id

    @property
    def model(self) -> str | None:
        return self.reg.model

    @property
    def notify_port(self) -> int | None:
        return self.reg.notify_port

    @property
    def source(self) -> str:
        return self.reg.source

    @property
    def features(self) -> frozenset[str]:
        return self.reg.features or frozenset()

    @property
    def draining(self) -> bool:
        """Takes no new legs: drained (:class:`Drain`) or leaving by its own ping."""
        return self.drain is not None or self.reg.draining

    @property
    def static(self) -> bool:
        """Given by flag: probed, never evicted."""
        return self.reg.source == "static"

    def learn(self, **changes: Any) -> None:
        """Take what a probe learnt (``/health``, ``/v1/models``): a new registration with ``changes``."""
        if all(getattr(self.reg, key) == value for key, value in changes.items()):
            return  # what the last probe said, again
        self._take(replace(self.reg, **changes))

    def register(self, reg: Registration) -> None:
        """A new ping: its registration replaces the old one (the ``kv_features`` known stay when it names none).
        A ping that says what the one before it said (the same object from
        :class:`~atom_kv.proxy.fleet.pings.KnownPings`, or an equal one), while nothing else changed the
        record since, changes nothing and costs nothing."""
        if self.reg is self._from_ping and (reg is self._ping or reg == self._ping):
            return
        self._ping = reg
        if reg.features is None and self.reg.features is not None:
            reg = replace(reg, features=self.reg.features)
        self._take(reg)
        self._from_ping = self.reg

    def _take(self, reg: Registration) -> None:
        restarted = reg.engine_id != self.reg.engine_id
        self.reg = reg
        if restarted:  # another engine process: what the old one reported is not this one's load
            self.clear_reported_load()
        self._fit_loads()

    def clear_reported_load(self) -> None:
        """Forget every rank's :class:`ReportedLoad` (a restart, down, gone)."""
        self.reported_load = [None] * self.reg.dp_size

    def _fit_loads(self) -> None:
        dp = self.reg.dp_size
        if len(self.reported_load) != dp:
            self.reported_load = (self.reported_load + [None] * dp)[:dp]
        if len(self.outstanding_tokens) != dp:
            self.outstanding_tokens = (self.outstanding_tokens + [0] * dp)[:dp]
            if self.on_reshape is not None:
                self.on_reshape()
        if len(self.outstanding_requests) != dp:
            self.outstanding_requests = (self.outstanding_requests + [0] * dp)[:dp]

    # ------------------------------------------------------------------ routing
    def url(self, path: str) -> URL:
        """The upstream URL for ``path`` (parsed once, not on every request)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.base_url + path)
        return url

    @property
    def key(self) -> tuple[str, str]:
        return (self.role, self.base_url)

    @property
    def takes_dp_rank_field(self) -> bool:
        """Whether the legs may carry the ``data_parallel_rank`` body field: ATOM-format
        engines (ATOM, atom-kv's reference engine) read it; vLLM's MoRIIO engines get
        only the header; a static engine says so in its spec (``dp_rank_field=1``)."""
        return self.source == "atom" or self.dp_rank_field

    def next_dp_rank(self) -> int:
        """Cycle through every DP rank of this instance (no aliasing across instances)."""
        rank = self.dp_counter % self.dp_size
        self.dp_counter += 1
        return rank

    def resize_dp(self, dp_size: int) -> None:
        if dp_size != self.dp_size:
            self.learn(dp_size=dp_size)

    def add_load(self, dp_rank: int, tokens: int) -> None:
        """One more leg in flight on ``dp_rank`` (only :class:`~atom_kv.proxy.routing.pick.LoadLedger` calls this)."""
        self.inflight += 1
        if dp_rank < len(self.outstanding_tokens):  # dp_size may change on re-registration
            self.outstanding_tokens[dp_rank] += tokens
        if dp_rank < len(self.outstanding_requests):
            self.outstanding_requests[dp_rank] += 1

    def remove_load(self, dp_rank: int, tokens: int) -> list[str]:
        """One leg on ``dp_rank`` ended; returns the names of the counters that were already at 0, which are
        left there (the caller counts it: :class:`~atom_kv.proxy.routing.pick.LoadLedger`)."""
        below: list[str] = []
        if self.inflight > 0:
            self.inflight -= 1
        else:
            below.append("inflight")
        if dp_rank < len(self.outstanding_tokens):
            left = self.outstanding_tokens[dp_rank] - tokens
            if left < 0:
                below.append("outstanding_tokens")
            self.outstanding_tokens[dp_rank] = max(0, left)
        if dp_rank < len(self.outstanding_requests):
            if self.outstanding_requests[dp_rank] > 0:
                self.outstanding_requests[dp_rank] -= 1
            else:
                below.append("outstanding_requests")
        return below

    def describe(self, now: float) -> dict:
        return {
            "role": self.role,
            "address": self.base_url,
            "host": self.host,
            "port": self.http_port,
            "handshake_port": self.handshake_port,
            "notify_port": self.notify_port,
            "features": sorted(self.features),
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "index": self.index,
            "engine_id": self.engine_id,
            "model": self.model,
            "source": self.source,
            "state": self.state,
            "draining": self.draining,
            "down_reason": self.down_reason or None,
            "last_error": None if self.last_error is None else {"message": self.last_error.message,
                                                                "at": self.last_error.at},
            "max_model_len": self.max_model_len,
            "last_seen": self.last_seen_wall,
            "last_seen_age_s": round(now - self.last_seen, 3) if self.last_seen else None,
            "inflight": self.inflight,
            "outstanding_tokens": list(self.outstanding_tokens),
            "outstanding_requests": list(self.outstanding_requests),
            "reported_load": [None if r is None else {"requests": r.requests, "prompt_tokens": r.prompt_tokens,
                                                      "age_s": round(now - r.at, 3)} for r in self.reported_load],
            "dp_rank_field": self.takes_dp_rank_field,
            "circuit": self.breaker.state(now),
        }


class Registry:
    """The set of known instances and their health; loop-only (no locks).

    ``on_evict`` is called for every instance that leaves (or, if static,
    goes silent), ``on_register`` for every ping an instance took, ``on_added`` for every engine
    given by flag, the worker API or DNS (:meth:`add_static`); ``wakeup``
    is set when an instance needs a probe soon."""

    def __init__(
        self,
        heartbeat_timeout: float,
        circuit_failures: int,
        circuit_cooldown_s: float,
        max_instances: int = 256,
        on_evict: Callable[[Instance], None] | None = None,
        *,
        circuit_min_requests: int = 20,
        circuit_failure_ratio: float = 0.5,
        circuit_window_s: float = 30.0,
        on_register: Callable[[Instance, Registration], None] | None = None,
        on_added: Callable[[Instance], None] | None = None,
    ) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.max_instances = max_instances
        self._circuit_failures = circuit_failures
        self._circuit_cooldown_s = circuit_cooldown_s
        self._circuit_window = (circuit_min_requests, circuit_failure_ratio, circuit_window_s)
        self._on_evict = on_evict
        self._on_register = on_register  # every accepted ping, after the instance took it
        self._on_added = on_added  # every engine add_static registered
        self._instances: dict[tuple[str, str], Instance] = {}
        self._sorted: dict[str, list[Instance]] | None = None
        # live() per role, kept between changes: a request's pick costs no scan of the fleet
        self._routable: dict[str, _Routable] = {}
        self._to_probe: dict[tuple[str, str], Instance] = {}  # static, pending or down: see to_probe()
        self._open_circuits = {"P": 0, "D": 0}  # instances per role whose breaker is open or half-open
        self._waiters: list[asyncio.Future] = []
        self.wakeup = asyncio.Event()
        self.discovered = 0  # instances that came from pings (the ones max_instances bounds)
        # pinged engines drained and then removed by the operator: role, URL -> when last heard (bounded, expiring)
        self._withdrawn: dict[tuple[str, str], float] = {}
        # a flood of registrations must not become a flood of log lines
        self._info = RateLimitedLog(logger, "instance changes", level=logging.INFO, burst=32)
        self._warn = RateLimitedLog(logger, "instance problems", level=logging.WARNING, burst=16)

    def flush_logs(self) -> None:
        """Log summaries of suppressed registry messages (called periodically by the health monitor)."""
        self._info.flush()
        self._warn.flush()

    # ------------------------------------------------------------------ changes
    def _changed(self) -> None:
        self._sorted = None
        self._routable.clear()
        self._notify()

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _new_instance(self, reg: Registration) -> Instance:
        breaker = self._breaker()
        role = reg.role

        def flipped(opened: bool) -> None:
            self._open_circuits[role] += 1 if opened else -1

        breaker.on_flip = flipped
        return Instance(reg, breaker=breaker, on_reshape=self._routable.clear)

    def _breaker(self) -> CircuitBreaker:
        min_requests, ratio, window_s = self._circuit_window
        return CircuitBreaker(self._circuit_failures, self._circuit_cooldown_s, min_requests=min_requests,
                              failure_ratio=ratio, window_s=window_s)

    def _make_room(self, now: float) -> None:
        """At capacity: drop the stalest discovered instance that is not up, or refuse."""
        candidates = [i for i in self._instances.values() if not i.static and i.state != UP]
        if not candidates:
            raise RegistryFull(f"{self.max_instances} discovered instances registered and up (max_instances)")
        victim = min(candidates, key=lambda i: i.last_seen)
        self._remove(victim)
        self._info.event("dropped", f"dropped {ROLE_NAMES[victim.role]} instance {victim.base_url} ({victim.state}) "
                                    "to make room for a new registration")

    def _remove(self, inst: Instance) -> None:
        del self._instances[inst.key]
        self._to_probe.pop(inst.key, None)
        inst.breaker.on_flip = None  # no longer counted
        if inst.breaker.is_open:
            self._open_circuits[inst.role] -= 1
        if not inst.static:
            self.discovered -= 1
        self._changed()
        if self._on_evict is not None:
            self._on_evict(inst)

    def upsert(self, reg: Registration, now: float | None = None) -> bool:
        """Add or refresh an instance from a ping; True when it is new. Raises :class:`RegistryFull`."""
        now = time.monotonic() if now is None else now
        key = (reg.role, reg.base_url)
        if key in self._withdrawn:
            self._withdrawn[key] = now
            raise Withdrawn(f"{reg.base_url} was drained and removed by the operator (DELETE /workers); add it "
                            "again with POST /workers, or restart the proxy")
        inst = self._instances.get(key)
        new = inst is None
        if inst is None:
            if self.discovered >= self.max_instances:
                self._make_room(now)
            inst = self._instances[key] = self._to_probe[key] = self._new_instance(reg)
            inst._ping = inst._from_ping = reg
            self.discovered += 1
            self.wakeup.set()
        elif not inst.static:  # a static engine's record is its spec's and its probes'
            draining = inst.draining
            inst.register(reg)
            if inst.draining != draining:
                self._routable.clear()
        elif inst.reg.draining != reg.draining:  # ... but one that pings may say it is leaving
            inst.learn(draining=reg.draining)
            self._changed()
        if not new and not self.alive(inst, now):
            self._routable.clear()  # silent past the timeout, heard again: live once more
        inst.last_seen = now
        inst.last_seen_wall = time.time()
        if not new:
            self._notify()
        else:
            self._changed()
            self._info.event("registered", (
                f"registered {ROLE_NAMES[reg.role]} instance {reg.base_url} (tp={reg.tp_size} dp={reg.dp_size} "
                f"handshake_port={reg.handshake_port}, {reg.source} ping); probing it"))
        if self._on_register is not None:
            self._on_register(inst, reg)
        return new

    def get(self, role: Role, base_url: str) -> Instance | None:
        """The instance registered as ``role`` at ``base_url``, if any."""
        return self._instances.get((role, base_url))

    def add_static(self, engine: StaticEngine, origin: Origin = Origin.STATIC) -> Instance:
        """Register an engine given by flag (or by the worker API, or found in DNS: ``origin``); it is
        probed, never evicted by the heartbeat."""
        self._withdrawn.pop((engine.role, engine.base_url), None)
        inst = self._new_instance(Registration(
            role=engine.role, base_url=engine.base_url, host=engine.host,
            http_port=engine.http_port, handshake_port=engine.handshake_port, dp_size=engine.dp_size or 1,
            tp_size=engine.tp_size or 1, engine_id=engine.engine_id, notify_port=engine.notify_port, source="static",
            kv_events=engine.events, kv_events_replay=engine.events_replay))
        inst.origin = origin
        inst.dp_rank_field = engine.dp_rank_field
        inst.spec_dp_size = engine.dp_size
        inst.pinned = frozenset(k for k, v in (("tp_size", engine.tp_size), ("engine_id", engine.engine_id)) if v)
        self._instances[inst.key] = self._to_probe[inst.key] = inst
        self._changed()
        self.wakeup.set()
        if self._on_added is not None:
            self._on_added(inst)
        return inst

    def remove(self, inst: Instance) -> None:
        """Forget ``inst`` (the worker API, DNS). A pinged engine comes back on its next ping, unless it was
        drained: then its pings are refused (:class:`Withdrawn`) until it is silent for the heartbeat timeout."""
        if self._instances.get(inst.key) is not inst:
            return
        if inst.origin is Origin.PING and inst.draining:
            if len(self._withdrawn) >= self.max_instances:
                del self._withdrawn[min(self._withdrawn, key=self._withdrawn.__getitem__)]
            self._withdrawn[inst.key] = time.monotonic()
        self._remove(inst)

    def set_drain(self, inst: Instance, drain: Drain | None) -> None:
        """Start (or, with None, end) draining ``inst``: while drained it gets no new legs."""
        if inst.drain is not drain:
            inst.drain = drain
            self._changed()

    # ------------------------------------------------------------------ health
    def mark_down(self, inst: Instance, reason: str, failure: ProbeFailure | None = None) -> bool:
        """Take ``inst`` out of routing until a probe reaches it; True if it was not down already.
        ``failure``: the kind of the probe that found it down (None: a request did)."""
        if inst.state == DOWN or self._instances.get(inst.key) is not inst:
            return False
        inst.state = DOWN
        self._to_probe[inst.key] = inst
        inst.clear_reported_load()
        inst.down_reason = reason
        inst.probe_failure = failure
        self._changed()
        self.wakeup.set()
        self._warn.event("down", f"{ROLE_NAMES[inst.role]} instance {inst.base_url} is down: {reason}")
        return True

    def not_reached(self, inst: Instance, reason: str, failure: ProbeFailure) -> None:
        """A probe did not reach ``inst``, pending (never up: it stays pending, not routed) or down (it stays
        down): ``down_reason`` becomes ``reason``. Said once per change of ``failure``: a probe that timed
        out as a WARNING (nothing else would tell), a pending instance's other failures as "starting"."""
        changed = failure is not inst.probe_failure
        if reason != inst.down_reason:
            inst.down_reason = reason
            self._notify()  # what wait_for() waiters look at changed
        inst.probe_failure = failure
        if not changed or inst.state == UP:
            return
        name = f"{ROLE_NAMES[inst.role]} instance {inst.base_url}"
        if failure is ProbeFailure.TIMED_OUT:
            self._warn.event("unreachable", (
                f"{name} is {'still down' if inst.state == DOWN else 'not reachable'}: {reason}; check the "
                "firewall between the proxy and that port (it must let the proxy's connections in) and the address "
                "the engine advertises; routed once a health probe reaches it"))
        elif inst.state == PENDING:
            self._info.event("starting", f"{name} is starting ({reason}); routed once a health probe reaches it")

    def mark_up(self, inst: Instance, now: float | None = None) -> None:
        """A probe reached ``inst``: routable again (static instances also count it as a heartbeat)."""
        now = time.monotonic() if now is None else now
        if inst.static:
            if not self.alive(inst, now):
                self._routable.clear()  # silent past the timeout, reached again: live once more
            inst.last_seen = now
            inst.last_seen_wall = time.time()
            inst.expired = False
        if inst.state != UP:
            was = inst.state
            inst.state = UP
            if not inst.static:
                self._to_probe.pop(inst.key, None)
            inst.down_reason = ""
            inst.probe_failure = None
            self._changed()
            if was == DOWN:
                self._info.event("up", f"{ROLE_NAMES[inst.role]} instance {inst.base_url} is up again")

    def alive(self, inst: Instance, now: float) -> bool:
        return now - inst.last_seen <= self.heartbeat_timeout

    def evict_expired(self, now: float | None = None) -> list[Instance]:
        """Drop discovered instances not heard from for ``heartbeat_timeout``; static
        ones stay known but are reported once. Returns both kinds."""
        now = time.monotonic() if now is None else now
        for key in [k for k, heard in self._withdrawn.items() if now - heard > self.heartbeat_timeout]:
            del self._withdrawn[key]  # silent: a later ping is a new engine
        gone = [i for i in self._instances.values()
                if not self.alive(i, now) and not (i.static and (i.expired or i.last_seen == 0.0))]
        for inst in gone:
            self._warn.event("evicted", (
                f"evicted {ROLE_NAMES[inst.role]} instance {inst.base_url}: not heard from for "
                f"{now - inst.last_seen:.1f}s (heartbeat timeout {self.heartbeat_timeout:.1f}s)"))
            if inst.static:
                inst.expired = True
                inst.clear_reported_load()
                self._changed()
                if self._on_evict is not None:
                    self._on_evict(inst)
            else:
                self._remove(inst)
        return gone

    # ------------------------------------------------------------------ reads
    def _by_role(self) -> dict[str, list[Instance]]:
        if self._sorted is None:
            by_role: dict[str, list[Instance]] = {"P": [], "D": []}
            for inst in sorted(self._instances.values(), key=lambda i: i.base_url):
                by_role[inst.role].append(inst)
            self._sorted = by_role
        return self._sorted

    def to_probe(self) -> list[Instance]:
        """The instances a health probe must reach: static ones (they send no pings), and the pending and down
        ones. Kept as their state changes, so the prober's tick does not look at every up engine."""
        return list(self._to_probe.values())

    def known(self, role: Role) -> list[Instance]:
        """Every instance of ``role`` (any state), in address order."""
        return list(self._by_role()[role])

    def live(self, role: Role, now: float | None = None) -> list[Instance]:
        """Routable instances of ``role`` (live, up and not draining), in a stable (address) order.

        Kept between calls (a new list each time, the caller's to change): recomputed after a change of
        any instance's state, membership or draining, and once the least recently heard member could have
        passed the heartbeat timeout. A request's pick does not scan the fleet."""
        return list(self.routable(role, now))

    def routable(self, role: Role, now: float | None = None) -> list[Instance]:
        """What :meth:`live` returns, as the registry's own list: the same object until it is recomputed
        (a change of state, membership, draining or a member's DP ranks, or a member that may have timed out),
        so a policy may keep what it derived from it for as long as it is given that object. Do not change it."""
        now = time.monotonic() if now is None else now
        cached = self._routable.get(role)
        if cached is None or now > cached.valid_until or now < cached.computed_at:
            found = [i for i in self._by_role()[role] if i.state == UP and not i.draining and self.alive(i, now)]
            oldest = min((i.last_seen for i in found), default=now)
            cached = self._routable[role] = _Routable(found, now, oldest + self.heartbeat_timeout)
        return cached.instances

    def closed_circuits(self, role: Role, candidates: list[Instance], now: float) -> list[Instance]:
        """Those of ``candidates`` (instances of ``role``) whose breaker lets a request go now: ``candidates``
        itself while no breaker of the role is open, else each one asked (the half-open ones' trials)."""
        if not self._open_circuits[role]:
            return candidates
        return [i for i in candidates if i.breaker.allows(now)]

    def usable(self, role: Role, now: float | None = None) -> list[Instance]:
        """Live, up, and not behind an open circuit: what a request can be sent to now."""
        now = time.monotonic() if now is None else now
        return [i for i in self.live(role, now) if i.breaker.state(now) != "open"]

    def counts(self, now: float | None = None) -> dict[str, int]:
        """Usable instances per role (what ``/health`` and the metrics report)."""
        now = time.monotonic() if now is None else now
        return {"prefill": len(self.usable("P", now)), "decode": len(self.usable("D", now))}

    def snapshot(self, now: float | None = None) -> list[dict]:
        """Every known instance (``/instances``)."""
        now = time.monotonic() if now is None else now
        return [i.describe(now) for role in ("P", "D") for i in self._by_role()[role]]

    def __len__(self) -> int:
        return len(self._instances)

    async def wait_for(self, predicate: Callable[["Registry"], bool], timeout: float) -> bool:
        """Wait (on change notifications, not a spin) until ``predicate(self)`` holds or ``timeout`` passes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate(self):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            fut = loop.create_future()
            self._waiters.append(fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                pass
        return True
