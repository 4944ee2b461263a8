"""The serving-plus-reader set-up that tcp, cma and gpu_ipc share: one
constructor, the serving endpoint started on first use, the peer table, the
stats and the close skeleton (:class:`ServedBackend`); and the base of the
endpoints they serve, a :class:`FrameServer` with its event counts
(:class:`ServingEndpoint`).

Each backend says only what is its own: :meth:`ServedBackend._setup` (its
state), :meth:`ServedBackend._start_endpoint` (what listens) and
:meth:`ServedBackend._shut` (what stops, in which order).
"""

from __future__ import annotations

import abc
import atexit
import functools
import itertools
import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar, Union

import msgspec

from atom_kv import wire
from atom_kv.ports import RankPorts, listening
from atom_kv.transfer._events import EndpointEvents, endpoint_stats
from atom_kv.transfer._frame_server import Conn, FrameServer, ServerLimits
from atom_kv.transfer._lifecycle import Lifecycle
from atom_kv.transfer._regions import resolve_config
from atom_kv.transfer._trust import new_nonce, peek_version, reader_proof_ok, server_proof, version_refusal
from atom_kv.transfer.base import TransferBackend, TransferError

if TYPE_CHECKING:
    from atom_kv.config import KVTransferConfig

__all__ = ["ServedBackend", "ServingEndpoint"]

S = TypeVar("S", bound=msgspec.Struct)


class ServingEndpoint(abc.ABC):
    """Base of one backend's listening endpoint (tcp's read server, the grant
    endpoint): owns its :class:`FrameServer` (socket, threads, connections),
    its event counts, and the address written into descriptors (``host``;
    the socket listens on ``bind_host``). Subclasses answer the protocol:
    ``_greet``, ``_busy`` and the frame handler they pass to :meth:`_serve`."""

    host: str
    port: int
    events: EndpointEvents

    def _serve(self, logger: logging.Logger, name: str, label: str, *, bind_host: str, host: str,
               auth_token: Optional[str], limits: ServerLimits, handle: Callable[[Conn, bytearray], bool],
               port: int, threads: Optional[str] = None) -> None:
        """Start listening; ``name`` is the backend's (in refusals), ``threads`` the thread names' prefix."""
        self._name = name
        self._token = auth_token.encode("utf-8") if auth_token else None
        self._label = label
        self.host = host
        self.events = EndpointEvents(logger, f"{label} events")
        self._server = FrameServer(
            threads or f"atomkv-{name}", label, bind_host, limits, self.events,
            greet=self._greet, refuse_busy=self._busy, handle=handle, port=port,
        ).start()
        self.port = self._server.port
        self.bind_address = self._server.bind_address

    @abc.abstractmethod
    def _greet(self, conn: Conn) -> bytes:
        """The frame sent right after accept: the endpoint's hello (with its challenge nonce)."""

    # -- the opening of a connection: challenge, version, proof ------------
    def _nonce(self, conn: Conn) -> str:
        """The challenge a new connection is greeted with (empty without a token)."""
        if self._token is not None:
            conn.nonce = new_nonce()
        return conn.nonce

    def _opening(self, payload: bytearray, kind: type[S], version: int,
                 what: str) -> Union[S, tuple[str, str]]:
        """A reader's first frame, decoded, or why it is refused: (event key, one line)."""
        try:
            msg = wire.decode(payload, kind)
        except wire.WireError as exc:
            theirs = peek_version(payload)
            if theirs is not None and theirs != version:
                return ("version", version_refusal(self._name, "reader", theirs, version))
            return ("decode", f"{self._name}: bad {what}: {exc}")
        theirs = msg.v  # type: ignore[attr-defined]  # every opening frame carries its version
        if theirs != version:
            return ("version", version_refusal(self._name, "reader", theirs, version))
        return msg

    def _proof(self, conn: Conn, purpose: str, nonce: str, proof: str) -> Optional[str]:
        """This endpoint's proof for a reader whose ``proof`` shows it knows the
        token ("" without a token); None when it does not."""
        if self._token is None:
            return ""
        if not reader_proof_ok(self._token, purpose, conn.nonce, nonce, proof):
            return None
        return server_proof(self._token, purpose, conn.nonce, nonce)

    @abc.abstractmethod
    def _busy(self, why: str) -> bytes:
        """The protocol's refusal frame for a connection over a limit (``why`` names it)."""

    # -- counters (tests, metrics) -----------------------------------------
    @property
    def decode_errors(self) -> int:
        return self.events["decode"]

    @property
    def auth_failures(self) -> int:
        return self.events["auth"]

    def stats(self) -> dict[str, int]:
        """Event counts by key (the class docstring of each endpoint lists its keys)."""
        return self.events.snapshot()

    def close(self) -> None:
        self._server.close()


