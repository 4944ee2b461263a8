"""Pure logic of the ``nixl`` backend: no NIXL import, no threads.

* :class:`Regions`: one side's registered regions (address, size, device) as
  numpy columns, with the NIXL memory segment of each ("DRAM" or "VRAM");
* :class:`UnitLayout`: a side's regions cut into equal ``unit``-byte
  descriptors, the rows of a *prepared* NIXL descriptor list, per segment;
* :func:`plan_read`: merged, bounds-checked ops -> one :class:`Transfer` per
  (local segment, remote segment) pair (one in practice), either as indices
  into both sides' prepared lists (ranges on the unit grid, a few units each:
  scattered blocks) or as explicit ``(address, length, device)`` rows (long
  merged ranges, ranges off the grid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from atom_kv.transfer._regions import LOCAL_OFFSET, LOCAL_REGION, REMOTE_OFFSET, REMOTE_REGION, SIZE, out_of_bounds
from atom_kv.transfer.base import OutOfBounds, TransferError

__all__ = ["DRAM", "VRAM", "MAX_PREPPED_DESCS", "Regions", "Transfer", "UnitLayout", "plan_read"]

DRAM = "DRAM"
VRAM = "VRAM"

#: most descriptors one prepared list may hold; larger layouts read through
#: explicit descriptor lists instead (NIXL keeps a few dozen bytes per row)
MAX_PREPPED_DESCS = 1 << 22

#: a read goes through the prepared lists while its merged ranges average at
#: most this many units; longer ranges are fewer rows as explicit descriptors
#: (one row per range) than as prepared indices (one per unit)
MAX_UNITS_PER_RANGE = 8


def segment_of(device: int) -> str:
    """NIXL's memory segment for a region on ``device`` (-1: host memory)."""
    return DRAM if device < 0 else VRAM


