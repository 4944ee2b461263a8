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
- ``address(t)``, ``device_of(t)``: where a mapped tensor's bytes are;
- ``prepare(device, peer_device)``, ``stream(device)``: made at add_peer, once per
  peer and device (peer access; the peer's copy stream);
- ``event(device)``: a fence event (timing-disabled, blocking-sync), made
  for a pool and reused;
- ``order(stream, device, written, ordering)``: the stream waits on the
  producer's written events and on the consumer's current stream, through
  ``ordering``, an event of the stream re-recorded each time (no event is
  made per read);
- ``copy(stream, batch)``: one batched copy of a
  :class:`~atom_kv.transfer.gpu_ipc.plan.Batch` (pointer arrays);
- ``record(event, stream)``, ``query(event)``, ``synchronize(event)``: a
  fence, a poll of it, and a wait on it that sleeps instead of spinning;
- ``stream_wait(stream, event)``: another stream (the engine's) waits on a fence.

:class:`CudaSeam` is the real one (CUDA, and HIP through ROCm builds of
torch); its copies are :class:`~atom_kv.transfer._device_copy.AddressCopier`
calls (``cuMemcpyBatchAsync`` where the driver has it). :mod:`atom_kv.transfer.gpu_ipc.host_seam`
holds a stand-in over host shared memory that only tests and the host-seam
bench use, so the whole backend runs in the CPU suite between real
processes; only this module and the torch calls in
:mod:`atom_kv.transfer.gpu_ipc.handles` are left for the GPU.
"""

from __future__ import annotations

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
        self._address_copier: Any = False  # made on the first copy (False: not yet looked for)

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

    def address(self, t: Any) -> int:
        return int(t.data_ptr())

    def device_of(self, t: Any) -> int:
        return int(t.device.index)

    def prepare(self, device: int, peer_device: int) -> None:
        """Before copies from ``peer_device`` into ``device``: a one-byte copy between
        them, through which torch enables peer access (the driver's copies by
        address then go GPU to GPU, not through the host)."""
        if device == peer_device:
            return
        torch = self._torch
        a = torch.zeros(1, dtype=torch.uint8, device=torch.device("cuda", peer_device))
        torch.zeros(1, dtype=torch.uint8, device=torch.device("cuda", device)).copy_(a)
        torch.cuda.synchronize(device)

    def stream(self, device: int) -> Any:
        return self._torch.cuda.Stream(self._torch.device("cuda", device))

    def event(self, device: int) -> Any:
        """A fence event: timing disabled, blocking-sync (a thread waiting on it sleeps).
        torch creates it on the device of the stream it is first recorded on."""
        return self._torch.cuda.Event(enable_timing=False, blocking=True)

    def order(self, stream: Any, device: int, written: list[Any], ordering: Any) -> None:
        """Work queued next on ``stream`` starts only after the producer's
        ``written`` events and whatever the consumer queued on ``device``'s
        current stream so far (a kernel still reading the blocks we overwrite):
        ``ordering`` is recorded there and waited on (a wait takes the event as
        it is when called, so one event per stream serves every read)."""
        for event in written:
            stream.wait_event(event)
        current = self._torch.cuda.current_stream(device)
        if current != stream:
            ordering.record(current)
            stream.wait_event(ordering)

    def copy(self, stream: Any, batch: Any) -> None:
        """One batched copy on ``stream``: by address through the driver, or, where the
        driver cannot be loaded, through torch (one copy per range)."""
        copier = self._copier()
        if copier is not None:
            copier.copy(int(stream.cuda_stream), batch.dst_device, batch.dst, batch.src, batch.size)
            return
        self._torch_copy(stream, batch)

    def _copier(self) -> Any:
        if self._address_copier is False:
            from atom_kv.transfer._device_copy import AddressCopier, driver_for_torch

            driver = driver_for_torch(self._torch)
            self._address_copier = AddressCopier(driver) if driver is not None else None
        return self._address_copier

    def _torch_copy(self, stream: Any, batch: Any) -> None:
        from atom_kv.transfer.staging import _CudaArray

        torch = self._torch
        device = torch.device("cuda", batch.dst_device)
        with torch.cuda.device(batch.dst_device), torch.cuda.stream(stream):
            for d, s, n in zip(batch.dst.tolist(), batch.src.tolist(), batch.size.tolist()):
                dst = torch.as_tensor(_CudaArray(d, n), device=device)
                src = torch.as_tensor(_CudaArray(s, n), device=torch.device("cuda", batch.src_device))
                dst.copy_(src, non_blocking=True)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def stream_wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)
