"""Waking a thread that blocks in a poll or select, from any other thread."""

from __future__ import annotations

import os
import threading

__all__ = ["Waker"]


class Waker:
    """Owns a non-blocking pipe that one polling thread watches (:meth:`fileno`, for a ZeroMQ poller or
    a selector). :meth:`wake` never blocks (a full pipe already holds a wake-up) and does nothing once
    closed; the polling thread calls :meth:`drain` when the pipe is readable. :meth:`close` is idempotent
    and never races a :meth:`wake` into a descriptor number the process reused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        """The end to poll for reading (-1 once closed)."""
        return self._r

    def wake(self) -> None:
        """Make the next poll return (any thread)."""
        with self._lock:
            if self._w < 0:
                return
            try:
                os.write(self._w, b"\0")
            except OSError:  # BlockingIOError: the pipe is full, a wake-up is pending anyway
                pass

    def drain(self) -> None:
        """Empty the pipe (the polling thread, once it saw it readable)."""
        try:
            while os.read(self._r, 4096):
                pass
        except OSError:  # BlockingIOError: empty; EBADF: closed
            pass

    @property
    def closed(self) -> bool:
        return self._w < 0

    def close(self) -> None:
        """Close both ends. Idempotent."""
        with self._lock:
            fds, self._r, self._w = (self._r, self._w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
