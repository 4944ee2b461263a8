"""Per-instance circuit breakers that count instance failures, never one request's failures.

What counts (the relay and :class:`~atom_kv.proxy.fleet.health.UpstreamHealth` sort it):

* **instance failures**: connection errors, timeouts, 502/503/504, answers that are
  not what an engine sends (invalid JSON, no ``kv_transfer_params``), a decode engine
  that could not read a prefill's KV, and *confirmed* 500s (below);
* **suspect failures**: a 500 (or another 5xx that is not a gateway error) and an
  answer over the proxy's size bounds. A request's content can cause them (a prompt
  that crashes a tokenizer template, ``prompt_logprobs`` on a huge prompt), so they
  are held by the request (:class:`RequestOutcomes`) until it ends, then judged:

  - the same request failed the same way on another instance of the role: the
    request's fault, not counted;
  - the same request succeeded on another instance of the role: the instance's fault,
    counted as an instance failure (*confirmed*);
  - no other instance was tried (one instance, or no retry left): *unresolved*. It
    counts only while the instance answered no other request well within the window:
    an instance that serves other clients is not judged by one client's content, and
    one that answers everybody 500 still opens after ``min_requests``.

  A fleet whose every instance answers a request 500 charges none of them for it:
  opening them all would help nobody (see below), and one broken instance among
  healthy ones is still found, by the requests the others then serve.

When it opens: ``threshold`` consecutive instance failures of different requests (one
request retried on this instance counts once), or, over the last ``window_s``, at
least ``min_requests`` outcomes of which ``failure_ratio`` or more were failures (Envoy's
outlier detection, resilience4j's ``minimumNumberOfCalls``). After ``cooldown_s`` it is
half-open: one trial request at a time (a trial whose outcome never arrives, e.g. the
client left, frees the slot after another ``cooldown_s``); a success closes it and clears
the window, an instance failure opens it again. When every instance of a role is open,
the relay still sends each leg to the one that failed least recently (``last_failure``):
an open breaker steers traffic away from an instance, it never refuses every client.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Callable, Optional

__all__ = ["CircuitBreaker", "OutcomeWindow", "RequestOutcomes"]


class OutcomeWindow:
    """Successes, instance failures and unresolved suspects over the last ``window_s``,
    in ``buckets`` time slices (fixed memory, no per-request entries)."""

    __slots__ = ("window_s", "_width", "_epochs", "_ok", "_failed", "_unresolved")

    def __init__(self, window_s: float, buckets: int = 10) -> None:
        self.window_s = window_s
        self._width = window_s / buckets
        self._epochs = [-1] * buckets
        self._ok = [0] * buckets
        self._failed = [0] * buckets
        self._unresolved = [0] * buckets

    def _slot(self, now: float) -> int:
        epoch = math.floor(now / self._width)
        i = epoch % len(self._epochs)
        if self._epochs[i] != epoch:
            self._epochs[i] = epoch
            self._ok[i] = self._failed[i] = self._unresolved[i] = 0
        return i

    def add(self, now: float, ok: int = 0, failed: int = 0, unresolved: int = 0) -> None:
        i = self._slot(now)
        self._ok[i] += ok
        self._failed[i] += failed
        self._unresolved[i] += unresolved

    def totals(self, now: float) -> tuple[int, int, int]:
        """``(ok, failed, unresolved)`` within the window."""
        oldest = math.floor(now / self._width) - len(self._epochs) + 1
        ok = failed = unresolved = 0
        for i, epoch in enumerate(self._epochs):
            if epoch >= oldest:
                ok += self._ok[i]
                failed += self._failed[i]
                unresolved += self._unresolved[i]
        return ok, failed, unresolved

    def clear(self) -> None:
        n = len(self._epochs)
        self._epochs = [-1] * n
        self._ok, self._failed, self._unresolved = [0] * n, [0] * n, [0] * n


class CircuitBreaker:
    """One instance's breaker (see the module doc for what counts and when it opens)."""

    def __init__(self, threshold: int, cooldown_s: float, *, min_requests: int = 20, failure_ratio: float = 0.5,
                 window_s: float = 30.0) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.min_requests = min_requests
        self.failure_ratio = failure_ratio
        self.failures = 0  # consecutive instance failures (of different requests)
        self.opened_at = 0.0
        self.last_failure = 0.0  # monotonic time of the last failure (any kind): "least recently failed"
        self.window = OutcomeWindow(window_s)
        self.trip_reason = ""  # why it last opened (for the log line)
        self._open = False
        self._trial_started: float | None = None
        self._streak: OrderedDict[object, None] = OrderedDict()  # requests counted in ``failures`` (bounded)
        #: told True when the circuit opens and False when it closes (the registry's count of open circuits)
        self.on_flip: Optional[Callable[[bool], None]] = None

    @property
    def is_open(self) -> bool:
        """Open or half-open: not every request may go (``allows`` is True for all of them only when closed)."""
        return self._open

    def state(self, now: float | None = None) -> str:
        if not self._open:
            return "closed"
        now = time.monotonic() if now is None else now
        if now - self.opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    def allows(self, now: float) -> bool:
        state = self.state(now)
        if state == "closed":
            return True
        if state == "open":
            return False
        return self._trial_started is None or now - self._trial_started >= self.cooldown_s

    def on_dispatch(self, now: float) -> None:
        if self._open and self.state(now) == "half_open":
            self._trial_started = now

    def record_success(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._open:
            self.window.clear()  # a fresh start: the failures that opened it are history
        self.window.add(now, ok=1)
        self.failures = 0
        if self._open and self.on_flip is not None:
            self.on_flip(False)
        self._open = False
        self._trial_started = None
        self._streak.clear()

    def record_failure(self, now: float, request: object = None) -> bool:
        """Count an instance failure of ``request`` (None: always counted; a request already
        counted in this streak is not counted again); True when it (re)opened the circuit."""
        if request is not None:
            if request in self._streak:
                return False
            self._streak[request] = None
            if len(self._streak) > 4 * self.threshold + 16:
                self._streak.popitem(last=False)
        self.failures += 1
        self.last_failure = now
        self.window.add(now, failed=1)
        if self._trial_started is not None:
            return self._trip(now, "a failed trial request")
        if self.failures >= self.threshold:
            return self._trip(now, f"{self.failures} consecutive instance failures")
        if self._ratio_reached(now):
            return self._trip(now, self._ratio_reason())
        return False

    def record_unresolved(self, now: float) -> bool:
        """Count a suspect failure nobody could judge (see the module doc); True when it opened the circuit."""
        self.last_failure = now
        self.window.add(now, unresolved=1)
        self._trial_started = None  # the trial told nothing: the next request may try
        if not self._open and self._ratio_reached(now):
            return self._trip(now, self._ratio_reason() + ", serving nobody well")
        return False

    def _ratio_reached(self, now: float) -> bool:
        ok, failed, unresolved = self.window.totals(now)
        if ok == 0:
            failed += unresolved  # nobody was served well: the instance itself is the likely cause
        total = ok + failed
        return total >= self.min_requests and failed >= self.failure_ratio * total

    def _ratio_reason(self) -> str:
        return f"a failure ratio of at least {self.failure_ratio:g} within {self.window.window_s:g}s"

    def _trip(self, now: float, reason: str) -> bool:
        self.trip_reason = reason
        if not self._open and self.on_flip is not None:
            self.on_flip(True)
        self._open = True
        self.opened_at = now
        self._trial_started = None
        return True


class RequestOutcomes:
    """One request's suspect failures and the instances that served it, until it ends.

    ``key`` is what an instance's breaker counts once per streak. The relay reports to it
    through :class:`~atom_kv.proxy.fleet.health.UpstreamHealth` and settles it when the request
    has its answer (or gave up); a suspect reported after that is judged at once."""

    __slots__ = ("key", "suspects", "served", "settled")

    def __init__(self, key: object) -> None:
        self.key = key
        self.suspects: list[tuple[str, tuple[str, str], object]] = []  # (role, instance key, instance)
        self.served: set[tuple[str, str]] = set()  # instance keys that answered this request well
        self.settled = False

    def verdict(self, role: str, inst_key: tuple[str, str]) -> str:
        """``"instance"``, ``"request"`` or ``"unresolved"`` for a suspect failure on ``inst_key``."""
        if any(k != inst_key and k[0] == role for k in self.served):
            return "instance"
        if any(r == role and k != inst_key for r, k, _ in self.suspects):
            return "request"
        return "unresolved"
