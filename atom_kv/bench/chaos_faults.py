"""The chaos soak's faults: drawn from the seed, one every few seconds, overlapping, each on a process or a host
no other fault holds at the time.

Kinds (:data:`KINDS`), each one :class:`Fault` record from its start to the moment it was cleared:

- ``engine_kill``: SIGKILL of an engine (its whole process group), then a restart on its host and ports;
  cleared once it serves and both proxies hold it up again;
- ``engine_stop``: SIGSTOP of an engine for 2-5 s, then SIGCONT;
- ``link_down``: an engine host's cable out of the switch for 1-5 s;
- ``link_throttle``: everything an engine host sends through ``tc ... tbf`` at 1, 4 or 16 Mbit/s for 3-8 s;
- ``proxy_kill``: SIGKILL of a proxy, then a restart; cleared once it holds every engine up;
- ``handshake_closed``: a prefill engine's handshake port closed by an ``iptables`` rule (DROP or REJECT)
  for 2-6 s.

Kills are drawn less often than the rest, never for both processes of a pair at once (one proxy, one
prefill and one decode engine are always running, if perhaps stopped or cut off), and not in the last
seconds of the faults. The read faults of the decode engines (the test-only injector) are on for the whole run, not drawn here.
Each fault runs on a thread of its own (named), which always undoes what it did, even when the soak stops.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Optional

from atom_kv.bench.chaos_fleet import ENGINES, HANDSHAKE_PORT, PROXIES, ChaosFleet

__all__ = ["KINDS", "Fault", "FaultPlan"]

log = logging.getLogger(__name__)

KINDS = ("engine_kill", "engine_stop", "link_down", "link_throttle", "proxy_kill", "handshake_closed")
#: how often each kind is drawn, relatively (a kill and its restart keep a process away the longest)
WEIGHTS = {"engine_kill": 1.0, "engine_stop": 1.5, "link_down": 1.5, "link_throttle": 1.5, "proxy_kill": 1.0,
           "handshake_closed": 1.5}
KILLS = ("engine_kill", "proxy_kill")
#: no kill is drawn in the last seconds before the end of the faults: its restart would outlast them
KILL_LEAD_S = 10.0
#: longest a killed process may take to come back before its fault is reported as not recovered
RESTART_TIMEOUT_S = 90.0


@dataclass
class Fault:
    """One fault: its kind, its target, what it did (``how``), and when it began and was cleared (monotonic;
    ``cleared`` None while it lasts, or when the target never came back)."""

    kind: str
    target: str
    how: str
    started: float
    cleared: Optional[float] = None
    failed: str = ""


def _pair(target: str) -> tuple[str, ...]:
    """The other process of ``target``'s kind (the other proxy, prefill or decode engine)."""
    group = PROXIES if target in PROXIES else tuple(e for e in ENGINES if e[:-1] == target[:-1])
    return tuple(t for t in group if t != target)


def _targets(kind: str) -> tuple[str, ...]:
    if kind == "proxy_kill":
        return PROXIES
    if kind == "handshake_closed":
        return tuple(e for e in ENGINES if e.startswith("prefill"))
    return ENGINES


