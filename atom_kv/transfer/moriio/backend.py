"""The ``moriio`` transfer backend: one-sided reads over AMD MORI-IO (RDMA or XGMI).

One :class:`MoriIOBackend` per TP rank owns one ``mori.io.IOEngine`` (key =
the ``key`` argument, normally engine id + dp rank + tp rank), its registered
memory (block-aligned chunks below 2 GiB), the remote engines it imported,
the sessions it opened and a completion thread.

``mori`` is imported only when this class is constructed; if it cannot be
used, construction raises :class:`BackendUnavailable` with one line saying
what is missing (see :mod:`atom_kv.transfer.moriio.probe`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from atom_kv import wire
from atom_kv.config import KVTransferConfig
from atom_kv.ports import RankPorts
from atom_kv.transfer._lifecycle import Lifecycle
from atom_kv.transfer._rdma import RdmaPeers, teardown
from atom_kv.transfer.memory import HOST, MemoryKind
from atom_kv.transfer.base import (
    MAX_REGION_BYTES,
    BackendUnavailable,
    ReadHandle,
    ReadOp,
    TransferBackend,
    TransferError,
    chunk_sizes,
    failure_of,
)
from atom_kv.transfer.moriio.completion import CompletionTracker, Pending
from atom_kv.transfer._errors import UnknownPeer
from atom_kv.transfer.moriio.plan import SessionCache, build_rdma_config, plan_reads
from atom_kv.transfer.moriio.probe import (
    DEFAULT_SYSFS_INFINIBAND,
    UNAVAILABLE_PREFIX,
    ImportFn,
    load_mori,
    resolve,
)

__all__ = ["MoriIOBackend"]

logger = logging.getLogger(__name__)


@dataclass
class _Region:
    desc: Any  # mori MemoryDesc
    packed: bytes
    size: int


@dataclass
class _Peer:
    key: str
    engine_packed: bytes
    engine_desc: Any  # mori EngineDesc
    memories: list[Any]  # mori MemoryDesc per remote region id
    sizes: list[int]


class MoriIOBackend(RdmaPeers[_Peer], TransferBackend):
    """A MORI-IO endpoint: owns the ``IOEngine``, registered regions, imported
    peers, cached sessions and the completion thread of one TP rank.

    The ``IOEngine`` listens on ``host``, the address it also advertises
    (``IOEngineConfig`` has one address), on the plan's ``moriio`` port
    (``moriio_port``; 0: the OS picks); ``bind_host`` is accepted for the
    common backend signature."""

    name = "moriio"
    label = "MORI-IO"
    memory_kinds = frozenset({"host", "gpu"})
    accepts_op_arrays = True
    #: where RDMA devices are listed; override for hosts that mount sysfs elsewhere
    sysfs_dir: str = DEFAULT_SYSFS_INFINIBAND

    def __init__(
        self,
        config: Optional[KVTransferConfig] = None,
        *,
        host: str = "127.0.0.1",
        bind_host: Optional[str] = None,
        key: Optional[str] = None,
        import_fn: Optional[ImportFn] = None,
        sysfs_dir: Optional[str] = None,
        environ: Optional[Mapping[str, str]] = None,
        max_region_bytes: int = MAX_REGION_BYTES,
        ports: Optional[RankPorts] = None,
    ) -> None:
        self.config = config if config is not None else KVTransferConfig(kv_role="kv_consumer")
        self.transport = self.config.moriio.transport
        self.host = host
        self.key = key or f"atom_kv-{host}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.max_region_bytes = max_region_bytes
        self._import_fn = import_fn
        self._environ = environ
        mori = load_mori(
            import_fn,
            transport=self.transport,
            sysfs_dir=sysfs_dir or self.sysfs_dir,
            environ=environ,
        )
        self._mori = mori
        self._BackendType = resolve(mori, "BackendType", import_fn)
        self._MemoryLocationType = resolve(mori, "MemoryLocationType", import_fn)
        self._EngineDesc = resolve(mori, "EngineDesc", import_fn)
        self._MemoryDesc = resolve(mori, "MemoryDesc", import_fn)
        try:
            port = ports.port("moriio") if ports is not None else 0
            io_config = resolve(mori, "IOEngineConfig", import_fn)(host=host, port=port)
            self._engine = resolve(mori, "IOEngine", import_fn)(self.key, io_config)
            self._create_transport()
        except (BackendUnavailable, TransferError):
            raise
        except Exception as exc:  # the native library refused: no GPU, no NIC, port in use...
            logger.debug("MORI-IO engine start failed", exc_info=True)
            busy = ports.in_use("moriio", host, exc) if ports is not None else None
            if busy is not None:
                raise busy from None
            text = " ".join(str(exc).split())
            raise BackendUnavailable(
                f"{UNAVAILABLE_PREFIX}could not start the {self.transport} IOEngine on {host}: "
                f"{type(exc).__name__}: {text}"
            ) from None
        self._lock = threading.RLock()
        self._life = Lifecycle("moriio", self._lock, closed_error="MORI-IO backend is closed")
        self._regions: list[_Region] = []
        self._peers: dict[str, _Peer] = {}
        self._sessions = SessionCache()
        self._read_ids = itertools.count(1)
        self._tracker = CompletionTracker(f"atomkv-moriio-completion-{self.key}")
        logger.info("MORI-IO engine %s up on %s (transport %s)", self.key, host, self.transport)

    # -- setup -------------------------------------------------------------------
    def _create_transport(self) -> None:
        if self.transport == "xgmi":
            xgmi_cls = getattr(self._mori, "XgmiBackendConfig", None)
            cfg = xgmi_cls() if xgmi_cls is not None else None
            self._engine.create_backend(self._BackendType.XGMI, cfg)
            return
        rdma_cls = resolve(self._mori, "RdmaBackendConfig", self._import_fn)
        poll_mode = resolve(self._mori, "PollCqMode", self._import_fn)
        rdma_config, skipped = build_rdma_config(rdma_cls, poll_mode, self.config, self._environ)
        if skipped:
            logger.warning(
                "this mori version's RdmaBackendConfig has no %s; keeping the library default",
                ", ".join(skipped),
            )
        self._engine.create_backend(self._BackendType.RDMA, rdma_config)

    # -- memory ------------------------------------------------------------------
    def register_memory(self, ptr: int, size: int, *, align: int = 1, memory: MemoryKind = HOST) -> list[int]:
        """Register ``size`` bytes at ``ptr`` as chunks below the region limit,
        on the device ``memory`` names (the tensor's own GPU, or host memory:
        never torch's current device)."""
        self.check_memory(memory)
        device = memory.device if memory.is_gpu else -1
        location = self._MemoryLocationType.GPU if device >= 0 else self._MemoryLocationType.CPU
        ids: list[int] = []
        with self._lock:
            self._life.check_open()
            offset = 0
            for n in chunk_sizes(size, align, self.max_region_bytes):
                try:
                    desc = self._engine.register_memory(ptr + offset, n, device, location)
                except Exception as exc:
                    raise TransferError(
                        f"MORI-IO could not register {n} bytes at {ptr + offset:#x} (device {device}): {exc}"
                    ) from exc
                self._regions.append(_Region(desc=desc, packed=bytes(desc.pack()), size=n))
                ids.append(len(self._regions) - 1)
                offset += n
        logger.info("MORI-IO %s registered %d bytes as regions %s", self.key, size, ids)
        return ids

    @property
    def region_sizes(self) -> list[int]:
        with self._lock:
            return [r.size for r in self._regions]

    # -- peers ---------------------------------------------------------------------
    def export_descriptor(self) -> bytes:
        with self._lock:
            self._life.check_open()
            msg = wire.MoriIODescriptor(
                key=self.key,
                engine=bytes(self._engine.get_engine_desc().pack()),
                transport=self.transport,
                memories=[r.packed for r in self._regions],
                sizes=[r.size for r in self._regions],
            )
        return wire.encode(msg)

    def add_peer(self, descriptor: bytes) -> str:
        try:
            msg = wire.decode(descriptor, wire.MoriIODescriptor)
        except wire.WireError as exc:
            raise TransferError(f"not a MORI-IO peer descriptor: {exc}") from None
        if msg.transport != self.transport:
            raise TransferError(
                f"peer {msg.key} uses MORI-IO transport {msg.transport!r} but this engine uses "
                f"{self.transport!r}; set the same `moriio.transport` on both sides"
            )
        if len(msg.memories) != len(msg.sizes):
            raise TransferError(f"MORI-IO descriptor of {msg.key} lists {len(msg.memories)} regions but {len(msg.sizes)} sizes")
        try:
            memories = [self._MemoryDesc.unpack(m) for m in msg.memories]
            engine_desc = self._EngineDesc.unpack(msg.engine)
        except Exception as exc:
            raise TransferError(f"MORI-IO descriptor of {msg.key} does not unpack: {exc}") from None
        with self._lock:
            self._life.check_open()
            old = self._peers.get(msg.key)
            if old is not None and old.engine_packed == msg.engine:
                # same engine, maybe more regions registered since: refresh them
                old.memories, old.sizes = memories, list(msg.sizes)
                return msg.key
            if old is not None:
                self._forget(old.key, old, "peer restarted with a new engine")
            try:
                self._engine.register_remote_engine(engine_desc)
            except Exception as exc:
                raise TransferError(f"MORI-IO could not register remote engine {msg.key}: {exc}") from exc
            self._peers[msg.key] = _Peer(msg.key, bytes(msg.engine), engine_desc, memories, list(msg.sizes))
        logger.info("MORI-IO %s added peer %s (%d regions)", self.key, msg.key, len(memories))
        return msg.key

    def _release_peer(self, peer: _Peer) -> None:
        self._sessions.drop_peer(peer.key)
        self._deregister_remote(peer)

    def _deregister_remote(self, peer: _Peer) -> None:
        try:
            self._engine.deregister_remote_engine(peer.engine_desc)
        except Exception:
            logger.warning("MORI-IO could not deregister remote engine %s", peer.key, exc_info=True)

    @property
    def session_keys(self) -> list[tuple[Any, int, int]]:
        """(peer, local region, remote region) of every open session."""
        return self._sessions.keys()

    # -- reads -------------------------------------------------------------------
    def read(self, peer_id: str, ops: Sequence[ReadOp] | Any, *, timeout_s: float) -> ReadHandle:
        """Start reading; ``ops`` may also be an (n, 5) int array in ReadOp column order."""
        read_id = next(self._read_ids)
        handle = ReadHandle()
        try:
            pending = self._issue(peer_id, ops, handle, timeout_s)
        except TransferError as exc:
            logger.warning("MORI-IO read %d from peer %s rejected: %s", read_id, peer_id, exc)
            handle._finish(str(exc), failure_of(exc))
            return handle
        if pending is not None:
            logger.debug(
                "MORI-IO read %d from peer %s: %d bytes in %d ranges, %d sessions",
                read_id, peer_id, handle.nbytes, handle.num_ranges, len(pending.entries),
            )
            self._tracker.add(pending)
        return handle

    def _issue(self, peer_id: str, ops: Any, handle: ReadHandle, timeout_s: float) -> Optional[Pending]:
        with self._lock:
            self._life.check_open()
            peer = self._peers.get(peer_id)
            if peer is None:
                raise UnknownPeer(f"unknown MORI-IO peer {peer_id!r} (add_peer it first)")
            batches = plan_reads(ops, [r.size for r in self._regions], peer.sizes, peer_id)
            handle.num_ranges = sum(len(b.sizes) for b in batches)
            handle.nbytes = sum(b.nbytes for b in batches)
            if not batches:
                handle._finish(None)
                return None
            pending = Pending(handle, peer_id, timeout_s, time.monotonic() + timeout_s)
            handle._track_io()  # from here the NIC may write; the tracker settles it
            for batch in batches:
                try:
                    status = self._start_batch(peer, batch)
                except TransferError as exc:
                    # fail the handle first, then hand the batches already
                    # issued to the tracker so their statuses outlive the read
                    handle._finish(str(exc), failure_of(exc))
                    if pending.entries:
                        self._tracker.add(pending)
                    else:
                        handle._settle()  # nothing was issued
                    raise
                pending.entries.append((status, batch))
            return pending

    def _start_batch(self, peer: _Peer, batch: Any) -> Any:
        local = self._regions[batch.local_region].desc
        remote = peer.memories[batch.remote_region]
        try:
            session = self._sessions.get(
                peer.key, batch.local_region, batch.remote_region,
                lambda: self._engine.create_session(local, remote),
            )
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(
                f"MORI-IO could not create a session from local region {batch.local_region} "
                f"to remote region {batch.remote_region} of peer {peer.key}: {exc}"
            ) from exc
        try:
            uid = session.allocate_transfer_uid()
            return session.batch_read(batch.local_offsets, batch.remote_offsets, batch.sizes, uid)
        except Exception as exc:
            raise TransferError(f"MORI-IO batch_read from peer {peer.key} failed to start: {exc}") from exc

    # -- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if not self._life.mark_closed():
                return
            peers = list(self._peers.values())
            regions = list(self._regions)
            self._peers.clear()
            self._regions.clear()
        teardown(self._tracker, "MORI-IO backend closed", self._sessions.clear,
                 *(functools.partial(self._deregister_remote, peer) for peer in peers),
                 *(functools.partial(self._engine.deregister_memory, region.desc) for region in regions))
        logger.info("MORI-IO engine %s closed", self.key)
