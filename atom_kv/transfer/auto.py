"""``auto`` backend: ``cma`` for peers on this host (same kernel boot and pid
namespace, and the kernel allows it), ``tcp`` otherwise.

Memory is registered with both inner backends (same region ids) and the
exported descriptor carries both descriptors plus this host's identity.
When a same-host peer's cma grant fails or times out, the peer is read over
tcp instead (a warning, counted as "cma_fallbacks").
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Optional, Sequence

from atom_kv import wire
from atom_kv.transfer._cma_sys import cma_unavailable_reason
from atom_kv.wire import decode
from atom_kv.transfer._events import EndpointEvents
from atom_kv.transfer._hostid import host_identity
from atom_kv.transfer._lifecycle import Lifecycle
from atom_kv.transfer.memory import HOST, MemoryKind
from atom_kv.transfer.base import BackendUnavailable, ReadHandle, ReadOp, TransferBackend, TransferError
from atom_kv.transfer.tcp import TcpBackend

if TYPE_CHECKING:
    from atom_kv.config import KVTransferConfig

__all__ = ["AutoBackend"]

log = logging.getLogger(__name__)


class AutoBackend(TransferBackend):
    """Owns one tcp and (when usable here) one cma backend and routes each
    peer to the best of them. Both listen on ``bind_host`` (``host`` when not
    given) and advertise ``host``."""

    name = "auto"
    accepts_op_arrays = True

    def __init__(
        self,
        config: Optional["KVTransferConfig"] = None,
        *,
        host: str = "127.0.0.1",
        bind_host: Optional[str] = None,
        key: Optional[str] = None,
    ) -> None:
        self._tcp = TcpBackend(config, host=host, bind_host=bind_host, key=key)
        self._cma: Optional[TransferBackend] = None
        self.cma_unavailable: Optional[str] = cma_unavailable_reason()
        if self.cma_unavailable is None:
            from atom_kv.transfer.cma import CmaBackend

            try:
                self._cma = CmaBackend(config, host=host, bind_host=bind_host, key=key)
            except BackendUnavailable as exc:
                self.cma_unavailable = str(exc)
        if self.cma_unavailable:
            log.info("auto: cma not usable here, tcp only: %s", self.cma_unavailable)
        self._host_id = host_identity()
        self._lock = threading.Lock()
        self._life = Lifecycle("auto", self._lock)
        self._routes: dict[str, tuple[TransferBackend, str]] = {}
        self.events = EndpointEvents(log, "auto cma fallbacks")

    def _inner(self) -> list[TransferBackend]:
        return [b for b in (self._tcp, self._cma) if b is not None]

    def register_memory(self, ptr: int, size: int, *, align: int = 1, memory: MemoryKind = HOST) -> list[int]:
        self.check_memory(memory)
        ids = None
        for be in self._inner():
            be.max_region_bytes = self.max_region_bytes
            got = be.register_memory(ptr, size, align=align, memory=memory)
            if ids is not None and got != ids:
                raise TransferError(f"auto: inner backends disagree on region ids ({ids} vs {got})")
            ids = got
        assert ids is not None
        return ids

    def export_descriptor(self) -> bytes:
        cma = self._cma.export_descriptor() if self._cma is not None else b""
        return wire.encode(wire.AutoDescriptor(host_id=self._host_id, tcp=self._tcp.export_descriptor(), cma=cma))

    def add_peer(self, descriptor: bytes) -> str:
        self._life.check_open()
        try:
            desc = decode(descriptor, wire.AutoDescriptor)
        except wire.WireError as exc:
            log.warning("auto: bad peer descriptor: %s", exc)
            raise TransferError(f"auto: bad peer descriptor: {exc}") from None
        chosen: TransferBackend = self._tcp
        inner_desc = desc.tcp
        if desc.cma and self._cma is not None and desc.host_id == self._host_id:
            chosen, inner_desc = self._cma, desc.cma
        try:
            inner_id = chosen.add_peer(inner_desc)
        except TransferError as exc:  # kernel refusal, grant refused, silent or unreachable endpoint
            if chosen is self._tcp:
                raise
            self.events.warn("cma_fallbacks", f"auto: cma failed for a same-host peer ({exc}); falling back to tcp")
            chosen = self._tcp
            inner_id = chosen.add_peer(desc.tcp)
        peer_id = f"auto/{inner_id}"
        with self._lock:
            self._routes[peer_id] = (chosen, inner_id)
        log.info("auto: peer %s uses %s", peer_id, chosen.name)
        return peer_id

    def backend_for(self, peer_id: str) -> str:
        """Name of the inner backend serving ``peer_id`` ("cma" or "tcp")."""
        return self._routes[peer_id][0].name

    def stats(self) -> dict[str, int]:
        """"cma_fallbacks" plus the inner backends' counts, prefixed "tcp_"/"cma_"."""
        out = self.events.snapshot()
        out.setdefault("cma_fallbacks", 0)
        for be in self._inner():
            out.update({f"{be.name}_{k}": v for k, v in be.stats().items()})
        return out

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            route = self._routes.pop(peer_id, None)
        if route is not None:
            route[0].remove_peer(route[1])

    def read(self, peer_id: str, ops: Sequence[ReadOp] | Any, *, timeout_s: float) -> ReadHandle:
        route = self._routes.get(peer_id)
        if route is None:
            handle = ReadHandle()
            handle._finish(f"auto: unknown peer {peer_id!r}")
            return handle
        return route[0].read(route[1], ops, timeout_s=timeout_s)

    def close(self) -> None:
        with self._lock:
            if not self._life.mark_closed():
                return
            self._routes.clear()
        for be in self._inner():
            be.close()
