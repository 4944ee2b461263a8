"""A FAKE device copier for staged ``tcp`` on host memory: the copies are host
copies, done at once, but each fence completes only ``fence_delay_s`` after
it was recorded, as a GPU's copy completes some time after it was queued.

Tests and ``python -m atom_kv.bench transfer --backend tcp --seam host`` set
it as ``TcpBackend.staging_copier`` (with ``stage_host_memory``) to see how
much of a device's latency the staging pipeline hides. A wait on a fence
that is not complete sleeps for what is left (it never spins).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import numpy as np

from atom_kv.transfer.staging import HostCopier, HostLane

__all__ = ["FakeDeviceCopier"]


class _DelayedLane(HostLane):
    """A lane whose fences complete ``delay_s`` after they were recorded; logs to its copier."""

    def __init__(self, copier: "FakeDeviceCopier") -> None:
        self._copier = copier

    def gather(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> None:
        self._copier._note("gather", None)
        super().gather(dst, src, size)

    def scatter(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> None:
        self._copier._note("scatter", None)
        super().scatter(dst, src, size)

    def fence(self, slot: int) -> Any:
        self._copier._note("fence", slot)
        return (slot, time.monotonic() + self._copier.fence_delay_s)

    def query(self, token: Any) -> bool:
        return time.monotonic() >= token[1]

    def wait(self, token: Any) -> None:
        left = token[1] - time.monotonic()
        if left > 0:
            self._copier._note("wait", token[0])
            time.sleep(left)


class FakeDeviceCopier(HostCopier):
    """A FAKE GPU copier on host memory (see the module's docstring). ``log``,
    when ``record`` is set, lists ("gather"|"scatter"|"fence"|"wait", slot)
    in order; ``waits`` counts the waits that slept."""

    def __init__(self, fence_delay_s: float = 300e-6, record: bool = False, device: Optional[int] = 0) -> None:
        super().__init__()
        self.fence_delay_s = fence_delay_s
        self.device = device
        self.record = record
        self.log: list[tuple[str, Optional[int]]] = []
        self.waits = 0
        self._lock = threading.Lock()

    def lane(self) -> _DelayedLane:
        return _DelayedLane(self)

    def _note(self, what: str, slot: Optional[int]) -> None:
        with self._lock:
            if what == "wait":
                self.waits += 1
            if self.record:
                self.log.append((what, slot))
