"""What a connecting ZeroMQ socket's monitor says about its connection: never connected, connected, lost.

A DEALER connects and reconnects on its own and never says why nothing comes
back. :class:`ConnectionWatch` follows the socket's monitor events
(``CONNECTED``, ``CONNECT_RETRIED``, ``HANDSHAKE_SUCCEEDED``,
``HANDSHAKE_FAILED_*``, ``DISCONNECTED``) as one :class:`Reach` and a count of
failed attempts, so a warning can tell "never connected" (the attempt
unanswered: packets dropped; or refused) from "connected, but nothing came
back". Its owner polls :attr:`ConnectionWatch.monitor` with its other sockets
and calls :meth:`ConnectionWatch.read` when it is readable: the watch never
waits by itself.
"""

from __future__ import annotations

import logging
import struct
from enum import Enum

import zmq

__all__ = ["ConnectionWatch", "Reach"]

logger = logging.getLogger(__name__)

_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                     zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_READ_BURST = 64  # events read per call; more wait for the next wake-up
_EVENT = struct.Struct("=Hi")  # a monitor event's first frame: 16-bit event id, 32-bit value


class Reach(Enum):
    """How far the socket got towards its peer."""

    CONNECTING = "connecting"  # never connected; the first attempt has had no answer yet
    REFUSED = "refused"  # never connected; attempts failed (refused or unreachable)
    CONNECTED = "connected"  # TCP connected, ZeroMQ's handshake not done yet
    HANDSHAKE_FAILED = "handshake failed"  # connected, but closed before or during ZeroMQ's handshake
    READY = "ready"  # connected and through the handshake: messages flow
    LOST = "lost"  # was ready; the connection is gone and being retried


class ConnectionWatch:
    """Owns one socket's monitor (a PAIR socket in the same context) and what its events said."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.monitor = sock.get_monitor_socket(_EVENTS)  # before connect(): the first attempt is seen
        self.reach = Reach.CONNECTING
        self.failed = 0  # attempts that failed since the socket was last ready
        self.bad_events = 0

    @property
    def connected_once(self) -> bool:
        """Whether a TCP connection to the peer was made at some point (a connection attempt was answered)."""
        return self.reach not in (Reach.CONNECTING, Reach.REFUSED)

    def read(self) -> None:
        """Apply the events waiting on the monitor (never blocks)."""
        for _ in range(_READ_BURST):
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2 or len(frames[0]) != _EVENT.size:  # libzmq's format: event id, value; endpoint
                self.bad_events += 1
                logger.debug("ignoring a malformed socket monitor event (%d frames)", len(frames))
                continue
            event, _ = _EVENT.unpack(frames[0])
            self.apply(event)

    def apply(self, event: int) -> None:
        """One monitor event."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.reach, self.failed = Reach.READY, 0
        elif event == zmq.EVENT_CONNECTED:
            if self.reach is not Reach.HANDSHAKE_FAILED:  # it failed before: it must succeed to count
                self.reach = Reach.CONNECTED
        elif event in _HANDSHAKE_FAILED:
            self.reach = Reach.HANDSHAKE_FAILED
            self.failed += 1
        elif event == zmq.EVENT_DISCONNECTED:
            if self.reach is Reach.READY:
                self.reach = Reach.LOST
            elif self.reach is Reach.CONNECTED:  # closed before the handshake finished
                self.reach = Reach.HANDSHAKE_FAILED
                self.failed += 1
        elif event == zmq.EVENT_CONNECT_RETRIED:
            if self.reach is Reach.CONNECTING:
                self.reach = Reach.REFUSED
            if self.reach in (Reach.REFUSED, Reach.LOST):
                self.failed += 1

    def describe(self) -> str:
        """The connection in words, for a warning about a peer that sent nothing back."""
        reach, n = self.reach, self.failed
        times = f"{n} time{'s' if n != 1 else ''}"
        if reach is Reach.CONNECTING:
            return ("never connected: the connection attempt has had no answer, so its packets are dropped on the "
                    "way (a firewall) or no host has that address")
        if reach is Reach.REFUSED:
            return f"never connected: the connection was refused or found no route, {times}"
        if reach is Reach.CONNECTED:
            return ("connected, but ZeroMQ's handshake has not completed, so what listens there may not be a ZeroMQ "
                    "socket")
        if reach is Reach.HANDSHAKE_FAILED:
            return (f"connected, but the connection closed before ZeroMQ's handshake completed, {times}: something "
                    "else listens there, or the peer shuts the connection down")
        if reach is Reach.LOST:
            return f"connected before, but the connection was lost{f'; reconnecting failed {times}' if n else ''}"
        return "connected, but nothing came back"

    def close(self, sock: zmq.Socket) -> None:
        """Stop monitoring ``sock`` and close the monitor (before ``sock`` and its context)."""
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
