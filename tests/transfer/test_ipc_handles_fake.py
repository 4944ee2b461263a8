"""The CUDA side of gpu_ipc's seam (``gpu_ipc.handles``) with torch's CUDA
calls replaced by FAKES (there is no GPU here): what it asks of torch, and
that every refusal is a ``TransferError`` (``auto`` falls back on it, and on
nothing else). The real calls run in the ``gpu`` tests."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from atom_kv import wire
from atom_kv.transfer import TransferError
from atom_kv.transfer.gpu_ipc.handles import CudaExport, CudaPeerMap


def _region(**kw: Any) -> wire.GpuIpcRegion:
    base = dict(region=0, device=0, handle=b"h" * 64, offset=4096, size=65536, addr=0x7000, ref_counter_handle=b"/rc",
                ref_counter_offset=3, event_handle=b"e" * 64, event_sync_required=True, uuid="")
    return wire.GpuIpcRegion(**{**base, **kw})


def test_memory_from_cudamallocasync_is_a_transfer_error(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    with pytest.raises(TransferError, match="'cudaMallocAsync' allocator .*'tcp'"):
        CudaExport(0x7000, 65536, 0)


def test_a_share_torch_refuses_is_a_transfer_error() -> None:
    class _PoolStorage:  # FAKE: a MemPool or expandable segment torch will not share
        def _share_cuda_(self) -> tuple:
            raise RuntimeError("CUDA error: invalid argument")

    exp = CudaExport.__new__(CudaExport)
    exp._storage, exp._ptr, exp._start, exp._size, exp._device = _PoolStorage(), 0x7000, 0x7000, 65536, 0
    with pytest.raises(TransferError, match="cannot share GPU memory .*invalid argument"):
        exp.share(0, b"w")
    exp.close()
    with pytest.raises(TransferError, match="unregistered"):
        exp.share(0, b"w")


def test_each_share_is_a_new_send_carrying_the_written_event(monkeypatch) -> None:
    sends = iter(range(1, 100))

    class _Storage:  # FAKE: _share_cuda_'s 8-tuple, a new ref counter slot per call, as torch does
        def _share_cuda_(self) -> tuple:
            n = next(sends)
            return (0, b"H" * 64, 1 << 20, 512, b"/torch_rc", n, b"torch-event", True)

    monkeypatch.setattr("atom_kv.transfer.gpu_ipc.handles._uuid", lambda device: "GPU-fake")
    exp = CudaExport.__new__(CudaExport)
    exp._storage, exp._ptr, exp._start, exp._size, exp._device = _Storage(), 0x7100, 0x7000, 4096, 0
    a, b = exp.share(2, b"written"), exp.share(2, b"written")
    assert (a.ref_counter_offset, b.ref_counter_offset) == (1, 2)  # one counter per send, never one for two readers
    assert a.offset == 512 + 0x100 and a.size == 4096 and a.region == 2 and a.uuid == "GPU-fake"
    assert a.event_handle == b"written" and a.event_sync_required  # ours, not torch's share-time event


def test_opening_a_region_never_opens_torch_s_ipc_event_and_refusals_are_transfer_errors(monkeypatch) -> None:
    seen: list[tuple] = []

    def fake_new_shared_cuda(*args: Any) -> Any:
        # torch 2.11's typed signature (seen on an H200): (int device, bytes handle, int size, int offset,
        # bytes ref_counter, int ref_counter_offset, bytes event_handle, bool event_sync_required); None refused
        kinds = (int, bytes, int, int, bytes, int, bytes, bool)
        if len(args) != len(kinds) or not all(isinstance(a, k) for a, k in zip(args, kinds)):
            raise TypeError(f"_new_shared_cuda received an invalid combination of arguments: {args!r}")
        seen.append(args)
        raise RuntimeError("CUDA error: invalid resource handle")

    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", fake_new_shared_cuda, raising=False)
    with pytest.raises(TransferError, match="peer pid 42: .*invalid resource handle"):
        CudaPeerMap(42).region(_region())
    # torch's own event would be opened with cudaIpcOpenEventHandle and never destroyed: not asked for
    assert seen == [(0, b"h" * 64, 65536, 4096, b"/rc", 3, b"", False)]


def test_the_exported_storage_owns_nothing_so_torch_can_free_it_after_python_is_gone(monkeypatch) -> None:
    """``_share_cuda_`` parks the storage's memory in torch's IPC limbo, which may free it at exit after the
    interpreter: a storage whose release drops a Python object (an ``__cuda_array_interface__`` alias)
    aborted the process there ("gilstate_tss_set", seen on an H200)."""
    made: list[tuple] = []

    def fake_construct(ptr: int, device: Any, size: int) -> str:  # FAKE: torch's non-owning storage
        made.append((ptr, str(device), size))
        return "unowned-storage"

    def no_alias(*args: Any) -> Any:
        raise AssertionError("exported through a Python-owned alias")

    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr("atom_kv.transfer.gpu_ipc.handles._block_start", lambda ptr, device: 0x7000)
    monkeypatch.setattr("atom_kv.transfer.gpu_ipc.handles.alias", no_alias)
    monkeypatch.setattr(torch._C, "_construct_storage_from_data_pointer", fake_construct, raising=False)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: made.append(("collected",)))
    whole, inside = CudaExport(0x7000, 65536, 0), CudaExport(0x7100, 4096, 0)
    assert made == [(0x7000, "cuda:0", 65536), (0x7000, "cuda:0", 1)]  # a region inside a block: via the block
    assert whole._storage == "unowned-storage"
    whole.close()
    whole.close()
    assert made[2:] == [("collected",)]  # what readers let go is collected at close, once
    inside.close()


def test_the_peer_written_event_is_opened_once_per_gpu_and_let_go_at_close(monkeypatch) -> None:
    opened: list[tuple] = []

    class _Event:  # FAKE for torch.cuda.Event: cudaEventDestroy runs when the last reference goes
        pass

    def from_ipc_handle(device: int, handle: bytes) -> _Event:
        opened.append((device, handle))
        return _Event()

    monkeypatch.setattr(torch.cuda.Event, "from_ipc_handle", staticmethod(from_ipc_handle))
    peer = CudaPeerMap(42)
    first = peer.written(_region(region=0))
    assert peer.written(_region(region=1)) is first and opened == [(0, b"e" * 64)]
    assert peer.written(_region(event_sync_required=False, event_handle=None)) is None
    gone = weakref.ref(first)
    del first
    peer.close()
    gc.collect()
    assert gone() is None, "the opened event outlived the peer"
