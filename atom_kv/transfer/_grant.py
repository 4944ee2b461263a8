"""The grant endpoint of the same-host backends (cma, gpu_ipc): a
:class:`FrameServer` in the serving process that hands its region table to a
reader (after challenge-response when an ``auth_token`` is set), plus
:func:`request_grant`, the reader's side. A grant also proves the serving
process is alive at ``add_peer`` time. gpu_ipc's grant also carries the GPU
memory handles (``ipc``): capabilities, which is why they travel only here,
to a reader that proved the token, and never in a descriptor.

One connection, one grant::

    endpoint -> CmaChallenge(nonce)               nonce empty without a token
    reader   -> CmaGrantRequest(pid, key, nonce, proof)
    endpoint -> CmaGrantReply(ok, pid, regions, proof)

Connections are served concurrently (one selector thread, two handler
threads); each must send its request within ``cma_grant_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable, Optional

from atom_kv import wire
from atom_kv.wire import decode
from atom_kv.transfer._events import EndpointEvents
from atom_kv.transfer._frame_server import Conn, FrameServer, ServerLimits
from atom_kv.transfer._sockio import HELLO_FRAME_MAX, frame, recv_frame
from atom_kv.transfer._trust import (
    AUTH_HINT,
    PURPOSE_CMA_GRANT,
    ReaderProof,
    new_nonce,
    peek_version,
    reader_proof_ok,
    server_proof,
    version_refusal,
)
from atom_kv.transfer.base import TransferError

__all__ = ["GrantServer", "request_grant"]

log = logging.getLogger(__name__)

#: threads answering grant requests (each answer is one small send)
GRANT_THREADS = 2
#: a grant endpoint lets one address wait for its request on 1/8 of its connections ...
GRANT_SHARES_PER_SOURCE = 8
#: ... and keeps 1/4 of them for addresses that were granted before
GRANT_RESERVED_FRACTION = 4
#: largest grant reply a reader accepts (about 150,000 regions)
MAX_GRANT_REPLY = 4 << 20


class GrantServer:
    """Owns the grant endpoint of one cma backend: its :class:`FrameServer`
    (socket, threads, connections) and the grant protocol. ``host`` is the
    address written into descriptors; the socket listens on ``bind_host``."""

    def __init__(
        self,
        *,
        bind_host: str,
        host: str,
        auth_token: Optional[str],
        timeout_s: float,
        max_connections: int,
        spans: Callable[[], list[tuple[int, int, int]]],
        label: str,
        name: str = "cma",
        purpose: str = PURPOSE_CMA_GRANT,
        handles: Optional[Callable[[], list[wire.GpuIpcRegion]]] = None,
        port: int = 0,
    ) -> None:
        self._name = name
        self._purpose = purpose
        self._handles = handles
        self._token = auth_token.encode("utf-8") if auth_token else None
        self._timeout = timeout_s
        self._max_connections = max_connections
        self._spans = spans
        self._label = label
        self.host = host
        self.events = EndpointEvents(log, f"{label} events")
        limits = ServerLimits(
            max_connections=max_connections, max_frame=HELLO_FRAME_MAX, read_timeout_s=timeout_s,
            idle_timeout_s=timeout_s, threads=GRANT_THREADS,
            max_unauthenticated_per_source=max(1, max_connections // GRANT_SHARES_PER_SOURCE),
            reserved=max_connections // GRANT_RESERVED_FRACTION,
            keys=("cma_grant_max_connections", "cma_grant_max_connections / 8 per address",
                  "cma_grant_max_connections / 4"),
        )
        self._server = FrameServer(
            "atomkv-cma-ctl", label, bind_host, limits, self.events,
            greet=self._greet, refuse_busy=self._busy, handle=self._answer, port=port,
        )
        self.port = self._server.port
        self.bind_address = self._server.bind_address

    @property
    def decode_errors(self) -> int:
        return self.events["decode"]

    @property
    def auth_failures(self) -> int:
        return self.events["auth"]

    @property
    def grants(self) -> int:
        return self.events["granted"]

    def stats(self) -> dict[str, int]:
        """Event counts by key: granted, auth, version, decode, export, busy, oversized, timeout."""
        return self.events.snapshot()

    def _greet(self, conn: Conn) -> bytes:
        if self._token is not None:
            conn.nonce = new_nonce()
        return wire.encode(wire.CmaChallenge(nonce=conn.nonce))

    def _busy(self, why: str) -> bytes:
        return wire.encode(wire.CmaChallenge(ok=False, error=f"{self._name}: the grant endpoint refused the "
                                                             f"connection: {why}"))

    def _answer(self, conn: Conn, payload: bytearray) -> bool:
        """Answer the one request of a connection; the connection then closes."""
        who = f"{self._label}: reader at {conn.peer}"
        try:
            req = decode(payload, wire.CmaGrantRequest)
        except wire.WireError as exc:
            theirs = peek_version(payload)
            if theirs is not None and theirs != wire.CMA_PROTOCOL_VERSION:
                return self._refuse(conn, "version", who, version_refusal(self._name, "reader", theirs,
                                                                          wire.CMA_PROTOCOL_VERSION))
            return self._refuse(conn, "decode", who, f"{self._name}: bad grant request: {exc}")
        who = f"{who} (pid {req.pid}, {req.key!r})"
        if req.v != wire.CMA_PROTOCOL_VERSION:
            return self._refuse(conn, "version", who, version_refusal(self._name, "reader", req.v,
                                                                      wire.CMA_PROTOCOL_VERSION))
        proof = ""
        if self._token is not None:
            if not reader_proof_ok(self._token, self._purpose, conn.nonce, req.nonce, req.proof):
                return self._refuse(conn, "auth", who, f"{self._name}: the grant endpoint refused this reader: "
                                                       f"wrong or missing auth_token proof; {AUTH_HINT}")
            proof = server_proof(self._token, self._purpose, conn.nonce, req.nonce)
        conn.authenticated = True  # its address is a reader's: it keeps a share of the reserve
        spans = [wire.RegionSpan(region=r, addr=a, size=s) for r, a, s in self._spans()]
        try:  # gpu_ipc: one send of every region per grant; memory it cannot share refuses the grant
            ipc = self._handles() if self._handles is not None else []
        except TransferError as exc:
            return self._refuse(conn, "export", who, str(exc))
        self._send(conn, wire.CmaGrantReply(ok=True, pid=os.getpid(), regions=spans, proof=proof, ipc=ipc))
        self.events.count("granted")
        log.info("%s: granted %d regions", who, len(spans))
        return False

    def _refuse(self, conn: Conn, key: str, who: str, why: str) -> bool:
        self.events.warn(key, f"{who}: refused: {why}")
        self._send(conn, wire.CmaGrantReply(ok=False, error=why[:1024]))
        return False

    def _send(self, conn: Conn, reply: wire.CmaGrantReply) -> None:
        conn.sock.settimeout(self._timeout)
        conn.sock.sendall(frame(wire.encode(reply)))

    def close(self) -> None:
        self._server.close()


def request_grant(
    desc: wire.CmaDescriptor, key: str, auth_token: Optional[str], timeout_s: float,
    events: Optional[EndpointEvents] = None, *, name: str = "cma", purpose: str = PURPOSE_CMA_GRANT,
) -> wire.CmaGrantReply:
    """Ask a peer's grant endpoint for its region table, within ``timeout_s``.

    Returns the endpoint's reply (``ok=False`` with the reason when it
    refused); raises :class:`TransferError` when the endpoint cannot be
    reached, is silent, speaks another protocol version, sends something
    undecodable, or fails to prove it knows the token."""
    where = f"{desc.ctl_host}:{desc.ctl_port} (pid {desc.pid})"
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((desc.ctl_host, desc.ctl_port), timeout=timeout_s) as sock:
            challenge = decode(recv_frame(sock, deadline, HELLO_FRAME_MAX), wire.CmaChallenge)
            if challenge.v != wire.CMA_PROTOCOL_VERSION:
                raise TransferError(f"{version_refusal(name, 'peer', challenge.v, wire.CMA_PROTOCOL_VERSION)} "
                                    f"(grant endpoint {where})")
            if not challenge.ok:
                return wire.CmaGrantReply(ok=False, error=f"{challenge.error} (grant endpoint {where})")
            proof = ReaderProof(auth_token, purpose, challenge.nonce, name, f"grant endpoint {where}")
            request = wire.CmaGrantRequest(pid=os.getpid(), key=key, nonce=proof.nonce, proof=proof.proof)
            sock.sendall(frame(wire.encode(request)))
            reply = decode(recv_frame(sock, deadline, MAX_GRANT_REPLY), wire.CmaGrantReply)
    except wire.WireError as exc:
        if events is not None:
            events.warn("bad_grant", f"{name}: bad answer from grant endpoint {where}: {exc}")
        raise TransferError(f"{name}: bad answer from grant endpoint {where}: {exc}") from None
    except TimeoutError:
        raise TransferError(f"{name}: grant endpoint {where} did not answer within {timeout_s:g}s "
                            "(cma_grant_timeout_s)") from None
    except OSError as exc:
        raise TransferError(f"{name}: cannot reach grant endpoint {where}: {exc}") from None
    if reply.v != wire.CMA_PROTOCOL_VERSION:
        raise TransferError(f"{version_refusal(name, 'peer', reply.v, wire.CMA_PROTOCOL_VERSION)} "
                            f"(grant endpoint {where})")
    if reply.ok:
        proof.check_server(reply.proof)
    return reply
