"""ctypes bindings for the cma backend: ``process_vm_readv`` over numpy
iovec arrays (IOV_MAX per call, partial reads resumed) and
``prctl(PR_SET_PTRACER)``. One :class:`CmaSys` per backend, no globals."""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Optional

import numpy as np

from atom_kv.transfer._sockio import IOV_MAX
from atom_kv.transfer.base import BackendUnavailable, TransferError

PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

_TCP_HINT = "use backend 'tcp' instead"


class PeerGone(TransferError):
    """The peer process no longer exists (ESRCH)."""


def refusal_message(err: int) -> str:
    name = errno.errorcode.get(err, str(err))
    if err in (errno.EPERM, errno.EACCES):
        return (
            f"cma: the kernel refused process_vm_readv ({name}): ptrace access denied "
            f"(kernel.yama.ptrace_scope?); {_TCP_HINT}"
        )
    if err == errno.ENOSYS:
        return f"cma: process_vm_readv is not available here (ENOSYS, seccomp or old kernel); {_TCP_HINT}"
    return f"cma: process_vm_readv failed: {os.strerror(err)} ({name})"


class CmaSys:
    """libc handle with the two calls the cma backend needs."""

    def __init__(self) -> None:
        try:
            self._libc = ctypes.CDLL(None, use_errno=True)
            self._readv = self._libc.process_vm_readv
        except (OSError, AttributeError) as exc:
            raise BackendUnavailable(f"cma: process_vm_readv is not available in libc ({exc}); {_TCP_HINT}") from None
        self._readv.restype = ctypes.c_ssize_t
        self._readv.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong,
        ]
        self._prctl = self._libc.prctl
        self._prctl.restype = ctypes.c_int
        self._prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

    def allow_any_tracer(self) -> Optional[str]:
        """``prctl(PR_SET_PTRACER, ANY)``; returns a note when it did not apply
        (EINVAL means no Yama LSM, where nothing is needed)."""
        if self._prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0:
            return None
        err = ctypes.get_errno()
        if err == errno.EINVAL:
            return "no Yama LSM: PR_SET_PTRACER not needed"
        return f"prctl(PR_SET_PTRACER) failed: {os.strerror(err)}"

    def read(self, pid: int, local: np.ndarray, remote: np.ndarray, sizes: np.ndarray,
             should_stop=None) -> None:
        """Copy ``sizes[i]`` bytes from ``remote[i]`` in ``pid`` to ``local[i]``
        (uint64 address arrays), IOV_MAX pairs per syscall, resuming partial
        reads. Raises :class:`PeerGone`, :class:`BackendUnavailable` (EPERM)
        or :class:`TransferError`."""
        n = len(sizes)
        liov = np.empty((min(n, IOV_MAX), 2), dtype=np.uint64)
        riov = np.empty_like(liov)
        lptr, rptr = liov.ctypes.data, riov.ctypes.data
        i = 0
        while i < n:
            if should_stop is not None and should_stop():
                return
            k = min(IOV_MAX, n - i)
            liov[:k, 0] = local[i : i + k]
            liov[:k, 1] = sizes[i : i + k]
            riov[:k, 0] = remote[i : i + k]
            riov[:k, 1] = sizes[i : i + k]
            want = int(sizes[i : i + k].sum())
            got = self._readv(pid, lptr, k, rptr, k, 0)
            if got < 0:
                err = ctypes.get_errno()
                if err == errno.ESRCH:
                    raise PeerGone(f"cma: peer process {pid} is gone (ESRCH)")
                if err in (errno.EPERM, errno.EACCES, errno.ENOSYS):
                    raise BackendUnavailable(refusal_message(err))
                if err == errno.EINTR:
                    continue
                raise TransferError(refusal_message(err))
            if got == want:
                i += k
                continue
            if got == 0:
                raise TransferError(f"cma: process_vm_readv from pid {pid} made no progress")
            # partial: skip whole pairs, then shorten the pair it stopped in
            ends = np.cumsum(sizes[i : i + k].astype(np.int64))
            j = int(np.searchsorted(ends, got, side="right"))
            done_in = got - (int(ends[j - 1]) if j else 0)
            i += j
            if done_in:
                local = local.copy()
                remote = remote.copy()
                sizes = sizes.copy()
                local[i] += done_in
                remote[i] += done_in
                sizes[i] -= done_in


def cma_unavailable_reason() -> Optional[str]:
    """None when this process can use process_vm_readv, else a one-line reason."""
    try:
        sys_ = CmaSys()
    except BackendUnavailable as exc:
        return str(exc)
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope", encoding="ascii") as f:
            scope = int(f.read().strip() or 0)
    except (OSError, ValueError):
        scope = 0
    if scope >= 3:
        return f"cma: kernel.yama.ptrace_scope={scope} forbids process_vm_readv between processes; {_TCP_HINT}"
    if scope == 2 and os.geteuid() != 0:
        return f"cma: kernel.yama.ptrace_scope=2 allows process_vm_readv only with CAP_SYS_PTRACE; {_TCP_HINT}"
    probe_src = np.arange(16, dtype=np.uint8)
    probe_dst = np.zeros(16, dtype=np.uint8)
    try:
        sys_.read(
            os.getpid(),
            np.array([probe_dst.ctypes.data], dtype=np.uint64),
            np.array([probe_src.ctypes.data], dtype=np.uint64),
            np.array([16], dtype=np.uint64),
        )
    except TransferError as exc:
        return str(exc)
    if not np.array_equal(probe_src, probe_dst):
        return f"cma: process_vm_readv self-test returned wrong bytes; {_TCP_HINT}"
    return None
