"""``auto`` backend: per peer and per memory kind, the best inner backend
(:func:`atom_kv.transfer.routes.choose_route`): ``gpu_ipc`` for GPU memory on
one host, ``cma`` for host memory on one host, ``nixl`` for GPU memory across
hosts where NIXL is installed on both sides, staged ``tcp`` otherwise.

Memory is registered with tcp first (it serves every kind: its refusal is
the caller's error), then with every other inner backend that serves all the
kinds registered so far (same region ids everywhere); one that cannot serve a
newly registered kind is closed and offered no more. ``gpu_ipc`` and ``nixl``
are built on the first GPU registration (``nixl`` only where NIXL loads). An
inner backend other than tcp that fails to build, to register memory or to
export its descriptor (a NIXL or CUDA error, say) is closed at once, in its
own teardown order, and offered no more: a warning, never a failed start. The
exported descriptor carries the inner descriptors, this host's identity and
the registered memory kinds. When a route other than tcp (cma, gpu_ipc, nixl)
fails at ``add_peer``, the peer is read over tcp instead (a warning, counted
as "<backend>_fallbacks").

Every peer whose route is not the one its memory kinds and hosts call for is
counted by :meth:`AutoBackend.route_fallbacks`, by backend and reason
(:data:`FALLBACK_REASONS`), for the engine's metrics.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Optional, Sequence

from atom_kv import wire
from atom_kv.transfer.cma.syscalls import cma_unavailable_reason
from atom_kv.wire import decode
from atom_kv.transfer._events import EndpointEvents
from atom_kv.transfer._hostid import host_identity
from atom_kv.transfer._lifecycle import Lifecycle
from atom_kv.transfer.memory import HOST, MemoryKind, kinds_of
from atom_kv.transfer.base import BackendUnavailable, ReadFailure, ReadHandle, ReadOp, TransferBackend, TransferError
from atom_kv.transfer.routes import choose_route
from atom_kv.transfer.tcp import TcpBackend

if TYPE_CHECKING:
    from atom_kv.config import KVTransferConfig

__all__ = ["AutoBackend", "FALLBACK_REASONS"]

log = logging.getLogger(__name__)

#: inner backends besides tcp, in the order their descriptors are offered
_SAME_HOST = ("cma", "gpu_ipc")
#: every inner backend besides tcp, as named in the descriptor
_EXTRA = (*_SAME_HOST, "nixl")

#: why a peer is not read over the route its memory kinds and hosts call for:
#: the backend is not usable on this engine ("unavailable": not built, or
#: dropped after a failed registration or export), the peer does not offer it
#: ("not_offered"), or it failed for this peer ("add_peer_failed"); and why a
#: backend was dropped ("register_failed", "export_failed")
FALLBACK_REASONS = ("unavailable", "not_offered", "add_peer_failed", "register_failed", "export_failed")


class AutoBackend(TransferBackend):
    """Owns one tcp and (when usable here) one cma and one gpu_ipc backend,
    and routes each peer to the best of them. All listen on ``bind_host``
    (``host`` when not given) and advertise ``host``."""

    name = "auto"
    accepts_op_arrays = True
    memory_kinds = frozenset({"host", "gpu"})

    def __init__(self, config: Optional["KVTransferConfig"] = None, **where: Any) -> None:
        """``where``: the keywords every inner backend takes (``host``, ``bind_host``, ``key``,
        ``ports``: see :class:`~atom_kv.transfer._served.ServedBackend`)."""
        self._config, self._where = config, where
        self._tcp = TcpBackend(config, **where)
        self._extra: dict[str, TransferBackend] = {}
        self.unavailable: dict[str, str] = {}
        reason = cma_unavailable_reason()
        if reason is None:
            self._try_build("cma")
        else:
            self.unavailable["cma"] = reason
        if "cma" in self.unavailable:
            log.info("auto: cma not usable here, tcp for host memory: %s", self.unavailable["cma"])
        self._kinds: set[str] = set()
        self._labels: list[str] = []
        self._host_id = host_identity()
        self._lock = threading.Lock()
        self._life = Lifecycle("auto", self._lock)
        self._routes: dict[str, tuple[TransferBackend, str]] = {}
        self._fallbacks: dict[tuple[str, str], int] = {}
        self.events = EndpointEvents(log, "auto fallbacks")

    @property
    def cma_unavailable(self) -> Optional[str]:
        return self.unavailable.get("cma")

    def _try_build(self, name: str) -> None:
        from atom_kv.transfer import create_backend

        try:
            self._extra[name] = create_backend(name, self._config, **self._where)
        except BackendUnavailable as exc:
            self.unavailable[name] = str(exc)
        except Exception as exc:  # a native library's own error: this backend is not offered, tcp serves
            self.unavailable[name] = f"{name} did not start: {type(exc).__name__}: {' '.join(str(exc).split())}"
            log.warning("auto: %s", self.unavailable[name])

    def _drop(self, name: str, reason: str, why: str) -> None:
        """Close inner backend ``name`` after a failure and offer it no more."""
        be = self._extra.pop(name, None)
        if be is None:
            return
        self.unavailable[name] = why
        self._count_fallback(name, reason)
        log.warning("auto: %s is not used on this engine, tcp serves its peers: %s", name, why)
        try:
            be.close()
        except Exception as exc:
            log.warning("auto: closing %s failed: %s", name, exc)

    def _count_fallback(self, backend: str, reason: str) -> None:
        with self._lock:
            key = (backend, reason)
            self._fallbacks[key] = self._fallbacks.get(key, 0) + 1

    def route_fallbacks(self) -> dict[tuple[str, str], int]:
        """``(backend, reason) -> count``: peers read over another route than
        ``backend`` (and backends dropped), by reason (:data:`FALLBACK_REASONS`)."""
        with self._lock:
            return dict(self._fallbacks)

    def _try_build_nixl(self) -> None:
        """Build ``nixl`` for GPU memory across hosts when NIXL loads here
        (without it, staged tcp serves those peers)."""
        from atom_kv.transfer.nixl.probe import nixl_unavailable_reason

        reason = nixl_unavailable_reason()
        if reason is None:
            self._try_build("nixl")
            reason = self.unavailable.get("nixl")
        else:
            self.unavailable["nixl"] = reason
        if reason is not None:
            log.info("auto: nixl not usable here, staged tcp for GPU memory across hosts: %s", reason)

    def _inner(self) -> list[TransferBackend]:
        return [self._tcp, *self._extra.values()]

    def register_memory(self, ptr: int, size: int, *, align: int = 1, memory: MemoryKind = HOST) -> list[int]:
        self.check_memory(memory)
        first_gpu = memory.is_gpu and not self._kinds and "gpu_ipc" not in self._extra \
            and "gpu_ipc" not in self.unavailable
        for name, be in list(self._extra.items()):
            if memory.kind not in be.memory_kinds:  # it could not keep region ids in step: offered no more
                log.info("auto: %s memory registered, so %s is not used (it serves %s)",
                         memory.label, name, ", ".join(sorted(be.memory_kinds)))
                del self._extra[name]
                be.close()
        self._tcp.max_region_bytes = self.max_region_bytes
        ids = self._tcp.register_memory(ptr, size, align=align, memory=memory)
        if first_gpu:  # built only once tcp took the memory: a refusal there leaves nothing to tear down
            self._try_build("gpu_ipc")
            if "gpu_ipc" in self.unavailable:
                log.info("auto: gpu_ipc not usable here, staged tcp for GPU memory: %s", self.unavailable["gpu_ipc"])
            self._try_build_nixl()
        for name, be in list(self._extra.items()):
            be.max_region_bytes = self.max_region_bytes
            try:
                got = be.register_memory(ptr, size, align=align, memory=memory)
            except Exception as exc:  # NIXL, CUDA or the kernel refused: tcp still serves this memory
                self._drop(name, "register_failed", f"{name} could not register {memory.label} memory: "
                                                    f"{type(exc).__name__}: {' '.join(str(exc).split())}")
                continue
            if got != ids:
                self._drop(name, "register_failed", f"{name} disagrees with tcp on region ids ({got} vs {ids})")
        self._kinds.add(memory.kind)
        if memory.label not in self._labels:
            self._labels.append(memory.label)
        return ids

    def export_descriptor(self) -> bytes:
        inner = {}
        for name, be in list(self._extra.items()):
            try:
                inner[name] = be.export_descriptor()
            except Exception as exc:  # offered no more: peers read this engine over tcp instead
                self._drop(name, "export_failed", f"{name} could not export its descriptor: "
                                                  f"{type(exc).__name__}: {' '.join(str(exc).split())}")
        return wire.encode(wire.AutoDescriptor(host_id=self._host_id, tcp=self._tcp.export_descriptor(),
                                               memory=list(self._labels), cma=inner.get("cma", b""),
                                               gpu_ipc=inner.get("gpu_ipc", b""), nixl=inner.get("nixl", b"")))

    def add_peer(self, descriptor: bytes) -> str:
        self._life.check_open()
        try:
            desc = decode(descriptor, wire.AutoDescriptor)
        except wire.WireError as exc:
            log.warning("auto: bad peer descriptor: %s", exc)
            raise TransferError(f"auto: bad peer descriptor: {exc}") from None
        theirs = {"tcp": desc.tcp, **{name: getattr(desc, name) for name in _EXTRA}}
        offered = {name for name in ("tcp", *self._extra) if theirs.get(name)}
        local, peer = frozenset(self._kinds or {"host"}), kinds_of(desc.memory)
        same_host = desc.host_id == self._host_id
        name = choose_route(local, peer, same_host=same_host, offered=offered)
        ideal = choose_route(local, peer, same_host=same_host, offered={"tcp", *_EXTRA})
        if ideal != name:
            self._count_fallback(ideal, "unavailable" if ideal not in self._extra else "not_offered")
        chosen = self._tcp if name == "tcp" else self._extra[name]
        try:
            inner_id = chosen.add_peer(theirs[name])
        except Exception as exc:  # kernel refusal, grant refused, silent endpoint, a native library's error
            if chosen is self._tcp:
                raise
            self.events.warn(f"{name}_fallbacks",
                             f"auto: {name} failed for this peer ({exc}); falling back to tcp")
            self._count_fallback(name, "add_peer_failed")
            chosen = self._tcp
            inner_id = chosen.add_peer(desc.tcp)
        peer_id = f"auto/{inner_id}"
        with self._lock:
            self._routes[peer_id] = (chosen, inner_id)
        log.info("auto: peer %s uses %s", peer_id, chosen.name)
        return peer_id

    def kv_written(self) -> None:
        """Every inner backend records that the engine's KV writes so far count as written."""
        for be in self._inner():
            be.kv_written()

    def backend_for(self, peer_id: str) -> str:
        """Name of the inner backend serving ``peer_id`` ("gpu_ipc", "cma", "nixl" or "tcp")."""
        return self._routes[peer_id][0].name

    def stats(self) -> dict[str, int]:
        """"cma_fallbacks", "gpu_ipc_fallbacks" plus the inner backends'
        counts, prefixed with their names."""
        out = self.events.snapshot()
        for name in _EXTRA:
            out.setdefault(f"{name}_fallbacks", 0)
        for be in self._inner():
            out.update({f"{be.name}_{k}": v for k, v in be.stats().items()})
        return out

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            route = self._routes.pop(peer_id, None)
        if route is not None:
            route[0].remove_peer(route[1])

    def read(self, peer_id: str, ops: Sequence[ReadOp] | Any, *, timeout_s: float) -> ReadHandle:
        with self._lock:
            route = self._routes.get(peer_id)
            refusal = self._life.read_refusal(route, peer_id)  # closed: its routes are gone, not unknown
        if route is None or refusal is not None:
            handle = ReadHandle()
            handle._finish(f"auto: {refusal.text}" if refusal else f"auto: unknown peer {peer_id!r}",
                           refusal.reason if refusal else ReadFailure.UNKNOWN_PEER)
            return handle
        return route[0].read(route[1], ops, timeout_s=timeout_s)

    def close(self) -> None:
        with self._lock:
            if not self._life.mark_closed():
                return
            self._routes.clear()
        for be in self._inner():
            be.close()
