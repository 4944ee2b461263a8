"""Old import path of :mod:`atom_kv.proxy.fleet.breaker` (named in the docs), kept working."""

from atom_kv.proxy.fleet.breaker import CircuitBreaker, OutcomeWindow, RequestOutcomes

__all__ = ["CircuitBreaker", "OutcomeWindow", "RequestOutcomes"]
