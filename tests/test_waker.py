"""atom_kv._waker.Waker: a poll blocked on it returns when another thread wakes it, and not before."""

from __future__ import annotations

import os
import selectors
import threading

from atom_kv._waker import Waker


def test_wake_from_another_thread_ends_a_blocked_select_and_drain_rearms_it():
    waker = Waker()
    sel = selectors.DefaultSelector()
    sel.register(waker.fileno(), selectors.EVENT_READ)
    try:
        assert sel.select(0.05) == []  # nothing pending: the poll waits its timeout
        threading.Timer(0.05, waker.wake).start()
        assert len(sel.select(5)) == 1
        for _ in range(100_000):  # more wake-ups than the pipe holds: never blocks
            waker.wake()
        waker.drain()
        assert sel.select(0) == []  # drained: the next poll blocks again
    finally:
        sel.close()
        waker.close()


def test_close_is_idempotent_and_a_late_wake_touches_no_descriptor():
    waker = Waker()
    waker.close()
    waker.close()
    assert waker.closed and waker.fileno() == -1
    r, w = os.pipe()  # may reuse the closed descriptors' numbers
    try:
        waker.wake()
        waker.drain()
        os.set_blocking(r, False)
        try:
            assert os.read(r, 16) == b"", "a late wake wrote into a reused descriptor"
        except BlockingIOError:
            pass
    finally:
        os.close(r)
        os.close(w)
