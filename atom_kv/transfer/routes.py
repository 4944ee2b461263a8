"""Which inner backend ``auto`` uses for one peer: a pure function of both
sides' memory kinds, whether they share a host, and the backends both offer.

:data:`ROUTES` is an ordered preference list; the first route that fits wins.
A new backend (an RDMA one for GPU memory across hosts, say) is one more
:class:`Route` inserted before ``tcp``, which fits every pair and so is always
the last resort.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Sequence

__all__ = ["ROUTES", "Route", "choose_route"]

_ANY = frozenset({"host", "gpu"})


@dataclass(frozen=True)
class Route:
    """Backend ``backend`` reads ``peer`` memory kinds into ``local`` ones;
    ``same_host`` when it only works between processes of one host."""

    backend: str
    local: frozenset[str]
    peer: frozenset[str]
    same_host: bool

    def fits(self, local: AbstractSet[str], peer: AbstractSet[str], same_host: bool) -> bool:
        return local <= self.local and peer <= self.peer and (same_host or not self.same_host)


#: tried in order: GPU to GPU on one host, host to host on one host, GPU to
#: GPU across hosts over NIXL (RDMA) when both sides offer it, then staged tcp
#: for anything
ROUTES: tuple[Route, ...] = (
    Route("gpu_ipc", frozenset({"gpu"}), frozenset({"gpu"}), same_host=True),
    Route("cma", frozenset({"host"}), frozenset({"host"}), same_host=True),
    Route("nixl", frozenset({"gpu"}), frozenset({"gpu"}), same_host=False),
    Route("tcp", _ANY, _ANY, same_host=False),
)


def choose_route(
    local: AbstractSet[str],
    peer: AbstractSet[str],
    *,
    same_host: bool,
    offered: AbstractSet[str],
    routes: Sequence[Route] = ROUTES,
) -> str:
    """The first route of ``routes`` that fits this pair of memory kinds and
    hosts and whose backend both sides ``offered``; raises ``ValueError``
    (one line) when none does."""
    for route in routes:
        if route.backend in offered and route.fits(local, peer, same_host):
            return route.backend
    raise ValueError(f"no transfer route reads {'+'.join(sorted(peer))} memory into {'+'.join(sorted(local))} "
                     f"memory {'on one host' if same_host else 'across hosts'} with {', '.join(sorted(offered))}")
