"""A TEST STAND-IN for gpu_ipc's device seam (:mod:`atom_kv.transfer.gpu_ipc.cuda_seam`)
over host shared memory. Tests and the host-seam bench (``python -m
atom_kv.bench transfer --backend gpu_ipc --seam host``) only: nothing selects
it but a caller passing ``GpuIpcBackend(..., _seam=HostSeam())``; engines
always get the CUDA seam.

It keeps every step of the real one, on host memory:

- registered memory must live in a ``memfd`` (:func:`shared_buffer` makes
  such a buffer), as GPU memory must come from torch's allocator; a region
  is exported as (that memfd's fd number here, its inode, the region's
  offset in it), like an IPC handle is (allocation, offset);
- a reader opens a handle with ``pidfd_getfd`` on the peer's pidfd (the
  grant gave the pid), checks the inode, and maps each memfd once per peer,
  as torch maps each allocation once;
- copies by address (:func:`~atom_kv.transfer._device_copy.copy_by_address`:
  a numpy gather and scatter),
  queued on a stream and run when a fence recorded after them is queried or
  waited on, as a device runs them after they were queued; events are
  objects made once and reused, as CUDA's are from the backend's pool.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading
import weakref
from typing import Any, Optional

import numpy as np

from atom_kv import wire
from atom_kv.transfer._device_copy import copy_by_address
from atom_kv.transfer._errors import TransferError

__all__ = ["HostSeam", "SharedBuffer", "shared_buffer"]

_SYS_PIDFD_GETFD = 438  # the same number on every architecture Linux added it for
_HANDLE = struct.Struct("<iQ")  # fd number in the serving process, memfd inode


def pidfd_getfd(pidfd: int, fd: int) -> int:
    """A duplicate, in this process, of fd ``fd`` of the process behind ``pidfd``."""
    libc = ctypes.CDLL(None, use_errno=True)
    got = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(got)


class SharedBuffer:
    """Owns one memfd and its mapping: ``array`` is its bytes (uint8). The
    mapping holds no fd of its own (Python's ``mmap`` would keep a duplicate),
    so :meth:`close_fd` leaves no fd open; it is unmapped once ``array`` and
    every view of it are gone."""

    def __init__(self, size: int, name: str = "atomkv-test") -> None:
        self.fd: Optional[int] = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, self.fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        raw = (ctypes.c_char * size).from_address(addr)
        weakref.finalize(raw, libc.munmap, addr, size)
        self.array = np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8)  # the view holds raw alive

    def close_fd(self) -> None:
        """Close the memfd (the mapping, and ``array``, stay valid)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def shared_buffer(size: int) -> SharedBuffer:
    return SharedBuffer(size)


def _mapping_of(ptr: int, size: int) -> tuple[int, int, int]:
    """(start, file offset, inode) of the memfd mapping holding ``[ptr, ptr+size)``."""
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr and ptr + size <= hi:
                path = parts[5].strip() if len(parts) > 5 else ""
                if not path.startswith("/memfd:"):
                    break
                return lo, int(parts[2], 16), int(parts[4])
    raise TransferError(f"gpu_ipc (host stand-in): memory at 0x{ptr:x} is not in a memfd mapping; "
                        "allocate it with atom_kv.transfer.gpu_ipc.host_seam.shared_buffer")


def _fd_of_inode(inode: int) -> int:
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.stat(f"/proc/self/fd/{name}").st_ino == inode:
                return int(name)
        except OSError:
            continue
    raise TransferError(f"gpu_ipc (host stand-in): no fd of this process holds memfd inode {inode}")


class _MemfdShares:
    """Owns this seam's duplicates of the memfds behind exported regions: one
    per memfd however many regions live in it (an IPC handle names the
    allocation, not the region), closed when its last region lets go."""

    def __init__(self) -> None:
        self._fds: dict[int, list[int]] = {}  # inode -> [fd, regions using it]

    def take(self, inode: int) -> int:
        entry = self._fds.get(inode)
        if entry is None:
            entry = self._fds[inode] = [os.dup(_fd_of_inode(inode)), 0]
        entry[1] += 1
        return entry[0]

    def give_back(self, inode: int) -> None:
        entry = self._fds[inode]
        entry[1] -= 1
        if entry[1] == 0:
            os.close(entry[0])
            del self._fds[inode]


class _HostExport:
    """One registered region in a memfd: its share of the memfd's duplicate."""

    def __init__(self, ptr: int, size: int, shares: _MemfdShares) -> None:
        start, file_offset, inode = _mapping_of(ptr, size)
        self._shares = shares
        self._fd: Optional[int] = shares.take(inode)
        self._inode, self._offset, self._ptr, self._size = inode, file_offset + ptr - start, ptr, size

    def share(self, region: int, written: Optional[bytes]) -> wire.GpuIpcRegion:
        if self._fd is None:
            raise TransferError("gpu_ipc (host stand-in): the region was unregistered")
        return wire.GpuIpcRegion(region=region, device=-1, handle=_HANDLE.pack(self._fd, self._inode),
                                 offset=self._offset, size=self._size, addr=self._ptr, event_handle=written,
                                 event_sync_required=written is not None)

    def close(self) -> None:
        if self._fd is not None:
            self._fd = None
            self._shares.give_back(self._inode)


class _HostWritten:
    """The written event of host memory: host writes are complete when made."""

    handle: Optional[bytes] = None

    def record(self) -> None:
        pass


class _HostPeerMap:
    """Owns one peer's memfds mapped here (each once, whatever the regions)."""

    def __init__(self, pid: int, pidfd: Optional[int]) -> None:
        self.pid, self._pidfd = pid, pidfd
        self._maps: dict[bytes, mmap.mmap] = {}

    def region(self, r: wire.GpuIpcRegion) -> Any:
        import torch

        m = self._maps.get(r.handle)
        if m is None:
            if self._pidfd is None or len(r.handle) != _HANDLE.size:
                raise TransferError(f"gpu_ipc (host stand-in): bad handle from peer pid {self.pid}")
            theirs, inode = _HANDLE.unpack(r.handle)
            try:
                fd = pidfd_getfd(self._pidfd, theirs)
            except OSError as exc:
                raise TransferError(f"gpu_ipc (host stand-in): cannot open the memory of peer pid {self.pid}: "
                                    f"{exc.strerror}") from None
            try:
                st = os.fstat(fd)
                if st.st_ino != inode:
                    raise TransferError(f"gpu_ipc (host stand-in): peer pid {self.pid}'s fd {theirs} is not the "
                                        "memory it granted")
                m = self._maps[r.handle] = mmap.mmap(fd, st.st_size)
            finally:
                os.close(fd)
        if r.offset < 0 or r.offset + r.size > len(m):
            raise TransferError(f"gpu_ipc (host stand-in): peer pid {self.pid} granted a region outside its memory")
        return torch.frombuffer(m, dtype=torch.uint8, count=r.size, offset=r.offset)

    def written(self, r: wire.GpuIpcRegion) -> None:
        return None

    def close(self) -> None:
        maps, self._maps = self._maps, {}
        for m in maps.values():
            try:
                m.close()
            except BufferError:  # a tensor of a read still in flight: unmapped when it is freed
                pass


class _HostStream:
    """A host "stream": copies queued on it run when a fence after them is
    queried or waited on (a device runs them later than they are queued;
    so does this, so the queuing is all a read's submit costs)."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.queued: list[Any] = []


class _HostEvent:
    """A host fence: the copies queued before it, run (once) when it is looked at."""

    __slots__ = ("device", "work")

    def __init__(self, device: int) -> None:
        self.device = device
        self.work: list[Any] = []


class HostSeam:
    """The host-memory stand-in of :class:`~atom_kv.transfer.gpu_ipc.cuda_seam.CudaSeam` (tests only)."""

    name = "host stand-in"
    memory_kinds = frozenset({"host"})

    def __init__(self) -> None:
        self._shares = _MemfdShares()
        self._lock = threading.Lock()

    @staticmethod
    def unavailable_reason() -> Optional[str]:
        """None when memfds can be passed with pidfd_getfd here, else why not."""
        try:
            buf = SharedBuffer(4096)
            pidfd = os.pidfd_open(os.getpid())
            try:
                assert buf.fd is not None
                os.close(pidfd_getfd(pidfd, buf.fd))
            finally:
                os.close(pidfd)
                buf.close_fd()
        except (OSError, AttributeError) as exc:
            return f"memfd + pidfd_getfd unavailable here: {exc}"
        return None

    def alias(self, ptr: int, size: int, device: int) -> Any:
        import torch

        return torch.frombuffer((ctypes.c_char * size).from_address(ptr), dtype=torch.uint8)

    def export(self, ptr: int, size: int, device: int) -> _HostExport:
        return _HostExport(ptr, size, self._shares)

    def written(self, device: int) -> _HostWritten:
        return _HostWritten()

    def open_peer(self, pid: int, pidfd: Optional[int]) -> _HostPeerMap:
        return _HostPeerMap(pid, pidfd)

    def address(self, t: Any) -> int:
        return int(t.data_ptr())

    def device_of(self, t: Any) -> int:
        return -1

    def prepare(self, device: int, peer_device: int) -> None:
        """Nothing to enable between host "devices"."""

    def stream(self, device: int) -> _HostStream:
        return _HostStream(device)

    def event(self, device: int) -> _HostEvent:
        return _HostEvent(device)

    def order(self, stream: Any, device: int, written: list[Any], ordering: Any) -> None:
        """Nothing to wait for: host writes are complete when made."""

    def copy(self, stream: _HostStream, batch: Any) -> None:
        stream.queued.append(batch)

    def record(self, event: _HostEvent, stream: _HostStream) -> None:
        event.work, stream.queued = stream.queued, []

    def query(self, event: _HostEvent) -> bool:
        self._run(event)
        return True

    def synchronize(self, event: _HostEvent) -> None:
        self._run(event)

    def stream_wait(self, stream: Any, event: _HostEvent) -> None:
        self._run(event)

    def _run(self, event: _HostEvent) -> None:
        if not event.work:
            return
        with self._lock:  # two threads looking at one fence: its copies run once
            work, event.work = event.work, []
            for batch in work:
                copy_by_address(batch.dst, batch.src, batch.size)
