"""Token sampling over the model's logits (greedy, or temperature sampling).

A request with a ``seed`` samples each output position from a generator
seeded with ``(seed, position)``, so the same request gives the same tokens on
any engine, and a decode engine that continues from a prefill's first token
samples every later position exactly as a colocated engine would; without a
seed, every request draws fresh entropy from the OS.

Generation is restricted to printable ASCII plus newline, so generated text
maps one to one onto generated token ids.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = ["Sampler"]

_ALLOWED = np.array([10] + list(range(32, 127)), dtype=np.int64)


class Sampler:
    """Owns per-request random generators for ``temperature > 0`` (seeded, or from OS entropy)."""

    def __init__(self) -> None:
        self._rngs: dict[str, np.random.Generator] = {}

    def sample(self, request_id: str, logits: np.ndarray, temperature: float, seed: Optional[int],
               position: int = 0) -> int:
        """One token for output ``position`` (0: the first generated token)."""
        allowed = logits[_ALLOWED].astype(np.float64)
        if temperature <= 0:
            return int(_ALLOWED[int(np.argmax(allowed))])
        if seed is not None:
            rng = np.random.default_rng((seed % 2**64, position))
        else:
            rng = self._rngs.get(request_id)
            if rng is None:
                rng = self._rngs[request_id] = np.random.default_rng()  # OS entropy
        z = allowed / temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        return int(_ALLOWED[int(rng.choice(len(p), p=p))])

    def forget(self, request_id: str) -> None:
        self._rngs.pop(request_id, None)
