"""CUDA IPC memory handles through torch (ROCm builds of torch map them onto
HIP IPC): export a registered GPU region, and open a peer's.

torch exposes the handle of a storage with ``UntypedStorage._share_cuda_()``
and opens one with ``UntypedStorage._new_shared_cuda(...)`` (what
``torch.multiprocessing`` uses to pass CUDA tensors between processes).
A handle names a whole allocation of torch's caching allocator, so a region
is exported as (handle, offset of the region in that allocation, size).
``_share_cuda_`` needs the start of an allocated block: a region that starts
inside a block (a layer's view of one big KV buffer) is exported through the
block that holds it, found in the allocator's snapshot.

torch's protocol is one reference counter per send: every ``_share_cuda_``
puts the storage behind a new counter set to 1, and the one storage that
``_new_shared_cuda`` opens from it decrements it when freed. So
:class:`CudaExport` shares once per grant (per reader), never hands one
send to two readers. The event torch records at share time is not used:
the grant carries the serving backend's own *written* event instead
(:class:`CudaWritten`), re-recorded each time the engine's KV counts as
written, and :class:`CudaPeerMap` opens it once per peer and destroys it
when the peer goes.

Every failure here is a :class:`TransferError` in one line (``auto`` falls
back to staged tcp on it): memory from ``cudaMallocAsync`` or from a
pool torch cannot share, a handle the driver refuses.
"""

from __future__ import annotations

from typing import Any, Optional

from atom_kv import wire
from atom_kv.transfer._errors import TransferError
from atom_kv.transfer.staging import _CudaArray

__all__ = ["CudaExport", "CudaPeerMap", "CudaWritten", "alias", "local_device"]

_STAGED = "use backend 'tcp' (staged) or 'auto'"


def alias(ptr: int, size: int, device: int) -> Any:
    """A uint8 tensor aliasing ``size`` bytes of GPU ``device`` at ``ptr`` (no copy)."""
    import torch

    return torch.as_tensor(_CudaArray(ptr, size), device=torch.device("cuda", device))


def _unowned_storage(ptr: int, size: int, device: int) -> Any:
    """A storage over ``size`` bytes of GPU ``device`` at ``ptr`` that owns
    nothing and whose release calls no Python. ``_share_cuda_`` hands the
    storage's memory to torch's IPC limbo until every reader let go, and the
    limbo may free it at exit, after the interpreter is gone: a storage made
    by :func:`alias` (``__cuda_array_interface__``) would then drop a Python
    reference without the GIL and abort the process."""
    import torch

    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is None:  # an older torch: the alias, released before exit by close()
        return alias(ptr, size, device).untyped_storage()
    return make(ptr, torch.device("cuda", device), size)


def _block_start(ptr: int, device: int) -> int:
    """The start of the caching allocator's allocated block that holds ``ptr``."""
    import torch

    for seg in torch.cuda.memory_snapshot():
        base = int(seg["address"])
        if seg.get("device", device) != device or not base <= ptr < base + int(seg["total_size"]):
            continue
        addr = base
        for block in seg.get("blocks", []):
            start = int(block.get("address", addr))
            if start <= ptr < start + int(block["size"]) and block.get("state") == "active_allocated":
                return start
            addr = start + int(block["size"])
    raise TransferError(f"gpu_ipc: GPU memory at 0x{ptr:x} was not allocated by torch's caching allocator on "
                        f"cuda:{device}; register tensors torch allocated, or {_STAGED}")


