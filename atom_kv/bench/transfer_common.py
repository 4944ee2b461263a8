"""What both transfer bench suites share (``transfer`` and its device suite ``transfer_device``): the
source bytes and the ``KVTransferConfig`` keys both processes use. Its own module, so neither suite
imports the other."""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

__all__ = ["bench_config", "pattern"]


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """A writable buffer of pseudo-random bytes both processes can regenerate."""
    out = np.empty(nbytes, dtype=np.uint8)
    out[:] = np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)
    return out



def bench_config(args: argparse.Namespace) -> dict[str, Any]:
    """The ``KVTransferConfig`` keys (without ``kv_role``) both processes use.

    Raises :class:`~atom_kv.config.ConfigError` (one line naming the key) for
    a bad ``--kv-transfer-config``."""
    from atom_kv.config import ConfigError, KVTransferConfig

    extra: Any = {}
    text = args.kv_transfer_config
    if text is not None and text.strip():
        try:
            extra = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"kv-transfer-config: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
            ) from None
        if not isinstance(extra, dict):
            KVTransferConfig.from_dict(extra)  # raises the one-line "expected a JSON object"
        extra = {k: v for k, v in extra.items() if k != "kv_role"}
    config: dict[str, Any] = {**extra, "transfer_timeout_s": args.timeout_s}
    tcp = config.get("tcp", {})
    if args.streams is not None and isinstance(tcp, dict):  # (a tcp that is no object is refused just below)
        config["tcp"] = {**tcp, "streams": args.streams}
    KVTransferConfig.from_dict({"kv_role": "kv_consumer", **config})  # validate before spawning
    return config
