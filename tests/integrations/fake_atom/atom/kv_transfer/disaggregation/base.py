"""FAKE connector base classes: the abstract methods ATOM's are declared with."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class KVConnectorBase(ABC):
    is_producer: bool

    @abstractmethod
    def register_kv_caches(self, kv_caches: dict, transfer_tensors: Any = None, num_blocks: Any = None) -> None: ...

    @abstractmethod
    def start_load_kv(self, metadata: Any) -> None: ...

    @abstractmethod
    def get_finished(self) -> Any: ...

    def get_finished_recv_blocks(self) -> list:
        return []


class KVConnectorSchedulerBase(ABC):
    is_producer: bool

    @abstractmethod
    def get_num_new_matched_tokens(self, seq: Any) -> tuple[int, bool]: ...

    @abstractmethod
    def build_connector_meta(self) -> Any: ...

    @abstractmethod
    def update_state_after_alloc(self, seq: Any) -> None: ...

    @abstractmethod
    def request_finished(self, seq: Any) -> None: ...
