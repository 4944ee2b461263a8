"""One leg's routing decision (:class:`Pick`) and the load it puts on its instance until the leg ends (:class:`Charge`).

A :class:`Charge` is taken when the relay routes a leg (:meth:`LoadLedger.take`) and is released
exactly once, by whoever holds it at the time, the way httpcore's ``PoolByteStream.aclose()`` gives
its pool slot back when the body it belongs to is done:

- a ``with`` block: the relay's attempt holds the decode charge while a non-streamed answer is
  read, and the prefill charge while the prefill leg runs; the block's end releases what it still holds;
- a decode stream, once :meth:`Charge.hand_over` gave it a charge of its own: released when its
  upstream leg ends or the client goes (its ``aclose()``);
- a task (:meth:`Charge.release_when_done`): the prefill leg of a concurrent pair, and the task
  that opens a decode leg after the first token; released when the task ends, however it ends
  (even cancelled before it ran).

Releasing a charge that was already released is a bug in the relay, not a reason to skew the
instance's load: nothing is given back twice, and it is counted
(``atom_kv_proxy_charge_underflows_total{reason="double_release"}``) with a log line. So is a
counter of the instance that would go below zero (``below_zero``: a DP resize dropped the rank's count
while its legs ran), instead of being clamped silently.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass
from typing import Any, Callable

from atom_kv._ratelimit import RateLimitedLog
from atom_kv.proxy.fleet.registry import ROLE_NAMES, Instance
from atom_kv.proxy.observability.metrics import ProxyMetrics

__all__ = ["Charge", "ChargeState", "LoadLedger", "Pick"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Pick:
    """One leg's routing decision: the instance, its DP rank, and the prompt tokens the leg was sized at."""

    inst: Instance
    rank: int
    tokens: int


class ChargeState(enum.Enum):
    HELD = "held"                # its holder gives it back (release, the end of its block or of its task)
    HANDED_OVER = "handed_over"  # moved to the charge :meth:`Charge.hand_over` returned: this one holds nothing
    RELEASED = "released"


class Charge(Pick):
    """One leg's load on its instance (one in-flight leg, its tokens on its DP rank), from the pick until
    its holder ends; released exactly once (see the module doc). Read ``inst``/``rank``/``tokens`` at any time."""

    def __init__(self, ledger: "LoadLedger", inst: Instance, rank: int, tokens: int) -> None:
        super().__init__(inst, rank, tokens)
        self._ledger = ledger
        self.state = ChargeState.HELD

    def release(self) -> None:
        """Give the load back (the holder's one call); a charge no longer held is counted, not given back again."""
        if self.state is not ChargeState.HELD:
            self._ledger.underflow(self, "double_release", f"a charge released again (it was {self.state.value}; "
                                                           "a proxy bug: please report it); nothing given back")
            return
        self.state = ChargeState.RELEASED
        self._ledger.give_back(self)

    def hand_over(self) -> "Charge":
        """Move the load to a new charge for its next holder (a decode stream, a task); this one then
        holds nothing, and the end of a ``with`` block over it leaves the load alone."""
        if self.state is not ChargeState.HELD:
            raise RuntimeError(f"cannot hand over a charge that is {self.state.value}")
        self.state = ChargeState.HANDED_OVER
        return Charge(self._ledger, self.inst, self.rank, self.tokens)

    def release_when_done(self, task: "asyncio.Future[Any]") -> None:
        """``task`` holds this charge: released when it ends (with a result, an error, or cancelled,
        even before it ran), unless the task released it or handed it over first."""
        task.add_done_callback(self._task_done)

    def _task_done(self, _task: "asyncio.Future[object]") -> None:
        if self.state is ChargeState.HELD:
            self.release()

    def __enter__(self) -> "Charge":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.state is ChargeState.HELD:  # released or handed over inside the block: nothing left to give back
            self.release()

    def __repr__(self) -> str:
        return f"Charge({self.inst.base_url}, rank={self.rank}, tokens={self.tokens}, {self.state.value})"


class LoadLedger:
    """Owns the proxy's charges: takes them (the instance's load goes up), gives them back, and counts
    (``atom_kv_proxy_charge_underflows_total``) and logs what would have given a load back twice.
    ``held`` is the number of charges not given back yet; ``idle`` is set while it is 0."""

    def __init__(self, metrics: ProxyMetrics, *, log_interval_s: float = 10.0) -> None:
        self._metrics = metrics
        self.held = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.on_release: Callable[[], None] | None = None  # told after each release (admission control's queue)
        self._warn = RateLimitedLog(logger, "charge underflows", interval_s=log_interval_s)

    def take(self, inst: Instance, rank: int, tokens: int) -> Charge:
        """One leg routed to ``rank`` of ``inst``: its load goes up until the returned charge is released."""
        inst.add_load(rank, tokens)
        self.held += 1
        self.idle.clear()
        return Charge(self, inst, rank, tokens)

    def give_back(self, charge: Charge) -> None:
        """``charge`` was released (only :meth:`Charge.release` calls this)."""
        self.held -= 1
        if not self.held:
            self.idle.set()
        below = charge.inst.remove_load(charge.rank, charge.tokens)
        if below:
            self.underflow(charge, "below_zero", f"giving back a leg's load found {' and '.join(below)} already at 0 "
                                                 "(left at 0)")
        if self.on_release is not None:
            self.on_release()

    def underflow(self, charge: Charge, reason: str, detail: str) -> None:
        role = ROLE_NAMES[charge.inst.role]
        self._metrics.charge_underflows.labels(role, reason).inc()
        self._warn.event(reason, f"{role} instance {charge.inst.base_url} rank {charge.rank}: {detail} "
                                 f"(counted in atom_kv_proxy_charge_underflows_total{{reason=\"{reason}\"}})")
