"""FAKE connector types: ATOM's per-worker output (sets of ids) and metadata (a plain object)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVConnectorOutput:
    finished_sending: set = field(default_factory=set)
    finished_recving: set = field(default_factory=set)
    failed_recving: set = field(default_factory=set)
    finished_saving: set = field(default_factory=set)
    finished_loading: set = field(default_factory=set)
    failed_loading: set = field(default_factory=set)
    expected_finished_count: int = 0
    connector_completions: set = field(default_factory=set)


class ConnectorMetadata:
    def __init__(self) -> None:
        self.reqs_to_recv: dict = {}
        self.reqs_to_save: dict = {}
        self.reqs_to_send: dict = {}
        self.reqs_in_batch: set = set()
        self.reqs_not_processed: set = set()
        self.request_id_to_transfer_id: dict = {}