class CudaExport:
    """Owns the storage behind one registered GPU region's IPC handles;
    :meth:`share` is one send (its own reference counter)."""

    def __init__(self, ptr: int, size: int, device: int) -> None:
        import torch

        try:
            backend = torch.cuda.get_allocator_backend()
        except Exception as exc:  # an allocator torch cannot name: nothing to share through
            raise TransferError(f"gpu_ipc: cannot query torch's CUDA allocator: {exc}; {_STAGED}") from None
        if backend != "native":
            raise TransferError(f"gpu_ipc: GPU memory from torch's {backend!r} allocator "
                                f"(PYTORCH_CUDA_ALLOC_CONF backend) cannot be shared through CUDA IPC; {_STAGED}")
        try:
            start = _block_start(ptr, device)
            self._storage = _unowned_storage(start, size if start == ptr else 1, device)
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"gpu_ipc: cannot export GPU memory at 0x{ptr:x}: {exc}; {_STAGED}") from None
        self._ptr, self._start, self._size, self._device = ptr, start, size, device

    def share(self, region: int, written: Optional[bytes]) -> wire.GpuIpcRegion:
        """The handle of one send of this region; ``written`` is the serving
        backend's written-event handle for the region's GPU."""
        storage = self._storage
        if storage is None:
            raise TransferError("gpu_ipc: the region was unregistered")
        try:
            dev, handle, _, block_offset, rc_handle, rc_offset, _, _ = storage._share_cuda_()
        except Exception as exc:  # a MemPool or expandable segment torch refuses to share, a driver error
            raise TransferError(f"gpu_ipc: cannot share GPU memory at 0x{self._ptr:x} on cuda:{self._device}: "
                                f"{exc}; {_STAGED}") from None
        return wire.GpuIpcRegion(
            region=region, device=int(dev), handle=bytes(handle), offset=int(block_offset) + (self._ptr - self._start),
            size=self._size, addr=self._ptr, ref_counter_handle=None if rc_handle is None else bytes(rc_handle),
            ref_counter_offset=int(rc_offset or 0), event_handle=written, event_sync_required=written is not None,
            uuid=_uuid(int(dev)),
        )

    def close(self) -> None:
        """Drop the storage: torch keeps each send's memory in its limbo until
        its reader let go; what the readers already let go is collected now,
        so a process that exits after close() leaves torch nothing to warn of."""
        if self._storage is None:
            return
        self._storage = None
        try:
            import torch

            torch.cuda.ipc_collect()
        except Exception:  # nothing to collect through: the memory stays in torch's limbo until exit
            pass


class CudaWritten:
    """Owns the serving side's *written* event of one GPU: interprocess,
    blocking-sync, re-recorded on the engine's current stream by
    :meth:`record` each time the engine's KV counts as written."""

    def __init__(self, device: int) -> None:
        import torch

        self._torch = torch
        self._device = device
        self._event = torch.cuda.Event(blocking=True, interprocess=True)
        with torch.cuda.device(device):  # created here, on its GPU (an event is created on first use)
            self.handle = bytes(self._event.ipc_handle())

    def record(self) -> None:
        torch = self._torch
        self._event.record(torch.cuda.current_stream(self._device))


def _uuid(device: int) -> str:
    import torch

    return str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))


def local_device(r: wire.GpuIpcRegion) -> int:
    """This process's index of the GPU holding ``r`` (found by UUID: indices
    differ between processes with different ``CUDA_VISIBLE_DEVICES``)."""
    import torch

    if not r.uuid:
        return r.device
    for i in range(torch.cuda.device_count()):
        if _uuid(i) == r.uuid:
            return i
    raise TransferError(f"gpu_ipc: the peer's GPU {r.uuid} is not visible in this process "
                        "(CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES); GPU IPC needs it visible to both engines")


class CudaPeerMap:
    """Owns what one peer's grant opened here: its regions' mappings (torch
    maps each allocation once per process) and its written events, opened
    once per GPU and destroyed (dropped) by :meth:`close`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._events: dict[tuple[int, bytes], Any] = {}

    def region(self, r: wire.GpuIpcRegion) -> Any:
        """Map a peer's region as a uint8 tensor (its ref counter is released when the tensor is freed)."""
        import torch

        try:
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(
                local_device(r), r.handle, r.size, r.offset, r.ref_counter_handle or b"", r.ref_counter_offset,
                # the producer's order comes from the written event (written()), not torch's; torch >= 2.11
                # takes bytes here even when no event is required (None is refused)
                b"", False,
            )
            typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
            return torch._utils._rebuild_tensor(typed, 0, (r.size,), (1,))
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"gpu_ipc: cannot map the GPU memory of peer pid {self.pid}: {exc}") from None

    def written(self, r: wire.GpuIpcRegion) -> Optional[Any]:
        """The peer's written event for ``r``'s GPU (None when it sent none)."""
        if not r.event_sync_required or not r.event_handle:
            return None
        import torch

        device = local_device(r)
        key = (device, r.event_handle)
        event = self._events.get(key)
        if event is None:
            try:
                event = self._events[key] = torch.cuda.Event.from_ipc_handle(device, r.event_handle)
            except Exception as exc:
                raise TransferError(f"gpu_ipc: cannot open the written event of peer pid {self.pid}: {exc}") from None
        return event

    def close(self) -> None:
        self._events.clear()  # the last reference: torch destroys each opened event
