"""Test-only: a fault injector that fails a fraction of a backend's reads, for the chaos soak and the tests.

Off unless the environment asks for it, and never on in production: an engine
started with ``ATOM_KV_FAULT_INJECT_READ_FAIL=0.05`` wraps its backend in a
:class:`FaultInjector` that fails about 5 % of its reads as a transport error
(``ATOM_KV_FAULT_INJECT_SEED`` fixes the draw). An injected failure touches no
memory: its handle is failed and settled at once, with words that say it was
injected, the bytes, the ranges and the peer. Everything else goes to the
backend it wraps. Nothing in ``atom_kv.config`` knows of it: it is a hook for
tests, read once where the connector builds a rank's backend
(:func:`with_injected_faults`).
"""

from __future__ import annotations

import logging
import os
import random
import threading
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from atom_kv.transfer.base import ReadFailure, ReadHandle, ReadOp, TransferBackend

__all__ = ["READ_FAIL_ENV", "SEED_ENV", "FaultInjector", "with_injected_faults"]

log = logging.getLogger(__name__)

#: the fraction of reads to fail, from 0 to 1 (unset or 0: no injector)
READ_FAIL_ENV = "ATOM_KV_FAULT_INJECT_READ_FAIL"
#: the seed of the draw (unset: a random one)
SEED_ENV = "ATOM_KV_FAULT_INJECT_SEED"


class FaultInjector(TransferBackend):
    """Owns nothing but its draw: wraps ``inner`` (which it closes with itself) and fails a fraction of its
    reads. Test-only (see the module docstring)."""

    def __init__(self, inner: TransferBackend, read_fail: float, *, seed: Optional[int] = None) -> None:
        if not 0.0 <= read_fail <= 1.0:
            raise ValueError(f"{READ_FAIL_ENV}={read_fail}: a fraction of reads, from 0 to 1")
        self.inner = inner
        self.read_fail = read_fail
        self.name = inner.name
        self.accepts_op_arrays = inner.accepts_op_arrays
        self.memory_kinds = inner.memory_kinds
        self.gpu_alternative = inner.gpu_alternative
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._forced = 0
        self.injected = 0

    def fail_next(self, n: int) -> None:
        """The next ``n`` reads fail whatever the fraction (for tests that need a fixed sequence)."""
        with self._lock:
            self._forced = n

    def _should_fail(self) -> bool:
        with self._lock:
            if self._forced > 0:
                self._forced -= 1
                fail = True
            else:
                fail = self._rng.random() < self.read_fail
            if fail:
                self.injected += 1
            return fail

    # -- the protocol: reads may fail, the rest is the inner backend's -------
    def read(self, peer_id: str, ops: Sequence[ReadOp] | Any, *, timeout_s: float) -> ReadHandle:
        if not self._should_fail():
            return self.inner.read(peer_id, ops, timeout_s=timeout_s)
        if isinstance(ops, np.ndarray):
            nbytes, ranges = int(ops[:, 4].sum()), len(ops)
        else:
            nbytes, ranges = sum(op.size for op in ops), len(ops)
        handle = ReadHandle(nbytes, ranges)
        handle._finish(f"fault injector: read of {nbytes} bytes in {ranges} ranges from peer {peer_id} failed "
                       f"({READ_FAIL_ENV}={self.read_fail:g})", ReadFailure.TRANSPORT)
        return handle

    def register_memory(self, ptr: int, size: int, **kwargs: Any) -> list[int]:
        return self.inner.register_memory(ptr, size, **kwargs)

    def check_memory(self, memory: Any) -> None:
        self.inner.check_memory(memory)

    def export_descriptor(self) -> bytes:
        return self.inner.export_descriptor()

    def add_peer(self, descriptor: bytes) -> str:
        return self.inner.add_peer(descriptor)

    def remove_peer(self, peer_id: str) -> None:
        self.inner.remove_peer(peer_id)

    def kv_written(self) -> None:
        self.inner.kv_written()

    def stats(self) -> dict[str, int]:
        return {**self.inner.stats(), "fault_injected_read_failures": self.injected}

    def close(self) -> None:
        self.inner.close()

    @property
    def max_region_bytes(self) -> int:
        return self.inner.max_region_bytes

    @max_region_bytes.setter
    def max_region_bytes(self, value: int) -> None:
        self.inner.max_region_bytes = value

    def __getattr__(self, name: str) -> Any:
        # what a backend offers beyond the protocol (auto's backend_for, route_fallbacks)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def with_injected_faults(backend: TransferBackend, env: Optional[Mapping[str, str]] = None) -> TransferBackend:
    """``backend``, wrapped in a :class:`FaultInjector` when :data:`READ_FAIL_ENV` asks for one (a warning says
    so); else ``backend`` itself. A value that is not a fraction is refused in one line naming the variable."""
    env = os.environ if env is None else env
    raw = env.get(READ_FAIL_ENV, "").strip()
    if not raw:
        return backend
    try:
        fraction = float(raw)
        seed = int(env[SEED_ENV]) if env.get(SEED_ENV, "").strip() else None
    except ValueError:
        raise ValueError(f"{READ_FAIL_ENV}={raw!r} / {SEED_ENV}={env.get(SEED_ENV)!r}: expected a fraction "
                         "from 0 to 1 and an integer seed; unset them outside tests") from None
    if fraction == 0.0:
        return backend
    log.warning("test-only fault injector on: %.1f%% of %s reads will fail (%s)", fraction * 100, backend.name,
                READ_FAIL_ENV)
    return FaultInjector(backend, fraction, seed=seed)