@dataclass
class Regions:
    """Registered regions of one side, indexed by region id."""

    addrs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    devices: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: gcd of the block sizes registered (the finest grid every region is cut on)
    align: int = 0

    @classmethod
    def of(cls, addrs: list[int], sizes: list[int], devices: list[int], align: int) -> "Regions":
        if not (len(addrs) == len(sizes) == len(devices)):
            raise TransferError(f"NIXL descriptor lists {len(addrs)} addresses, {len(sizes)} sizes "
                                f"and {len(devices)} devices; they must match")
        out = cls(np.asarray(addrs, np.int64), np.asarray(sizes, np.int64), np.asarray(devices, np.int64), int(align))
        if len(out.sizes) and (bool((out.sizes <= 0).any()) or bool((out.addrs <= 0).any())):
            raise TransferError("NIXL descriptor has a region with a non-positive address or size")
        return out

    def add(self, addrs: list[int], sizes: list[int], device: int, align: int) -> None:
        self.addrs = np.concatenate([self.addrs, np.asarray(addrs, np.int64)])
        self.sizes = np.concatenate([self.sizes, np.asarray(sizes, np.int64)])
        self.devices = np.concatenate([self.devices, np.full(len(addrs), device, np.int64)])
        self.align = math.gcd(self.align, int(align))

    def __len__(self) -> int:
        return len(self.sizes)

    def segments(self) -> list[str]:
        """The segments present, DRAM first."""
        return [s for s in (DRAM, VRAM) if bool((self.seg_mask(s)).any())]

    def seg_mask(self, seg: str) -> np.ndarray:
        return self.devices < 0 if seg == DRAM else self.devices >= 0

    def rows(self, regions: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """``(address, length, device)`` rows (uint64) of bounds-checked ranges;
        NIXL numbers host memory as device 0."""
        out = np.empty((len(regions), 3), np.uint64)
        out[:, 0] = self.addrs[regions] + offsets
        out[:, 1] = sizes
        out[:, 2] = np.maximum(self.devices[regions], 0)
        return out


@dataclass
class UnitLayout:
    """A side's regions cut into ``unit``-byte descriptors: per segment, the
    rows of one prepared list; per region, its first row in that list and how
    many whole units it holds (a shorter tail is left out and read through
    explicit descriptors)."""

    unit: int
    first: np.ndarray  # region id -> index of its first unit in its segment's list
    units: np.ndarray  # region id -> whole units in the region
    rows: dict[str, np.ndarray]  # segment -> (n, 3) uint64 rows

    @classmethod
    def build(cls, regions: Regions, unit: int) -> Optional["UnitLayout"]:
        """The layout, or None when it would exceed :data:`MAX_PREPPED_DESCS`."""
        units = regions.sizes // unit
        if int(units.sum()) > MAX_PREPPED_DESCS or unit <= 0:
            return None
        first = np.zeros(len(regions), np.int64)
        rows: dict[str, np.ndarray] = {}
        for seg in regions.segments():
            ids = np.flatnonzero(regions.seg_mask(seg))
            counts = units[ids]
            starts = np.cumsum(counts) - counts
            first[ids] = starts
            total = int(counts.sum())
            within = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
            owner = np.repeat(ids, counts)
            seg_rows = np.empty((total, 3), np.uint64)
            seg_rows[:, 0] = regions.addrs[owner] + within * unit
            seg_rows[:, 1] = unit
            seg_rows[:, 2] = np.maximum(regions.devices[owner], 0)
            rows[seg] = seg_rows
        return cls(unit, first, units, rows)

    def fits(self, regions: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> bool:
        """Whether every range lies on this layout's grid and inside whole units."""
        u = self.unit
        return bool(((offsets % u) == 0).all() and ((sizes % u) == 0).all()
                    and ((offsets + sizes) <= self.units[regions] * u).all())

    def indices(self, regions: np.ndarray, offsets: np.ndarray, counts: np.ndarray, within: np.ndarray) -> np.ndarray:
        """Row indices (int32) of the units the ranges cover, in range order."""
        starts = self.first[regions] + offsets // self.unit
        return (np.repeat(starts, counts) + within).astype(np.int32)


@dataclass
class Transfer:
    """One NIXL transfer to issue: prepared indices (``local_idx`` /
    ``remote_idx``) or explicit rows (``local_rows`` / ``remote_rows``)."""

    local_seg: str
    remote_seg: str
    nbytes: int
    local_idx: Optional[np.ndarray] = None
    remote_idx: Optional[np.ndarray] = None
    local_rows: Optional[np.ndarray] = None
    remote_rows: Optional[np.ndarray] = None

    @property
    def prepped(self) -> bool:
        return self.local_idx is not None


def check_remote(table: np.ndarray, remote: Regions, peer: str) -> None:
    """Raise :class:`TransferError` ("... outside ...") for the first remote
    range not inside the peer's registered regions."""
    bad = out_of_bounds(table[:, REMOTE_REGION], table[:, REMOTE_OFFSET], table[:, SIZE], remote.sizes)
    if bad is not None:
        _, _, rr, ro, sz = (int(x) for x in table[bad])
        raise OutOfBounds(f"NIXL read from peer {peer}: remote range (region {rr}, offset {ro}, size {sz}) "
                            "is outside the peer's registered regions")


def plan_read(
    table: np.ndarray,
    local: Regions,
    remote: Regions,
    local_layout: Optional[UnitLayout],
    remote_layout: Optional[UnitLayout],
) -> list[Transfer]:
    """The transfers for merged, bounds-checked ``table`` (an (n, 5) int64 op
    array): one per (local segment, remote segment) pair present."""
    lsegs = (local.devices[table[:, LOCAL_REGION]] >= 0).astype(np.int8)
    rsegs = (remote.devices[table[:, REMOTE_REGION]] >= 0).astype(np.int8)
    pairs = lsegs * 2 + rsegs
    out = []
    uniq = np.unique(pairs)
    for pair in uniq.tolist():
        part = table if len(uniq) == 1 else table[pairs == pair]
        lseg, rseg = (VRAM if pair >= 2 else DRAM), (VRAM if pair % 2 else DRAM)
        out.append(_one(part, local, remote, local_layout, remote_layout, lseg, rseg))
    return out


def _one(part: np.ndarray, local: Regions, remote: Regions, ll: Optional[UnitLayout], rl: Optional[UnitLayout],
         lseg: str, rseg: str) -> Transfer:
    lr, lo, rr, ro, sz = (part[:, c] for c in (LOCAL_REGION, LOCAL_OFFSET, REMOTE_REGION, REMOTE_OFFSET, SIZE))
    nbytes = int(sz.sum())
    if (ll is not None and rl is not None and ll.unit == rl.unit and nbytes <= MAX_UNITS_PER_RANGE * ll.unit * len(part)
            and ll.fits(lr, lo, sz) and rl.fits(rr, ro, sz)):
        counts = sz // ll.unit
        total = int(counts.sum())
        within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        return Transfer(lseg, rseg, nbytes, local_idx=ll.indices(lr, lo, counts, within),
                        remote_idx=rl.indices(rr, ro, counts, within))
    return Transfer(lseg, rseg, nbytes, local_rows=local.rows(lr, lo, sz), remote_rows=remote.rows(rr, ro, sz))
