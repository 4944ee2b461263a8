"""The per-engine cap on concurrent legs and the bounded FIFO queue in front of the pools.

With ``--max-concurrent-per-engine N`` a leg goes only to an engine holding fewer than N charges
(:class:`~atom_kv.proxy.routing.pick.Charge`: one per leg in flight). A request that finds no prefill
or no decode engine under its cap waits in :class:`AdmissionQueue`, first come first served:

- the queue holds at most ``--queue-size`` requests; one more is refused at once (429, ``Retry-After``);
- a request waits at most ``--queue-timeout`` seconds (then 503, saying so);
- nothing polls: every released charge calls :meth:`AdmissionQueue.wake`, which hands the turn to the
  head of the queue when a pair is under its caps again. The woken request takes its charges before it
  next yields, then passes the turn on (the next one in line, while a pair is still free), so a newcomer
  never overtakes a waiting request;
- a request that leaves while queued (its client went: its task is cancelled) leaves the queue, and a
  turn it was handed goes to the next one.

``Retry-After`` on a full queue is ``ceil(--queue-timeout)`` seconds: by then every request queued now
has been served or refused.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from typing import Callable, Iterable

from atom_kv.proxy.fleet.registry import Instance, Registry
from atom_kv.proxy.observability.metrics import ProxyMetrics

__all__ = ["AdmissionQueue", "Refused"]


class Refused(Exception):
    """A request admission control turns away: ``status`` (429 or 503), the client's message (``str()``), and
    ``retry_after`` seconds for a 429 (the relay makes it a :class:`~atom_kv.proxy.relay.errors.ProxyError`)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class AdmissionQueue:
    """Owns the waiting requests (a deque of futures, oldest first) and the one turn handed out at a time.
    ``cap`` 0: no cap, nothing ever waits."""

    def __init__(self, registry: Registry, metrics: ProxyMetrics, *, cap: int, size: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.metrics = metrics
        self.cap = cap
        self.size = size
        self.timeout_s = timeout_s
        self.retry_after_s = max(1, math.ceil(timeout_s))
        self._clock = clock
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._turn: asyncio.Future[None] | None = None  # handed to the head, not taken up yet

    @property
    def depth(self) -> int:
        return len(self._waiting)

    def under_cap(self, instances: Iterable[Instance]) -> list[Instance]:
        """The instances that may take another leg."""
        cap = self.cap
        return [i for i in instances if i.inflight < cap] if cap else list(instances)

    def _full(self) -> bool:
        """True while both roles have live engines and one role has none under its cap (a request would wait).
        A role with no live engine at all is not waited for: the pick answers 503 at once, as without caps."""
        now = self._clock()
        cap = self.cap
        for role in ("D", "P"):
            live = self.registry.live(role, now)
            if not live:
                return False
            if all(i.inflight >= cap for i in live):
                return True
        return False

    async def admit(self, request_id: str) -> None:
        """Return once the caller may pick its pair (it must pick before its next ``await``); raises
        :class:`Refused`: 429 (queue full) or 503 (waited ``timeout_s``)."""
        if not self.cap or (not self._waiting and self._turn is None and not self._full()):
            return
        if len(self._waiting) >= self.size:
            self.metrics.admission_rejections.labels("queue_full").inc()
            raise Refused(429, f"every engine is at its limit of {self.cap} concurrent requests and {self.size} "
                               f"requests are already waiting; retry after {self.retry_after_s}s", self.retry_after_s)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.timeout_s
        fut: asyncio.Future[None] = loop.create_future()
        self._waiting.append(fut)
        self.metrics.admission_queue_depth.set(len(self._waiting))
        self.wake()  # a pair may be free already (an engine was added): then the head goes at once
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining > 0 and not fut.done():
                    try:
                        await asyncio.wait_for(asyncio.shield(fut), remaining)  # shielded: a timeout leaves it pending
                    except asyncio.TimeoutError:
                        pass
                if not fut.done():  # no turn within --queue-timeout
                    self.metrics.admission_rejections.labels("queue_timeout").inc()
                    self.metrics.admission_wait.observe(loop.time() - started)
                    raise Refused(503, f"waited {self.timeout_s:g}s in the admission queue (--queue-timeout) and "
                                       f"every engine stayed at its limit of {self.cap} concurrent requests; "
                                       "retry later, or add engines")
                self._turn = None  # this request's turn, taken up
                if self._full():  # the free engine went away before this request ran: first in line again
                    fut = loop.create_future()
                    self._waiting.appendleft(fut)
                    continue
                self.metrics.admission_wait.observe(loop.time() - started)
                loop.call_soon(self.wake)  # once this request has picked: the next one, while a pair is still free
                return
        finally:
            if fut in self._waiting:  # timed out, or its client went
                self._waiting.remove(fut)
            elif fut is self._turn:  # handed the turn, then cancelled before taking it up: the next one's
                self._turn = None
                loop.call_soon(self.wake)
            self.metrics.admission_queue_depth.set(len(self._waiting))

    def wake(self) -> None:
        """A charge was released (or a turn passed on): hand the turn to the head of the queue if a pair is free."""
        if self._turn is not None or not self._waiting or self._full():
            return
        fut = self._waiting.popleft()
        self._turn = fut
        fut.set_result(None)
