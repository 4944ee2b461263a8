"""Token sampling over the model's logits (greedy, or temperature sampling).

A request with a ``seed`` samples each output position from a generator
seeded with ``(seed, position)``, so the same request gives the same tokens on
any engine, and a decode engine that continues from a prefill's first token
samples every later position exactly as a colocated engine would; without a
seed, every request draws fresh entropy from the OS.

Generation is restricted to printable ASCII plus newline, so generated text
maps one to one onto generated token ids.

The distribution is computed in log space, shifted before it is scaled
(``(logits - max) / temperature``), so it is finite for any temperature > 0:
a tiny temperature makes it greedy rather than overflowing, and a non-finite
logit (a model fault) counts as impossible instead of poisoning every
probability with NaN. Which temperatures a request may ask for is decided
earlier (:mod:`atom_kv.reference.sampling_params`).
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
        allowed[~np.isfinite(allowed)] = -np.inf  # NaN or +-inf: never chosen
        top = allowed.max()
        if not temperature > 0 or not np.isfinite(top):  # greedy (a NaN temperature too), or no finite logit
            return int(_ALLOWED[int(np.argmax(allowed))])
        rng: Optional[np.random.Generator]
        if seed is not None:
            rng = np.random.default_rng((seed % 2**64, position))
        else:
            rng = self._rngs.get(request_id)
            if rng is None:
                rng = self._rngs[request_id] = np.random.default_rng()  # OS entropy
        finite = np.isfinite(allowed)
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            # <= 0 everywhere and 0 at the top, so exp is in [0, 1] and the sum is >= 1
            z = np.where(finite, (allowed - top) / temperature, -np.inf)
        p = np.exp(z)
        p /= p.sum()
        return int(_ALLOWED[int(rng.choice(len(p), p=p))])

    def forget(self, request_id: str) -> None:
        self._rngs.pop(request_id, None)
