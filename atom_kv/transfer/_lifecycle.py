"""The open/closed life of a transfer backend, in one place.

Every backend refuses work once closed with the same words, closes exactly
once however often ``close()`` is called, and (the host-memory ones) fails
read handles at their deadline from one named thread started on first use.
"""

from __future__ import annotations

import threading
from typing import Optional, Union

from atom_kv.transfer._deadlines import DeadlineWatch
from atom_kv.transfer.base import BackendClosed, ReadFailure, ReadHandle, ReadRefusal

__all__ = ["Lifecycle"]

_Lock = Union["threading.Lock", "threading.RLock"]


class Lifecycle:
    """Owns a backend's closed flag (guarded by the backend's ``lock``) and its
    :class:`DeadlineWatch`. ``label`` names the backend in errors ("tcp");
    ``closed_error`` overrides the "<label>: backend is closed" wording."""

    def __init__(self, label: str, lock: _Lock, *, key: str = "", closed_error: Optional[str] = None) -> None:
        self.label = label
        self.lock = lock
        self.closed = False
        self._closed_error = closed_error or f"{label}: backend is closed"
        self._watch_name = f"atomkv-{label}-deadline-{key}"
        self._watch: Optional[DeadlineWatch] = None

    def check_open(self) -> None:
        """Raise :class:`BackendClosed` (a :class:`TransferError`) once the backend is closed."""
        if self.closed:
            raise BackendClosed(self._closed_error)

    def read_refusal(self, peer: object, peer_id: str) -> Optional[ReadRefusal]:
        """Why a read from ``peer_id`` (looked up as ``peer``, None if unknown)
        cannot start, or None. Call under :attr:`lock`."""
        if self.closed:
            return ReadRefusal(ReadFailure.CLOSED, "backend is closed")
        if peer is None:
            return ReadRefusal(ReadFailure.UNKNOWN_PEER, f"unknown peer {peer_id!r}")
        return None

    def mark_closed(self) -> bool:
        """Mark the backend closed; False when it already was (then do nothing
        more). Call under :attr:`lock`."""
        if self.closed:
            return False
        self.closed = True
        return True

    def watch(self, handle: ReadHandle, timeout_s: float, what: str) -> None:
        """Fail ``handle`` if it has not finished within ``timeout_s`` (the
        deadline thread starts on first use). A closed backend arms nothing:
        its read jobs are refused at close, which finishes the handle."""
        with self.lock:
            if self.closed:
                return
            if self._watch is None:
                self._watch = DeadlineWatch(self._watch_name)
            watch = self._watch
        watch.watch(handle, timeout_s, what)

    def stop_deadlines(self) -> None:
        """Stop the deadline thread (failing what it still watches). After :meth:`mark_closed`."""
        with self.lock:
            watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()