def _close_at_exit(ref: "weakref.ref[ServedBackend]") -> None:
    """Close a backend its owner never closed, at interpreter exit before finalization: its threads are
    daemons, and one that finalization stops inside native code (a torch copy of the staged path, which
    releases the GIL) aborts the process ("terminate called without an active exception")."""
    backend = ref()
    if backend is not None:
        backend.close()


class ServedBackend(TransferBackend):
    """Base of the backends that serve their own reads (tcp, cma, gpu_ipc):
    owns what they all keep (addresses, key, token, lock, lifecycle, the
    reading side's events, the peers and the serving endpoint, started on
    the first export: only a rank that serves reads listens).

    ``host`` is the address peers are told to connect to; the endpoint
    listens on ``bind_host`` (``host`` when not given: never all interfaces
    unless asked with ``"0.0.0.0"``); ``key`` names this endpoint (made up
    when not given); ``ports`` is the rank's port plan (OS-assigned without)."""

    def __init__(
        self,
        config: Optional["KVTransferConfig"] = None,
        *,
        host: str = "127.0.0.1",
        bind_host: Optional[str] = None,
        key: Optional[str] = None,
        ports: Optional[RankPorts] = None,
    ) -> None:
        cfg = resolve_config(config)
        self._log = logging.getLogger(type(self).__module__)
        self._ports = ports
        self._host = host
        self._bind_host = bind_host or host
        self._key = key or f"{self.name}-{os.getpid()}-{id(self):x}"
        self._token = cfg.auth_token
        self.reader_events = EndpointEvents(self._log, f"{self.name} {self._key} reader events")
        self._lock = threading.Lock()
        self._life = Lifecycle(self.name, self._lock, key=self._key)
        self._endpoint: Any = None
        self._peers: dict[str, Any] = {}
        self._peer_seq = itertools.count(1)
        self._read_seq = itertools.count(1)
        self._setup(cfg)
        self._exit_hook = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._exit_hook)

    # -- what each backend says -------------------------------------------
    def _setup(self, cfg: "KVTransferConfig") -> None:
        """The backend's own state, from its config keys."""

    @abc.abstractmethod
    def _start_endpoint(self, port: int) -> Any:
        """Start the serving endpoint on ``port`` (0: OS-assigned); called once, under the lock."""

    @abc.abstractmethod
    def _shut(self, peers: list[Any], endpoint: Any) -> None:
        """Stop everything, in this backend's order: called once, by :meth:`close`, outside the lock,
        with the peers and the endpoint (None when none started) already detached."""

    # -- shared steps -------------------------------------------------------
    def _serving(self) -> Any:
        """The serving endpoint, started on first use."""
        with self._lock:
            self._life.check_open()
            if self._endpoint is None:
                self._endpoint = listening(self._ports, self.name, self._bind_host, self._start_endpoint)
            return self._endpoint

    def _descriptor(self, descriptor: bytes, kind: type[S]) -> S:
        """A peer's descriptor, decoded; a bad one is logged and refused in one line."""
        try:
            return wire.decode(descriptor, kind)
        except wire.WireError as exc:
            self._log.warning("%s %s: bad peer descriptor: %s", self.name, self._key, exc)
            raise TransferError(f"{self.name}: bad peer descriptor: {exc}") from None

    def _keep_peer(self, peer_id: str, peer: Any, drop: Callable[[Any], None] = lambda peer: None) -> None:
        """Add a peer, unless the backend closed meanwhile: then ``drop`` it and refuse."""
        with self._lock:
            closed = self._life.closed
            if not closed:
                self._peers[peer_id] = peer
        if closed:
            drop(peer)
            self._life.check_open()

    def _pop_peer(self, peer_id: str) -> Any:
        with self._lock:
            return self._peers.pop(peer_id, None)

    def stats(self) -> dict[str, int]:
        """Event counts: the serving endpoint's and, prefixed "reader_", this side's."""
        with self._lock:
            endpoint = self._endpoint
        return endpoint_stats(endpoint, self.reader_events)

    def close(self) -> None:
        with self._lock:
            if not self._life.mark_closed():
                return
            atexit.unregister(self._exit_hook)
            peers = list(self._peers.values())
            self._peers.clear()
            endpoint, self._endpoint = self._endpoint, None
        self._shut(peers, endpoint)
        self.reader_events.flush()
        self._log.info("%s %s: closed", self.name, self._key)
