"""The seam between ``gpu_ipc``'s logic and the device: every call that
touches GPU memory, a GPU stream or a GPU event goes through one object.

What a seam does (both implementations have exactly these methods):

- ``alias(ptr, size, device)``: our registered bytes as a uint8 tensor;
- ``export(ptr, size, device)``: an exporter of one region; its
  ``share(region, written)`` makes one send (a
  :class:`~atom_kv.wire.GpuIpcRegion`), its ``close()`` lets go;
- ``written(device)``: the serving side's written event of a device (its
  ``handle`` travels in the grant, ``record()`` marks the KV written);
- ``open_peer(pid, pidfd)``: a peer map whose ``region(r)`` maps a peer's
  region and ``written(r)`` opens its written event; ``close()`` lets go;
- ``device_of(t)``, ``stream(device)``, ``using(device, streams)``: copy
  streams and the context that makes them current;
- ``order(stream, device, events)``: the stream waits on the producer's
  written events and on the consumer's current stream;
- ``record(stream)`` and ``synchronize(event)``: a fence, and a wait on it
  that sleeps instead of spinning a core.

:class:`CudaSeam` is the real one (CUDA, and HIP through ROCm builds of
torch). :mod:`atom_kv.transfer.gpu_ipc.host_seam` holds a stand-in over host
shared memory that only tests use, so the whole backend runs in the CPU
suite between real processes; only this module and the torch calls in
:mod:`atom_kv.transfer.gpu_ipc.handles` are left for the GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

from atom_kv.transfer.gpu_ipc.handles import CudaExport, CudaPeerMap, CudaWritten, alias

__all__ = ["CudaSeam"]


class CudaSeam:
    """gpu_ipc's device calls on CUDA/HIP through torch."""

    name = "cuda"
    memory_kinds = frozenset({"gpu"})

    def __init__(self) -> None:
        import torch

        self._torch = torch

    @staticmethod
    def unavailable_reason() -> Optional[str]:
        from atom_kv.transfer.memory import gpu_unavailable_reason

        return gpu_unavailable_reason()

    def alias(self, ptr: int, size: int, device: int) -> Any:
        return alias(ptr, size, device)

    def export(self, ptr: int, size: int, device: int) -> CudaExport:
        return CudaExport(ptr, size, device)

    def written(self, device: int) -> CudaWritten:
        return CudaWritten(device)

    def open_peer(self, pid: int, pidfd: Optional[int]) -> CudaPeerMap:
        return CudaPeerMap(pid)

    def device_of(self, t: Any) -> int:
        return int(t.device.index)

    def stream(self, device: int) -> Any:
        return self._torch.cuda.Stream(self._torch.device("cuda", device))

    def using(self, device: int, streams: list[Any]) -> contextlib.ExitStack:
        """``device`` and ``streams`` current for the calls inside."""
        torch = self._torch
        on = contextlib.ExitStack()
        on.enter_context(torch.cuda.device(device))
        for stream in streams:
            on.enter_context(torch.cuda.stream(stream))
        return on

    def order(self, stream: Any, device: int, events: list[Any]) -> None:
        """Work queued next on ``stream`` starts only after the producer's
        written ``events`` and whatever the consumer queued on ``device``'s
        current stream so far (a kernel still reading the blocks we overwrite).
        Called before :meth:`using` makes ``stream`` current on this thread."""
        for event in events:
            stream.wait_event(event)
        current = self._torch.cuda.current_stream(device)
        if current != stream:
            stream.wait_stream(current)

    def record(self, stream: Any) -> Any:
        """A fence after the work queued on ``stream``: a blocking-sync event,
        so a thread waiting on it sleeps instead of spinning a core."""
        event = self._torch.cuda.Event(blocking=True)
        event.record(stream)
        return event

    def synchronize(self, event: Any) -> None:
        event.synchronize()
