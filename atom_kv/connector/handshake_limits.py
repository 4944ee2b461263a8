"""What a producer rank's handshake port (a ZeroMQ ROUTER) lets a stranger make it hold.

- :func:`largest_message_bytes`: ``ZMQ_MAXMSGSIZE``, from the wire bounds: the
  largest legitimate message (an :class:`~atom_kv.wire.Issued` naming
  ``MAX_ISSUED_BLOCKS`` blocks, about 330 KiB). ZeroMQ drops a connection that
  announces a bigger frame before allocating anything for it.
- ``ZMQ_RCVHWM`` (:data:`RECEIVE_HWM`): messages queued per connection; past
  it ZeroMQ stops reading that connection (TCP backpressure), so one
  connection holds at most ``(RECEIVE_HWM + 1) * largest_message_bytes()``.
- :class:`ConnectionGuard`: connections, counted per peer address from the
  socket's monitor (accepted / disconnected, with the file descriptor), with the
  policy the discovery port shares (:mod:`atom_kv._connection_caps`). A
  source holds at most ``per_source`` connections that have not proven the
  token (sent a valid proof or signed notice); one more shuts that source's
  oldest unproven connection down, so a stranger sharing a legitimate peer's
  address evicts its own idle connections first. (Without a token, any
  well-formed message counts as the proof: a decode host's cached connections
  are never cut, and the cap still bounds connections that say nothing.) At most ``max_connections``
  in all: past it, the oldest unproven connection of the source holding the
  most goes (when it holds more than the newcomer's source),
  otherwise the newcomer. So pre-authentication memory is at most
  ``max_connections * (RECEIVE_HWM + 1) * largest_message_bytes()``, and a
  connection that never completes ZeroMQ's own handshake is dropped after
  ``ZMQ_HANDSHAKE_IVL``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
import struct
from typing import Any, Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from atom_kv import wire
from atom_kv._connection_caps import CapNames, ConnectionCaps
from atom_kv.connector.endpoints import tcp_endpoint

__all__ = ["ConnectionGuard", "PortLimits", "RECEIVE_HWM", "largest_message_bytes", "open_port"]

logger = logging.getLogger(__name__)

#: messages ZeroMQ queues per connection before it stops reading from it
RECEIVE_HWM = 4
_WIDE = "\U0001f600"  # a 4-byte UTF-8 character: strings at their bound in characters are 4x their length in bytes


@functools.lru_cache(maxsize=1)
def largest_message_bytes() -> int:
    """The largest frame a legitimate peer sends to a handshake port, rounded up to 4 KiB."""
    name = _WIDE * 256
    nonce, mac = _WIDE * 128, _WIDE * 128
    compat = wire.CompatInfo(model_id=name, dtype=name, num_layers=1 << 20, num_kv_heads=1 << 20,
                             head_dim=1 << 20, block_size=1 << 20, is_mla=True, layout=name)
    request = wire.HandshakeRequest(engine_id=name, tp_rank=1 << 20, tp_size=1 << 20, compat=compat, backend=name,
                                    host=_WIDE * 255, nonce=nonce, memory=[_WIDE * 16] * 16)
    tid = _WIDE * 128
    signed: dict[str, Any] = dict(ts=-1.5e308, nonce=nonce, mac=mac)
    messages = [
        request,
        wire.HandshakeProof(nonce=nonce, proof=mac, request=b"\xff" * wire.MAX_HANDSHAKE_REQUEST_BYTES),
        wire.PeerProofRequest(nonce=nonce),
        wire.DoneReading(transfer_id=tid, engine_id=name, tp_rank=1 << 20, tp_size=1 << 20, ok=False,
                         want_ack=True, block_offset=1 << 20, num_blocks=1 << 20, blocks_digest=name, **signed),
        wire.Release(transfer_id=tid, reason=name, sender=name, **signed),
        wire.Issued(transfer_id=tid, block_ids=[(1 << 32) - 1] * wire.MAX_ISSUED_BLOCKS, **signed),
        wire.BlocksQuery(transfer_id=tid, engine_id=name, tp_rank=1 << 20, tp_size=1 << 20,
                         wait_ms=wire.MAX_BLOCKS_WAIT_MS, **signed),
    ]
    largest = max(len(wire.encode(m)) for m in messages)
    return (largest + 4095) // 4096 * 4096


def open_port(ctx: zmq.Context, bind_host: str, port: int, limits: "PortLimits",
              on_refuse: Callable[[str, str], None]) -> tuple[zmq.Socket, "ConnectionGuard", int]:
    """A handshake port's ROUTER socket with its bounds set, bound to ``bind_host:port`` (0: the OS picks),
    its :class:`ConnectionGuard`, and the port bound; raises ``zmq.ZMQError`` or ``ValueError``."""
    sock = ctx.socket(zmq.ROUTER)
    for opt, value in ((zmq.LINGER, 0), (zmq.MAXMSGSIZE, largest_message_bytes()), (zmq.RCVHWM, RECEIVE_HWM),
                       (zmq.HANDSHAKE_IVL, int(limits.zmq_handshake_s * 1000)), (zmq.SNDHWM, 1024)):
        sock.setsockopt(opt, value)
    guard = ConnectionGuard(sock, max_connections=limits.max_connections,
                            per_source=limits.connections_per_source, on_refuse=on_refuse)
    try:
        endpoint, ipv6 = tcp_endpoint(bind_host, port)
        if ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(endpoint)
    except BaseException:
        guard.close()
        sock.close(0)
        raise
    if port == 0:
        port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    guard.port = port
    return sock, guard, port


@dataclass(frozen=True)
class PortLimits:
    """The handshake port's pre-authentication bounds, from the ``handshake_*`` config keys."""

    max_connections: int = 1024
    connections_per_source: int = 64
    challenges_per_source: int = 64
    challenges_reserved: int = 1024
    zmq_handshake_s: float = 5.0

    @classmethod
    def from_config(cls, cfg: Any) -> "PortLimits":
        return cls(max_connections=cfg.limits.handshake_max_connections,
                   connections_per_source=cfg.limits.handshake_max_unproven_connections_per_source,
                   challenges_per_source=cfg.limits.handshake_max_challenges_per_source,
                   challenges_reserved=cfg.limits.handshake_reserved_challenges,
                   zmq_handshake_s=cfg.handshake_timeout_s)


