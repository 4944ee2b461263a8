"""FAKE connector factory: a registry of module paths, resolved by (case-insensitive) name."""

from __future__ import annotations

import importlib
from typing import Any, ClassVar, Iterable


class KVConnectorFactory:
    _registry: ClassVar[dict] = {}
    _aliases: ClassVar[dict] = {}

    @classmethod
    def register(cls, name: str, *, worker_module: str, worker_class: str, scheduler_module: str,
                 scheduler_class: str, aliases: Iterable[str] = (), requires_pd_staging: bool = True) -> None:
        cls._registry[name] = {"worker": (worker_module, worker_class), "scheduler": (scheduler_module, scheduler_class)}
        cls._aliases[name.casefold()] = name
        for alias in aliases:
            cls._aliases[alias.strip().casefold()] = name

    @classmethod
    def canonical_name(cls, value: Any, *, path: str = "kv_transfer_config") -> str:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{path} requires a non-empty 'kv_connector' string")
        name = cls._aliases.get(value.strip().casefold())
        if name is None:
            raise ValueError(f"{path} has unknown KV connector {value!r}; available: {sorted(cls._registry)}")
        return name

    @classmethod
    def create_connector(cls, config: Any, role: str = "worker", **kwargs: Any) -> Any:
        """``kwargs`` (``block_manager``): ATOM with docs/atom-upstream.md only."""
        kv_cfg = getattr(config, "kv_transfer_config", {}) or {}
        module, klass = cls._registry[cls.canonical_name(kv_cfg.get("kv_connector", "moriio"))][role]
        return getattr(importlib.import_module(module), klass)(config, **kwargs)
