"""What the ATOM adapter reads from ATOM's ``Config``.

ATOM passes its whole engine ``Config`` to a connector's constructor; the
connector needs only ``kv_transfer_config`` (our :class:`KVTransferConfig`)
and the engine's shape: TP size, data-parallel rank and size, pipeline stage
and stages, block size and model. Read here once, for both sides.

ATOM runs each pipeline stage as its own engine core, with a copy of the
``Config`` whose ``parallel_config.pipeline_parallel_rank`` names the stage;
``pipeline_parallel_size`` is the number of stages and
``hf_config.num_hidden_layers`` the model's layers (a stage holds a slice).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from atom_kv.config import ConfigError, KVRole, KVTransferConfig

__all__ = ["AtomEngine", "advertised_host", "require_completion_contract"]

#: The ATOM commit this adapter was written and tested against.
ATOM_COMMIT_READ = "ffdf3bb5d"
#: ATOM's own connectors read a missing ``kv_role`` as a producer; under ATOM, so does atom-kv.
ATOM_DEFAULT_ROLE: KVRole = "kv_producer"


@dataclass(frozen=True)
class AtomEngine:
    """One ATOM engine (one data-parallel rank) as the connector sees it."""

    kv: KVTransferConfig
    tp_size: int
    dp_rank: int
    dp_size: int
    block_size: int
    model: str
    pp_rank: int = 0
    pp_size: int = 1
    #: the model's layers (``hf_config.num_hidden_layers``); None where ATOM's config does not say
    num_layers: Optional[int] = None

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
        kv = KVTransferConfig.from_dict(dict(raw), default_role=ATOM_DEFAULT_ROLE)
        parallel = getattr(config, "parallel_config", None)
        model = str(getattr(config, "model", "") or "")
        pp_rank = int(getattr(parallel, "pipeline_parallel_rank", 0) or 0)
        pp_size = int(getattr(config, "pipeline_parallel_size", 1) or 1)
        _check_stages(kv, pp_rank, pp_size)
        layers = getattr(getattr(config, "hf_config", None), "num_hidden_layers", None)
        return cls(
            kv=kv,
            tp_size=int(getattr(config, "tensor_parallel_size", 1) or 1),
            dp_rank=int(getattr(parallel, "data_parallel_rank", 0) or 0),
            dp_size=int(getattr(parallel, "data_parallel_size", 1) or 1),
            block_size=int(config.kv_cache_block_size),
            model=os.path.basename(model.rstrip("/")) or "unknown",
            pp_rank=pp_rank,
            pp_size=pp_size,
            num_layers=int(layers) if isinstance(layers, int) and layers > 0 else None,
        )


def _check_stages(kv: KVTransferConfig, pp_rank: int, pp_size: int) -> None:
    """Refuse, in one line, a pipeline set-up atom-kv cannot serve."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ConfigError(f"ATOM's pipeline_parallel_rank {pp_rank} is outside pipeline_parallel_size {pp_size}")
    if pp_size > 1 and not kv.is_producer:
        raise ConfigError(f"kv-transfer-config: kv_role {kv.kv_role!r} with pipeline_parallel_size {pp_size}: "
                          "atom-kv splits only a prefill engine (kv_producer) into pipeline stages; run the "
                          "decode engine with pipeline_parallel_size 1")


def advertised_host() -> str:
    """The address other engines dial to read this engine's KV when the config
    has no ``advertise_host``: ATOM's own choice (``ATOM_HOST_IP`` if set, else
    the address of the default route)."""
    try:
        from atom.utils.network import get_ip
    except ImportError:
        return os.environ.get("ATOM_HOST_IP") or "127.0.0.1"
    return get_ip()


def require_completion_contract(output_type: Any) -> None:
    """Refuse an ATOM whose connector contract cannot report a failed load.

    ATOM main's ``KVConnectorOutput`` has ``failed_recving`` and its scheduler
    calls ``process_completions``: that is where a failed load, an expired
    lease or a drained abort reaches ATOM. ATOM's first P/D commit (0c982ea92)
    has neither, so a failed load would park its request forever and leases
    could never expire; atom-kv does not run there rather than leak blocks.
    """
    fields = getattr(output_type, "__dataclass_fields__", {})
    if "failed_recving" not in fields:
        raise RuntimeError(
            "atom_kv needs ATOM's failed-load contract (KVConnectorOutput.failed_recving and the scheduler's "
            f"process_completions, ATOM main as of {ATOM_COMMIT_READ}); this ATOM has neither (its first P/D "
            "commit 0c982ea92 or similar), so failed loads could not end and leases could not expire"
        )
