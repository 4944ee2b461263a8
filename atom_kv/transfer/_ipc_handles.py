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
"""

from __future__ import annotations

from typing import Any

from atom_kv import wire
from atom_kv.transfer._errors import TransferError
from atom_kv.transfer.staging import _CudaArray

__all__ = ["alias", "export_region", "local_device", "open_region"]


def alias(ptr: int, size: int, device: int) -> Any:
    """A uint8 tensor aliasing ``size`` bytes of GPU ``device`` at ``ptr`` (no copy)."""
    import torch

    return torch.as_tensor(_CudaArray(ptr, size), device=torch.device("cuda", device))


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
    raise TransferError(f"gpu_ipc: GPU memory at 0x{ptr:x} was not allocated by torch on cuda:{device}; "
                        "register tensors torch allocated, or use backend 'tcp' (staged)")


def export_region(region: int, ptr: int, size: int, device: int) -> tuple[wire.GpuIpcRegion, Any]:
    """The IPC handle of ``size`` bytes at ``ptr`` on ``device``, and the
    storage that must stay alive while the handle is out."""
    try:
        storage = alias(ptr, size, device).untyped_storage()
        shared = storage._share_cuda_()
        start = ptr
    except RuntimeError:  # not the start of a block: share the block that holds it
        start = _block_start(ptr, device)
        storage = alias(start, 1, device).untyped_storage()
        shared = storage._share_cuda_()
    dev, handle, _, block_offset, rc_handle, rc_offset, ev_handle, ev_sync = shared
    return wire.GpuIpcRegion(
        region=region, device=int(dev), handle=bytes(handle), offset=int(block_offset) + (ptr - start), size=size,
        addr=ptr, ref_counter_handle=None if rc_handle is None else bytes(rc_handle),
        ref_counter_offset=int(rc_offset or 0), event_handle=None if ev_handle is None else bytes(ev_handle),
        event_sync_required=bool(ev_sync), uuid=_uuid(int(dev)),
    ), storage


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


def open_region(r: wire.GpuIpcRegion) -> Any:
    """Map a peer's region (torch caches the mapping of each handle) as a uint8 tensor."""
    import torch

    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        local_device(r), r.handle, r.size, r.offset, r.ref_counter_handle, r.ref_counter_offset,
        r.event_handle, r.event_sync_required,
    )
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
    return torch._utils._rebuild_tensor(typed, 0, (r.size,), (1,))
