"""Batched copies by address on a GPU: n ranges, one driver call.

:class:`AddressCopier` queues copies of ``size[i]`` bytes from ``src[i]`` to
``dst[i]`` (device or pinned host addresses, any direction: unified
addressing) on a stream:

- ``cuMemcpyBatchAsync`` (CUDA 12.8 and later drivers), bound through
  ``cuGetProcAddress`` at the 12.8 ABI so a later driver answers with the
  signature used here: one call for the whole batch;
- else one ``cuMemcpyAsync`` per range (HIP: ``hipMemcpyAsync``), ranges
  already coalesced by the caller.

:func:`copy_by_address` is the same on host memory (numpy), for the host
stand-ins; :func:`coalesce` merges ranges that continue each other.

Only ctypes and numpy: no torch object per range. The driver sits behind a
small interface (:class:`CudaDriver`, :class:`HipRuntime`) so the batching
logic runs in the CPU suite over a fake of it.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Optional, Protocol

import numpy as np

__all__ = ["AddressCopier", "CudaDriver", "DeviceCopyError", "HipRuntime", "coalesce", "copy_by_address",
           "driver_for_torch"]

#: the driver ABI version cuMemcpyBatchAsync is bound at (CUDA 12.8: with its failIdx argument)
_BATCH_ABI = 12080
_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1
_CU_MEM_LOCATION_TYPE_DEVICE = 0x1
_CU_MEM_LOCATION_TYPE_HOST = 0x2
_HIP_MEMCPY_DEFAULT = 4
#: copy_by_address views the address span of each side as rows: beyond this, ranges far apart are moved one by one
_MAX_SPAN = 1 << 40


class DeviceCopyError(RuntimeError):
    """A driver call refused a copy (its name and the driver's error)."""


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


class Driver(Protocol):
    """What :class:`AddressCopier` needs of a GPU driver."""

    has_batch: bool

    def ensure_context(self, device: int) -> None: ...

    def copy(self, dst: int, src: int, size: int, stream: int) -> None: ...

    def copy_batch(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray, stream: int, device: int,
                   dst_host: bool, src_host: bool) -> None: ...


class CudaDriver:
    """``libcuda.so.1`` through ctypes: cuMemcpyAsync, and cuMemcpyBatchAsync where the driver has it."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._lib = lib
        self._copy = lib.cuMemcpyAsync
        self._copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._copy.restype = ctypes.c_int
        self._ctx = threading.local()  # per thread: the devices whose primary context it made current
        self._batch = self._bind_batch(lib)
        self.has_batch = self._batch is not None

    @staticmethod
    def _bind_batch(lib: Any) -> Optional[Any]:
        get = getattr(lib, "cuGetProcAddress_v2", None)
        if get is None:
            return None
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                        ctypes.POINTER(ctypes.c_int)]
        get.restype = ctypes.c_int
        pfn, status = ctypes.c_void_p(), ctypes.c_int()
        if get(b"cuMemcpyBatchAsync", ctypes.byref(pfn), _BATCH_ABI, 0, ctypes.byref(status)) != 0 \
                or status.value != 0 or not pfn.value:
            return None
        proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.POINTER(_MemcpyAttributes), ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p)
        return proto(pfn.value)

    def _check(self, what: str, rc: int) -> None:
        if rc != 0:
            text = ctypes.c_char_p()
            self._lib.cuGetErrorString(rc, ctypes.byref(text))
            raise DeviceCopyError(f"{what} failed: CUDA error {rc} ({(text.value or b'').decode()})")

    def ensure_context(self, device: int) -> None:
        """A context current on this thread (a thread that never called CUDA has none)."""
        if getattr(self._ctx, "device", None) == device:
            return
        current = ctypes.c_void_p()
        self._check("cuCtxGetCurrent", self._lib.cuCtxGetCurrent(ctypes.byref(current)))
        if not current.value:
            ctx = ctypes.c_void_p()
            self._check("cuDevicePrimaryCtxRetain", self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device))
            self._check("cuCtxSetCurrent", self._lib.cuCtxSetCurrent(ctx))
        self._ctx.device = device

    def copy(self, dst: int, src: int, size: int, stream: int) -> None:
        self._check("cuMemcpyAsync", self._copy(dst, src, size, stream))

    def copy_batch(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray, stream: int, device: int,
                   dst_host: bool, src_host: bool) -> None:
        assert self._batch is not None
        attrs = _MemcpyAttributes(
            _CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            _MemLocation(_CU_MEM_LOCATION_TYPE_HOST if src_host else _CU_MEM_LOCATION_TYPE_DEVICE, device),
            _MemLocation(_CU_MEM_LOCATION_TYPE_HOST if dst_host else _CU_MEM_LOCATION_TYPE_DEVICE, device), 0)
        first = (ctypes.c_size_t * 1)(0)
        fail = ctypes.c_size_t(0)
        rc = self._batch(dst.ctypes.data, src.ctypes.data, size.ctypes.data, len(size), ctypes.byref(attrs),
                         ctypes.addressof(first), 1, ctypes.byref(fail), stream)
        if rc != 0:
            self._check(f"cuMemcpyBatchAsync (range {fail.value} of {len(size)})", rc)


class HipRuntime:
    """``libamdhip64.so`` through ctypes (ROCm builds of torch): one hipMemcpyAsync per range."""

    has_batch = False

    def __init__(self) -> None:
        lib = ctypes.CDLL("libamdhip64.so")
        self._lib = lib
        self._copy = lib.hipMemcpyAsync
        self._copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._copy.restype = ctypes.c_int

    def ensure_context(self, device: int) -> None:
        """HIP keeps one context per device, current whenever the device is (torch set it)."""

    def copy(self, dst: int, src: int, size: int, stream: int) -> None:
        rc = self._copy(dst, src, size, _HIP_MEMCPY_DEFAULT, stream)
        if rc != 0:
            raise DeviceCopyError(f"hipMemcpyAsync failed: HIP error {rc}")

    def copy_batch(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray, stream: int, device: int,
                   dst_host: bool, src_host: bool) -> None:  # pragma: no cover - has_batch is False
        raise DeviceCopyError("HIP has no batched copy here (has_batch is False): copy each range with copy()")


def driver_for_torch(torch: Any) -> Optional[Driver]:
    """The driver under this torch (CUDA or HIP), or None when it cannot be loaded
    (then callers copy through torch instead)."""
    try:
        return HipRuntime() if getattr(torch.version, "hip", None) else CudaDriver()
    except (OSError, AttributeError):
        return None


class AddressCopier:
    """Queues batched copies by address on a stream (see the module's docstring).
    ``calls`` counts driver calls made (a batch counts one)."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver
        self.batched = driver.has_batch
        self.calls = 0

    def copy(self, stream: int, device: int, dst: np.ndarray, src: np.ndarray, size: np.ndarray, *,
             dst_host: bool = False, src_host: bool = False) -> None:
        """Copy every range on ``stream`` (a ``cudaStream_t``/``hipStream_t`` of GPU ``device``)."""
        n = len(size)
        if n == 0:
            return
        driver = self._driver
        driver.ensure_context(device)
        if n == 1:
            self.calls += 1
            driver.copy(int(dst[0]), int(src[0]), int(size[0]), stream)
            return
        if self.batched:
            d = np.ascontiguousarray(dst, dtype=np.uint64)
            s = np.ascontiguousarray(src, dtype=np.uint64)
            z = np.ascontiguousarray(size, dtype=np.uint64)
            self.calls += 1
            driver.copy_batch(d, s, z, stream, device, dst_host, src_host)
            return
        for a, b, k in zip(dst.tolist(), src.tolist(), size.tolist()):
            self.calls += 1
            driver.copy(a, b, k, stream)


def coalesce(dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ranges that continue the one before them on both sides (in the order given) merged into one."""
    if len(size) < 2:
        return dst, src, size
    head = size[:-1]
    joins = (dst[:-1] + head) == dst[1:]
    joins &= (src[:-1] + head) == src[1:]
    if not joins.any():
        return dst, src, size
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return dst[starts], src[starts], np.add.reduceat(size, starts)


def _host_bytes(addr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes of host memory at ``addr``."""
    return memoryview((ctypes.c_char * size).from_address(addr)).cast("B")


def copy_by_address(dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> None:
    """Copy ``size[i]`` bytes from address ``src[i]`` to ``dst[i]`` (host memory)
    with one numpy gather and scatter over rows of the ranges' common unit,
    or one ``memmove`` per range where that unit is too small for rows."""
    if len(size) == 0:
        return
    lo_d, lo_s = int(dst.min()), int(src.min())
    unit = int(np.gcd.reduce(np.concatenate([dst - lo_d, src - lo_s, size])))
    span_d, span_s = int((dst + size).max()) - lo_d, int((src + size).max()) - lo_s
    if unit < 64 or len(size) < 4 or max(span_d, span_s) > _MAX_SPAN:
        for d, s, n in zip(dst.tolist(), src.tolist(), size.tolist()):
            ctypes.memmove(d, s, n)
        return
    from atom_kv.transfer._batched_copy import range_rows

    counts = size // unit
    d_rows = np.frombuffer(_host_bytes(lo_d, span_d), dtype=np.uint8).reshape(-1, unit)
    s_rows = np.frombuffer(_host_bytes(lo_s, span_s), dtype=np.uint8).reshape(-1, unit)
    d_rows[range_rows((dst - lo_d) // unit, counts)] = s_rows[range_rows((src - lo_s) // unit, counts)]
