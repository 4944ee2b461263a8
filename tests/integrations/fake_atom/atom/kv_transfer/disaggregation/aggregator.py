"""FAKE TP aggregator: an id is done when every worker reported it; a failure on any worker wins."""

from __future__ import annotations

from atom.kv_transfer.disaggregation.types import KVConnectorOutput


class KVOutputAggregator:
    def __init__(self, world_size: int = 8) -> None:
        self.world_size = world_size
        self._send: dict = {}
        self._recv: dict = {}

    def aggregate(self, worker_outputs: list) -> KVConnectorOutput:
        for idx, out in enumerate(worker_outputs):
            for key in out.finished_sending:
                self._send.setdefault(key, {})[idx] = True
            for key in out.finished_recving:
                reports = self._recv.setdefault(key, {})
                reports[idx] = reports.get(idx, True)
            for key in out.failed_recving:
                self._recv.setdefault(key, {})[idx] = False
        sent = {k for k, r in self._send.items() if len(r) == self.world_size}
        for k in sent:
            del self._send[k]
        done = {k: all(r.values()) for k, r in self._recv.items() if len(r) == self.world_size}
        for k in done:
            del self._recv[k]
        return KVConnectorOutput(finished_sending=sent, finished_recving={k for k, ok in done.items() if ok},
                                 failed_recving={k for k, ok in done.items() if not ok})
