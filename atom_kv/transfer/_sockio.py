"""Socket helpers for the transfer backends: length-prefixed frames and
scatter/gather I/O straight between sockets and lists of memoryviews
(``sendmsg`` / ``recvmsg_into`` with at most IOV_MAX buffers per call)."""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Optional, Sequence

import numpy as np

__all__ = [
    "FRAME_HEADER", "HELLO_FRAME_MAX", "IOV_MAX", "FrameTooLarge", "PeerClosed", "frame", "recv_exact", "recv_frame",
    "recv_views", "request_frame_limit", "send_views",
]

try:
    IOV_MAX = min(int(os.sysconf("SC_IOV_MAX")), 1024)
except (ValueError, OSError, AttributeError):
    IOV_MAX = 1024

FRAME_HEADER = struct.Struct("!I")
#: frames carry msgpack headers, never bulk data
MAX_FRAME = 64 << 20
#: the largest frame accepted before the other side is authenticated (hellos,
#: challenges, grant requests) and the largest reply header a reader accepts
HELLO_FRAME_MAX = 4096


def request_frame_limit(max_ranges: int) -> int:
    """Largest ``ReadRequest`` frame naming ``max_ranges`` ranges: each range
    takes at most 28 bytes as a msgpack array (24 packed), plus the header."""
    return 256 + 28 * max_ranges


class PeerClosed(ConnectionError):
    """The other end closed the connection."""


def frame(payload: bytes) -> bytes:
    return FRAME_HEADER.pack(len(payload)) + payload


def _check_deadline(sock: socket.socket, deadline: Optional[float]) -> None:
    if deadline is None:
        return
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(remaining)


def recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        _check_deadline(sock, deadline)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerClosed("connection closed by peer")
        got += k
    return buf


class FrameTooLarge(ConnectionError):
    """The other side announced a frame beyond the limit (nothing allocated)."""


def recv_frame(sock: socket.socket, deadline: Optional[float] = None, limit: int = MAX_FRAME) -> bytes:
    """One length-prefixed frame; a length beyond ``limit`` raises
    :class:`FrameTooLarge` before anything is allocated for it."""
    (length,) = FRAME_HEADER.unpack(recv_exact(sock, FRAME_HEADER.size, deadline))
    if length > limit:
        raise FrameTooLarge(f"the peer announced a {length}-byte frame; the limit is {limit}")
    return bytes(recv_exact(sock, length, deadline))


def _advance(ends: np.ndarray, pos: int) -> tuple[int, int]:
    """Index of the buffer containing byte ``pos`` and the offset inside it."""
    idx = int(np.searchsorted(ends, pos, side="right"))
    start = int(ends[idx - 1]) if idx else 0
    return idx, pos - start


#: bytes offered to one sendmsg/recvmsg_into call, adapted to what the kernel
#: takes per call: passing 1024 small buffers when only a few fill up would
#: spend more time building the iovec array than moving bytes
MIN_WINDOW = 128 << 10
MAX_WINDOW = 32 << 20


def _batch(views: Sequence[memoryview], ends: np.ndarray, idx: int, off: int, pos: int, window: int) -> list:
    stop = int(np.searchsorted(ends, pos + window, side="left")) + 1
    batch = list(views[idx : min(stop, idx + IOV_MAX)])
    if off:
        batch[0] = batch[0][off:]
    return batch


def _next_window(moved: int) -> int:
    return min(MAX_WINDOW, max(MIN_WINDOW, 2 * moved))


def send_views(
    sock: socket.socket, views: Sequence[memoryview], lengths: np.ndarray, deadline: Optional[float] = None
) -> None:
    """Send every byte of ``views`` (whose sizes are ``lengths``) in order."""
    if len(views) == 0:
        return
    ends = np.cumsum(lengths, dtype=np.int64)
    total = int(ends[-1])
    pos = idx = off = 0
    window = MIN_WINDOW
    while pos < total:
        _check_deadline(sock, deadline)
        sent = sock.sendmsg(_batch(views, ends, idx, off, pos, window))
        pos += sent
        window = _next_window(sent)
        idx, off = _advance(ends, pos)


def recv_views(
    sock: socket.socket,
    views: Sequence[memoryview],
    lengths: np.ndarray,
    deadline: Optional[float] = None,
    should_stop=None,
) -> None:
    """Fill ``views`` (sizes ``lengths``) in order from ``sock`` (scatter
    receive, no staging copy). ``should_stop()`` aborts between calls."""
    if len(views) == 0:
        return
    ends = np.cumsum(lengths, dtype=np.int64)
    total = int(ends[-1])
    pos = idx = off = 0
    window = MIN_WINDOW
    while pos < total:
        _check_deadline(sock, deadline)
        if should_stop is not None and should_stop():
            raise ConnectionAbortedError("read abandoned")
        if idx + 1 == len(views) or int(ends[idx]) - pos >= window:
            k = sock.recv_into(views[idx][off:] if off else views[idx])
        else:
            k = sock.recvmsg_into(_batch(views, ends, idx, off, pos, window))[0]
        if k == 0:
            raise PeerClosed("connection closed by peer")
        pos += k
        window = _next_window(k)
        idx, off = _advance(ends, pos)