class FaultPlan:
    """Owns the fault threads: draws a fault every ``interval`` (from ``seed``, by :data:`WEIGHTS`), each on a
    free target."""

    def __init__(self, fleet: ChaosFleet, *, seed: int, interval: tuple[float, float],
                 kinds: tuple[str, ...] = KINDS) -> None:
        self._fleet = fleet
        self._rng = random.Random(seed)
        self._interval = interval
        self._kinds = kinds
        self._stop = threading.Event()
        self._busy: set[str] = set()
        self._killed: set[str] = set()  # targets of a kill, until they are back
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._drawer: Optional[threading.Thread] = None
        self.faults: list[Fault] = []

    def start(self, until: float) -> None:
        """Draw faults until ``until`` (monotonic)."""
        self._drawer = threading.Thread(target=self._draw, args=(until,), name="chaos-faults", daemon=True)
        self._drawer.start()

    def join(self, timeout: float) -> bool:
        """Stop drawing and wait for every fault to be undone; False if one still runs after ``timeout``."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        if self._drawer is not None:
            self._drawer.join(max(0.0, deadline - time.monotonic()))
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _draw(self, until: float) -> None:
        while not self._stop.wait(self._rng.uniform(*self._interval)):
            if time.monotonic() >= until:
                return
            kind = self._rng.choices(self._kinds, weights=[WEIGHTS[k] for k in self._kinds])[0]
            if kind in KILLS and time.monotonic() >= until - KILL_LEAD_S:
                continue  # a restart would outlast the run
            with self._lock:
                free = [t for t in _targets(kind) if t not in self._busy]
                if kind in KILLS:  # one of each pair is never killed with the other: one pair can always serve
                    free = [t for t in free if not any(o in self._killed for o in _pair(t))]
                if not free:
                    continue
                if not free:
                    continue
                target = self._rng.choice(free)
                self._busy.add(target)
                if kind in KILLS:
                    self._killed.add(target)
            params = self._params(kind)
            thread = threading.Thread(target=self._run, args=(kind, target, params), name=f"chaos-{kind}-{target}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()

    def _params(self, kind: str) -> dict:
        r = self._rng
        return {
            "engine_kill": lambda: {"down_s": r.uniform(0.5, 2.0)},
            "engine_stop": lambda: {"for_s": r.uniform(2.0, 5.0)},
            "link_down": lambda: {"for_s": r.uniform(1.0, 5.0)},
            "link_throttle": lambda: {"for_s": r.uniform(3.0, 8.0), "kbit": r.choice((1000, 4000, 16000))},
            "proxy_kill": lambda: {"down_s": r.uniform(0.5, 2.0)},
            "handshake_closed": lambda: {"for_s": r.uniform(2.0, 6.0), "reject": r.random() < 0.5},
        }[kind]()

    def _run(self, kind: str, target: str, params: dict) -> None:
        fault = Fault(kind, target, ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                              for k, v in params.items()), time.monotonic())
        self.faults.append(fault)
        log.info("fault %s on %s (%s)", kind, target, fault.how)
        try:
            getattr(self, "_" + kind)(fault, target, **params)
        except Exception as exc:  # the fault itself could not be made or undone: reported, never hidden
            fault.failed = f"{type(exc).__name__}: {exc}"
            log.warning("fault %s on %s failed: %s", kind, target, fault.failed)
        finally:
            with self._lock:
                self._busy.discard(target)
                self._killed.discard(target)

    def _hold(self, seconds: float) -> None:
        """Wait ``seconds``, or less when the soak stops (the fault is then undone at once)."""
        self._stop.wait(seconds)

    # -- the kinds ------------------------------------------------------------------
    def _restart(self, fault: Fault, target: str, down_s: float) -> None:
        self._fleet.kill(target)
        self._hold(down_s)
        self._fleet.restart(target)
        fault.cleared = self._fleet.wait_ready([target], RESTART_TIMEOUT_S)
        if fault.cleared is None:
            fault.failed = f"{target} not back within {RESTART_TIMEOUT_S:.0f} s"

    def _engine_kill(self, fault: Fault, target: str, down_s: float) -> None:
        self._restart(fault, target, down_s)

    def _proxy_kill(self, fault: Fault, target: str, down_s: float) -> None:
        self._restart(fault, target, down_s)

    def _engine_stop(self, fault: Fault, target: str, for_s: float) -> None:
        proc = self._fleet.current[target].proc
        proc.freeze(True)
        try:
            self._hold(for_s)
        finally:
            proc.freeze(False)
            fault.cleared = time.monotonic()

    def _link_down(self, fault: Fault, target: str, for_s: float) -> None:
        self._fleet.hosts.link(target, up=False)
        try:
            self._hold(for_s)
        finally:
            self._fleet.hosts.link(target, up=True)
            fault.cleared = time.monotonic()

    def _link_throttle(self, fault: Fault, target: str, for_s: float, kbit: int) -> None:
        self._fleet.hosts.throttle(target, kbit)
        try:
            self._hold(for_s)
        finally:
            self._fleet.hosts.throttle(target, None)
            fault.cleared = time.monotonic()

    def _handshake_closed(self, fault: Fault, target: str, for_s: float, reject: bool) -> None:
        self._fleet.hosts.close_port(target, HANDSHAKE_PORT, True, reject=reject)
        try:
            self._hold(for_s)
        finally:
            self._fleet.hosts.close_port(target, HANDSHAKE_PORT, False, reject=reject)
            fault.cleared = time.monotonic()
