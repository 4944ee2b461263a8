"""How the reference engine answers SIGINT and SIGTERM while it runs and while it shuts down.

- The first signal starts the orderly shutdown: the HTTP server stops
  accepting, in-flight requests get up to ``--shutdown-timeout`` seconds to
  finish (those still running then are aborted, releasing the producers' KV
  they name), then the engine closes.
- The second hurries the same path: every request ends now (503), its
  producer's KV is still released, and each remaining wait is cut to
  ``--hurry-timeout`` seconds. The exit status stays the orderly one (0).
- The third exits at once with status 1; releases not yet sent are left to
  the producers' leases (``abort_timeout_s``).

Each signal logs one line saying which of these happens.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Callable

__all__ = ["SIGNALS", "ShutdownSignals"]

log = logging.getLogger("atom_kv.reference")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: the exit status of the third signal (the orderly and the hurried path exit 0)
EXIT_AT_ONCE = 1


def _nothing() -> None:
    pass


class ShutdownSignals:
    """Owns the count of shutdown signals received and what each one does.

    :meth:`bind` names what the current phase does on the first signal
    (stop serving) and on the second (hurry); :meth:`received` is called for
    each signal, from the event loop (``loop.add_signal_handler``) while it
    runs, from a plain handler (:meth:`install`) after it: asyncio gives the
    default action back when its loop closes, which would let a signal during
    the engine's close kill the process (exit -15)."""

    def __init__(self, *, shutdown_timeout_s: float, hurry_timeout_s: float,
                 exit_now: Callable[[int], None] = os._exit) -> None:
        self.shutdown_timeout_s = shutdown_timeout_s
        self.hurry_timeout_s = hurry_timeout_s
        self.count = 0
        self._exit_now = exit_now
        self._on_stop: Callable[[], None] = _nothing
        self._on_hurry: Callable[[], None] = _nothing

    def bind(self, *, on_stop: Callable[[], None], on_hurry: Callable[[], None]) -> None:
        self._on_stop, self._on_hurry = on_stop, on_hurry

    def install(self) -> None:
        """Handle both signals with :meth:`received` in the main thread (outside an event loop)."""
        for sig in SIGNALS:
            signal.signal(sig, lambda signum, _frame: self.received(signum))

    def received(self, signum: int) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            log.warning("%s: shutting down in order: no new requests; in-flight ones get up to %g s "
                        "(--shutdown-timeout), then end with their prefills' KV released; send it again to hurry",
                        name, self.shutdown_timeout_s)
            self._on_stop()
        elif self.count == 2:
            log.warning("second %s: hurrying the shutdown: in-flight requests end now (503) with their prefills' "
                        "KV still released, every remaining wait is cut to %g s (--hurry-timeout), exit status "
                        "0; a third signal exits at once", name, self.hurry_timeout_s)
            self._on_hurry()
        else:
            log.error("%s number %d: exiting now with status %d; releases not yet sent are left to the prefill "
                      "engines' leases", name, self.count, EXIT_AT_ONCE)
            for handler in logging.getLogger().handlers:
                try:
                    handler.flush()
                except Exception:  # the exit must not wait on a broken log stream
                    pass
            self._exit_now(EXIT_AT_ONCE)
