"""What the ATOM adapter reads from ATOM's ``Config``.

ATOM passes its whole engine ``Config`` to a connector's constructor; the
connector needs only ``kv_transfer_config`` (our :class:`KVTransferConfig`)
and the engine's shape: TP size, data-parallel rank and size, block size and
model. Read here once, for both sides.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from atom_kv.config import ConfigError, KVTransferConfig

__all__ = ["AtomEngine", "advertised_host"]


@dataclass(frozen=True)
class AtomEngine:
    """One ATOM engine (one data-parallel rank) as the connector sees it."""

    kv: KVTransferConfig
    tp_size: int
    dp_rank: int
    dp_size: int
    block_size: int
    model: str

    @classmethod
    def from_config(cls, config: Any) -> "AtomEngine":
        """Read ATOM's ``Config``; raises :class:`ConfigError` (one line) for a bad ``--kv-transfer-config``."""
        raw = getattr(config, "kv_transfer_config", None)
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"kv-transfer-config: invalid JSON: {exc.msg}") from None
        if not isinstance(raw, dict) or not raw:
            raise ConfigError("kv-transfer-config: ATOM built the atom_kv connector without a --kv-transfer-config")
        kv = KVTransferConfig.from_dict(dict(raw))
        parallel = getattr(config, "parallel_config", None)
        model = str(getattr(config, "model", "") or "")
        return cls(
            kv=kv,
            tp_size=int(getattr(config, "tensor_parallel_size", 1) or 1),
            dp_rank=int(getattr(parallel, "data_parallel_rank", 0) or 0),
            dp_size=int(getattr(parallel, "data_parallel_size", 1) or 1),
            block_size=int(config.kv_cache_block_size),
            model=os.path.basename(model.rstrip("/")) or "unknown",
        )


def advertised_host() -> str:
    """The address other engines dial to read this engine's KV: ATOM's own choice
    (``ATOM_HOST_IP`` if set, else the address of the default route)."""
    try:
        from atom.utils.network import get_ip
    except ImportError:
        return os.environ.get("ATOM_HOST_IP") or "127.0.0.1"
    return get_ip()
