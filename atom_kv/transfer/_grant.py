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
threads); each must send its request within ``cma.grant_timeout_s``
(``gpu_ipc.grant_timeout_s`` for gpu_ipc's).
"""

from __future__ import annotations

import abc
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Callable, Optional

from atom_kv import wire
from atom_kv.wire import decode
from atom_kv.transfer._events import EndpointEvents
from atom_kv.transfer._frame_server import Conn, ServerLimits
from atom_kv.transfer._hostid import host_identity
from atom_kv.transfer._served import ServedBackend, ServingEndpoint
from atom_kv.transfer._sockio import HELLO_FRAME_MAX, frame, recv_frame
from atom_kv.transfer._trust import AUTH_HINT, PURPOSE_CMA_GRANT, ReaderProof, version_refusal
from atom_kv.transfer.base import TransferError

if TYPE_CHECKING:
    from atom_kv.config import KVTransferConfig

__all__ = ["GrantServer", "GrantedBackend", "request_grant"]

log = logging.getLogger(__name__)

#: threads answering grant requests (each answer is one small send)
GRANT_THREADS = 2
#: a grant endpoint lets one address wait for its request on 1/8 of its connections ...
GRANT_SHARES_PER_SOURCE = 8
#: ... and keeps 1/4 of them for addresses that were granted before
GRANT_RESERVED_FRACTION = 4
#: largest grant reply a reader accepts (about 150,000 regions)
MAX_GRANT_REPLY = 4 << 20


class GrantServer(ServingEndpoint):
    """Owns the grant protocol of one cma or gpu_ipc backend's grant endpoint,
    on top of its :class:`ServingEndpoint`. Event keys: granted, auth,
    version, decode, export, busy, oversized, timeout."""

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
        self._timeout = timeout_s
        self._spans = spans
        key = f"{name}.grant_max_connections"
        limits = ServerLimits(
            max_connections=max_connections, max_frame=HELLO_FRAME_MAX, read_timeout_s=timeout_s,
            idle_timeout_s=timeout_s, threads=GRANT_THREADS,
            max_unauthenticated_per_source=max(1, max_connections // GRANT_SHARES_PER_SOURCE),
            reserved=max_connections // GRANT_RESERVED_FRACTION,
            keys=(key, f"{key} / {GRANT_SHARES_PER_SOURCE} per address", f"{key} / {GRANT_RESERVED_FRACTION}"),
        )
        self._serve(log, name, label, bind_host=bind_host, host=host, auth_token=auth_token,
                    limits=limits, handle=self._answer, port=port, threads=f"atomkv-{name}-ctl")

    @property
    def grants(self) -> int:
        return self.events["granted"]

    def _greet(self, conn: Conn) -> bytes:
        return wire.encode(wire.CmaChallenge(nonce=self._nonce(conn)))

    def _busy(self, why: str) -> bytes:
        return wire.encode(wire.CmaChallenge(ok=False, error=f"{self._name}: the grant endpoint refused the "
                                                             f"connection: {why}"))

    def _answer(self, conn: Conn, payload: bytearray) -> bool:
        """Answer the one request of a connection; the connection then closes."""
        who = f"{self._label}: reader at {conn.peer}"
        req = self._opening(payload, wire.CmaGrantRequest, wire.CMA_PROTOCOL_VERSION, "grant request")
        if isinstance(req, tuple):  # refused: (event key, one line)
            return self._refuse(conn, *req, who=who)
        who = f"{who} (pid {req.pid}, {req.key!r})"
        proof = self._proof(conn, self._purpose, req.nonce, req.proof)
        if proof is None:
            return self._refuse(conn, "auth", f"{self._name}: the grant endpoint refused this reader: wrong or "
                                              f"missing auth_token proof; {AUTH_HINT}", who=who)
        conn.authenticated = True  # its address is a reader's: it keeps a share of the reserve
        spans = [wire.RegionSpan(region=r, addr=a, size=s) for r, a, s in self._spans()]
        try:  # gpu_ipc: one send of every region per grant; memory it cannot share refuses the grant
            ipc = self._handles() if self._handles is not None else []
        except TransferError as exc:
            return self._refuse(conn, "export", str(exc), who=who)
        self._send(conn, wire.CmaGrantReply(ok=True, pid=os.getpid(), regions=spans, proof=proof, ipc=ipc))
        self.events.count("granted")
        log.info("%s: granted %d regions", who, len(spans))
        return False

    def _refuse(self, conn: Conn, key: str, why: str, *, who: str) -> bool:
        self.events.warn(key, f"{who}: refused: {why}")
        self._send(conn, wire.CmaGrantReply(ok=False, error=why[:1024]))
        return False

    def _send(self, conn: Conn, reply: wire.CmaGrantReply) -> None:
        conn.sock.settimeout(self._timeout)
        conn.sock.sendall(frame(wire.encode(reply)))


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
                            f"({name}_grant_timeout_s)") from None
    except OSError as exc:
        raise TransferError(f"{name}: cannot reach grant endpoint {where}: {exc}") from None
    if reply.v != wire.CMA_PROTOCOL_VERSION:
        raise TransferError(f"{version_refusal(name, 'peer', reply.v, wire.CMA_PROTOCOL_VERSION)} "
                            f"(grant endpoint {where})")
    if reply.ok:
        proof.check_server(reply.proof)
    return reply


class GrantedBackend(ServedBackend):
    """Base of the same-host backends whose endpoint is a grant endpoint (cma,
    gpu_ipc): the endpoint, the descriptor that names it, and asking a peer's
    endpoint for its grant. Each says what its grants hold (:meth:`_spans`,
    :meth:`_handles`) and which keys bound them (:meth:`_grant_keys`)."""

    #: what the reader proves it knows the token for (:mod:`atom_kv.transfer._trust`)
    purpose = PURPOSE_CMA_GRANT

    def _setup(self, cfg: "KVTransferConfig") -> None:
        self._grant_timeout, self._grant_max_connections = self._grant_keys(cfg)

    @abc.abstractmethod
    def _grant_keys(self, cfg: "KVTransferConfig") -> tuple[float, int]:
        """(grant timeout, grant endpoint's connections) from the config."""

    def _spans(self) -> list[tuple[int, int, int]]:
        """The (region, address, size) rows a grant hands out."""
        return []

    _handles: Optional[Callable[[], list[wire.GpuIpcRegion]]] = None

    def _start_endpoint(self, port: int) -> GrantServer:
        return GrantServer(
            bind_host=self._bind_host, host=self._host, auth_token=self._token, timeout_s=self._grant_timeout,
            max_connections=self._grant_max_connections, spans=self._spans,
            label=f"{self.name} grant endpoint {self._key}", name=self.name, purpose=self.purpose,
            handles=self._handles, port=port,
        )

    def export_descriptor(self) -> bytes:
        ctl = self._serving()
        return wire.encode(wire.CmaDescriptor(pid=os.getpid(), host_id=host_identity(), ctl_host=ctl.host,
                                              ctl_port=ctl.port, key=self._key))

    def _granted(self, descriptor: bytes, other_host: str) -> tuple[wire.CmaDescriptor, wire.CmaGrantReply]:
        """A peer's descriptor and its grant endpoint's grant; refused in one
        line (``other_host`` says what to use instead) when the peer is on
        another host or its endpoint refused."""
        desc = self._descriptor(descriptor, wire.CmaDescriptor)
        if desc.host_id != host_identity():
            raise TransferError(f"{self.name}: peer {desc.key or desc.pid} is on another host (or pid namespace); "
                                f"{other_host}")
        grant = request_grant(desc, self._key, self._token, self._grant_timeout, self.reader_events,
                              name=self.name, purpose=self.purpose)
        if not grant.ok:
            raise TransferError(grant.error)
        return desc, grant
