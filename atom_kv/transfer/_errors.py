"""The transfer layer's exceptions (re-exported by ``atom_kv.transfer``)."""

from __future__ import annotations

__all__ = [
    "BackendClosed", "BackendUnavailable", "OutOfBounds", "PeerUnreachable", "TransferError", "UnknownPeer",
    "UnsupportedMemory",
]


class TransferError(RuntimeError):
    """A transfer could not be performed; the message says why."""


class PeerUnreachable(TransferError):
    """No connection to the peer could be made (refused, or not answered within the connect
    timeout): the path to it is closed, and trying again at once will not open it."""


class BackendClosed(TransferError):
    """The backend was closed: it takes no more work."""


class UnknownPeer(TransferError):
    """A read names a peer id that was never added (or was removed)."""


class OutOfBounds(TransferError):
    """A read names a range outside the registered regions (this engine's or the peer's)."""


class BackendUnavailable(TransferError):
    """The backend cannot run on this machine (missing library, kernel policy)."""


class UnsupportedMemory(TransferError):
    """A backend was handed memory of a kind it cannot serve or read; raised at
    registration, before the memory's pointer is used."""
