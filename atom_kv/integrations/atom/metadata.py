"""The per-step metadata ATOM carries from the scheduler-side connector to every TP rank."""

from __future__ import annotations

from atom.kv_transfer.disaggregation.types import ConnectorMetadata as _AtomConnectorMetadata

from atom_kv.engine_hooks.types import ConnectorMetadata

__all__ = ["AtomKVMetadata"]


class AtomKVMetadata(_AtomConnectorMetadata):
    """ATOM's ``ConnectorMetadata`` with atom-kv's step metadata (``step``: loads,
    sends, released and cancelled transfers) and the engine id every rank of
    this engine answers handshakes with.

    ATOM pickles it into the batch it sends to the model runners; ATOM's own
    request dictionaries stay empty (they describe ATOM's connectors' work,
    which ATOM only inspects for its offload connector).
    """

    def __init__(self, engine_id: str, step: ConnectorMetadata) -> None:
        super().__init__()
        self.engine_id = engine_id
        self.step = step

    def __repr__(self) -> str:
        s = self.step
        return (f"AtomKVMetadata(engine={self.engine_id}, loads={len(s.loads)}, sends={len(s.sends)}, "
                f"released={len(s.released)}, cancelled={len(s.cancelled)})")
