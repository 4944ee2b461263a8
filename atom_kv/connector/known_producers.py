"""The producers a decode engine has completed a handshake with: how far its releases fan out.

A release names a producer by what a request's ``kv_transfer_params`` said (host, base
handshake port, TP size, pipeline stages, DP rank), and any client of the engine's HTTP
port can say anything there. Only a handshake shows that a producer with that layout
listens there: the rank that answered said which TP rank, stage and DP rank it is, and
a decode rank accepts it only when that is what the params placed on its port
(:class:`~atom_kv.connector.peers.PeerTable`). The scheduler learns it from the ranks'
reports: a load that was read, or one that failed after a rank's handshake with its
producer succeeded (``KVConnectorOutput.reached``).

Until then the params are a client's word, and a release goes to the first rank alone
(TP rank 0 of the first stage of the DP rank: where a load's first handshake goes), never
to a range of ports a client sized. A producer with more ranks that no rank here ever
completed a handshake with frees its other ranks' blocks when its lease ends.
"""

from __future__ import annotations

from atom_kv._lru import BoundedSet
from atom_kv.connector.release import ReleaseSpec

__all__ = ["KnownProducers", "MAX_KNOWN_PRODUCERS"]

#: producer layouts remembered (the least recently answered forgotten first)
MAX_KNOWN_PRODUCERS = 4096

#: (host, base handshake port, TP size, DP rank, pipeline stages, DP size)
_Layout = tuple[str, int, int, int, int, int]


def _layout(spec: ReleaseSpec) -> _Layout:
    return spec.host, spec.handshake_port, spec.tp_size, spec.dp_rank, spec.pp_size, spec.dp_size


class KnownProducers:
    """Owns the bounded set of producer layouts whose handshake a rank of this engine completed
    (used on the scheduler's thread only)."""

    def __init__(self, capacity: int = MAX_KNOWN_PRODUCERS) -> None:
        self._known: BoundedSet[_Layout] = BoundedSet(capacity)

    def answered(self, spec: ReleaseSpec) -> None:
        """A rank of ``spec``'s producer answered a handshake as the rank its port places."""
        self._known.add(_layout(spec))

    def reach(self, spec: ReleaseSpec) -> ReleaseSpec:
        """``spec`` when its producer is known, else the same release to its first rank only."""
        return spec if _layout(spec) in self._known else spec.first_rank()

    def __len__(self) -> int:
        return len(self._known)
