"""One leg's routing decision (:class:`Pick`), shared by the relay and the decode stream it hands out."""

from __future__ import annotations

from dataclasses import dataclass

from atom_kv.proxy.fleet.registry import Instance

__all__ = ["Pick"]


@dataclass
class Pick:
    """One leg's routing decision and what was charged for it."""

    inst: Instance
    rank: int
    tokens: int
    credited: bool = False

    def credit(self) -> None:
        if not self.credited:
            self.credited = True
            self.inst.credit(self.rank, self.tokens)
