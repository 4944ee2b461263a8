"""Where each of ATOM's sequences stands with the ATOM connector: one record per sequence id, its state an Enum."""

from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Any, Optional

__all__ = ["SeqState", "SequenceTable"]


class SeqState(enum.Enum):
    """One sequence's state in :class:`SequenceTable` (``pending``: ATOM keeps polling the connector for it)."""

    #: both roles: matched, its blocks not yet allocated (an abort before that must unregister it)
    MATCHED = "matched"
    #: consumer: parked (``WAITING_FOR_REMOTE_KVS``) while its load runs into ``seq.block_table``
    LOADING = "loading"
    #: consumer: loaded, until ATOM runs it or drops it (then LOCAL)
    LOADED = "loaded"
    #: consumer: ended while loading; its blocks are freed once no rank can still write them
    DRAINING = "draining"
    #: consumer: loaded, failed or ran: it never loads again (prefilled locally if admitted again)
    LOCAL = "local"
    #: producer: finished, its prompt blocks lent to decode engines until the hooks free them
    LENT = "lent"
    #: producer: finished, nothing lent: ATOM may free its blocks at the next poll
    FREE_NOW = "free_now"

    @property
    def pending(self) -> bool:
        """Whether ATOM must keep polling for a sequence in this state (LENT is the hooks' lease)."""
        return self not in (SeqState.LOCAL, SeqState.LENT)


class _Record:
    __slots__ = ("seq", "state")

    def __init__(self, seq: Any, state: SeqState) -> None:
        self.seq = seq
        self.state = state


class SequenceTable:
    """Owns the connector's record of every sequence it tracks, keyed by ATOM's ``seq.id``: the ``Sequence`` and
    its :class:`SeqState`, one state per id. LOCAL records keep no ``Sequence`` and are bounded: past
    ``remembered`` of them the oldest is forgotten (ATOM may drop a request without telling the connector).
    Called only from ATOM's scheduler thread."""

    def __init__(self, remembered: int = 65536) -> None:
        if remembered < 1:
            raise ValueError(f"remembered must be >= 1, got {remembered}")
        self._remembered = remembered
        self._records: OrderedDict[int, _Record] = OrderedDict()  # oldest state change first
        self._local = 0

    def state(self, sid: int) -> Optional[SeqState]:
        record = self._records.get(sid)
        return None if record is None else record.state

    def put(self, sid: int, seq: Any, state: SeqState) -> None:
        """Record ``seq`` as ``state`` (replacing its record, if any, as the newest)."""
        self._remove(sid)
        self._records[sid] = _Record(None if state is SeqState.LOCAL else seq, state)
        if state is SeqState.LOCAL:
            self._local += 1
            if self._local > self._remembered:
                self._forget_oldest_local()

    def take(self, sid: int, *states: SeqState) -> Any:
        """Remove the record of ``sid`` if its state is one of ``states`` (any state when none are named) and
        return its ``Sequence``; None when it had none, or no such record."""
        record = self._records.get(sid)
        if record is None or (states and record.state not in states):
            return None
        self._remove(sid)
        return record.seq

    def each(self, state: SeqState) -> list[tuple[int, Any]]:
        """``(id, Sequence)`` of every record in ``state``, oldest first (a copy: safe to change the table)."""
        return [(sid, r.seq) for sid, r in self._records.items() if r.state is state]

    def has_pending(self) -> bool:
        """Whether any record is in a :attr:`SeqState.pending` state."""
        return any(r.state.pending for r in self._records.values())

    def count(self, state: SeqState) -> int:
        if state is SeqState.LOCAL:
            return self._local
        return sum(1 for r in self._records.values() if r.state is state)

    def states(self) -> dict[int, SeqState]:
        """Every id and its state (a copy, for logs and checks)."""
        return {sid: r.state for sid, r in self._records.items()}

    def __len__(self) -> int:
        return len(self._records)

    def _remove(self, sid: int) -> None:
        record = self._records.pop(sid, None)
        if record is not None and record.state is SeqState.LOCAL:
            self._local -= 1

    def _forget_oldest_local(self) -> None:
        for sid, record in self._records.items():
            if record.state is SeqState.LOCAL:
                self._remove(sid)
                return