class ConnectionGuard(ConnectionCaps):
    """The handshake port's :class:`~atom_kv._connection_caps.ConnectionCaps` (a newcomer pushes out
    connections that proved nothing: the port knows which connection proved the token), plus the
    ROUTER socket's monitor it follows. ``on_refuse(reason, message)`` counts and logs a connection
    it shut down. Runs on the socket's serving thread: call :meth:`poll_events` when the monitor
    socket is readable; :meth:`close` closes the monitor."""

    def __init__(self, sock: zmq.Socket, *, max_connections: int, per_source: int,
                 on_refuse: Callable[[str, str], None]) -> None:
        # the port is set once the socket is bound: a descriptor from an event is acted on only while it
        # is still a connection on it (atom_kv._sockfd)
        super().__init__(None, max_connections=max_connections, per_source=per_source, displace=True,
                         names=_NAMES, on_refuse=on_refuse)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)

    def poll_events(self) -> None:
        """Handle every monitor event waiting (never blocks)."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            try:
                msg = parse_monitor_message(frames)
            except (ValueError, struct.error):
                continue
            event, fd = int(msg["event"]), int(msg["value"])
            if event == zmq.EVENT_ACCEPTED:
                self.accepted(fd)
            elif event == zmq.EVENT_DISCONNECTED:
                self.disconnected(fd)

    def close(self) -> None:
        self.monitor.close(0)


_NAMES = CapNames(what="handshake connections", total_key="limits.handshake_max_connections",
                  per_source_key="limits.handshake_max_unproven_connections_per_source")
