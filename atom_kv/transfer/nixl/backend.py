"""The ``nixl`` transfer backend: one-sided reads through NVIDIA's NIXL (UCX:
RDMA over InfiniBand/RoCE, GPUDirect, ``cuda_ipc``, shared memory, TCP).

One :class:`NixlBackend` per TP rank owns one NIXL agent (see
:mod:`atom_kv.transfer.nixl.agent`), its registered memory (host memory as
NIXL ``DRAM``, GPU memory as ``VRAM`` on the tensor's own device), the remote
agents it imported, their prepared descriptor lists and a completion thread.

No NIXL side channel is used: the agent runs without its listener thread and
without etcd. Its metadata travels in :meth:`export_descriptor`, which the
connector sends inside its own handshake reply (sealed by the HMAC proof when
an ``auth_token`` is set); :meth:`add_peer` loads the peer's metadata from it.

A read is merged, bounds-checked against the peer's descriptor on this side
(the NIC enforces the rest), and issued as one NIXL transfer: indices into
descriptor lists prepared once per peer when the ranges lie on the block grid,
explicit descriptor rows otherwise. NIXL is imported when the backend is
constructed; where it is missing, construction raises
:class:`BackendUnavailable` saying how to install it.
"""

from __future__ import annotations

import functools
import ipaddress
import itertools
import logging
import math
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Optional, Sequence

import numpy as np

from atom_kv import wire
from atom_kv.ports import RankPorts
from atom_kv.config import KVTransferConfig
from atom_kv.transfer._rdma import RdmaPeers, teardown
from atom_kv.transfer._regions import begin_read, resolve_config
from atom_kv.transfer.base import (
    BackendUnavailable, OutOfBounds, ReadFailure, ReadHandle, ReadOp, ReadRefusal, TransferBackend, TransferError,
    chunk_sizes,
)
from atom_kv.transfer.memory import HOST, MemoryKind
from atom_kv.transfer.nixl.transports import TransportReport, enable_proto_info
from atom_kv.transfer.nixl.agent import LOCAL_SIDE, NixlAgent, nixl_error
from atom_kv.transfer.nixl.completion import Pending, XferTracker
from atom_kv.transfer.nixl.plan import Regions, Transfer, UnitLayout, check_remote, plan_read, segment_of
from atom_kv.transfer.nixl.probe import load_nixl

__all__ = ["NixlBackend"]

logger = logging.getLogger(__name__)


@dataclass
class _Peer:
    """An imported remote agent: its regions and, per unit, its prepared lists."""

    agent: str
    metadata: bytes
    regions: Regions
    unit: int
    layout: Optional[UnitLayout] = None
    dlists: dict[str, Any] = field(default_factory=dict)  # remote segment -> prepared list


@dataclass
class _Local:
    """This side's prepared lists for one unit (dropped when memory is added)."""

    layout: UnitLayout
    dlists: dict[str, Any]  # local segment -> prepared list


class NixlBackend(RdmaPeers[_Peer], TransferBackend):
    """A NIXL endpoint: owns the agent, registered regions, imported peers,
    their prepared descriptor lists and the completion thread of one TP rank.

    The agent opens no listener of its own; UCX's TCP transport listens on
    the interfaces UCX uses (``UCX_NET_DEVICES``), on ports from
    ``UCX_TCP_PORT_RANGE`` (set from ``nixl_ucx_tcp_port_range``, the plan's
    ``ucx`` listener; else the OS picks). When ``bind_host`` (else ``host``)
    is a loopback address and ``UCX_NET_DEVICES`` is unset, it is set to
    ``lo``, so a loopback engine listens on loopback only."""

    name = "nixl"
    label = "NIXL"
    memory_kinds = frozenset({"host", "gpu"})
    accepts_op_arrays = True

    def __init__(
        self,
        config: Optional[KVTransferConfig] = None,
        *,
        host: str = "127.0.0.1",
        bind_host: Optional[str] = None,
        key: Optional[str] = None,
        api: Optional[ModuleType] = None,
        ports: Optional[RankPorts] = None,
    ) -> None:
        self.config = resolve_config(config)
        self.host = host
        self.key = key or f"atom_kv-{host}-{os.getpid()}"
        nixl = api if api is not None else load_nixl()
        agent_name = f"{self.key}-{uuid.uuid4().hex[:12]}"
        # before UCX is loaded: it reads UCX_PROTO_INFO and UCX_LOG_FILE once per process
        proto_log = enable_proto_info() if self.config.nixl.ucx_proto_info else None
        try:
            self._agent = NixlAgent(nixl, agent_name, plugins=list(self.config.nixl.plugins),
                                    progress_threads=self.config.nixl.progress_threads,
                                    ucx_tls=self.config.nixl.ucx_tls,
                                    ucx_tcp_ports=_ucx_port_range(self.config, ports),
                                    loopback_only=_is_loopback(bind_host or host))
        except TransferError as exc:
            raise BackendUnavailable(f"transfer backend 'nixl' is unavailable: {exc}") from None
        except Exception as exc:  # the native library refused (no usable transport, ...)
            logger.debug("NIXL agent start failed", exc_info=True)
            raise BackendUnavailable(f"transfer backend 'nixl' is unavailable: the NIXL agent did not start: "
                                     f"{nixl_error(exc)}{ucx_hint(self.config.nixl.plugins)}") from None
        self._lock = threading.RLock()
        self._closed = False
        self._regions = Regions()
        self._local: dict[int, _Local] = {}
        self._peers: dict[str, _Peer] = {}
        self._reads = itertools.count(1)
        self._counts: dict[str, int] = {}
        self._transports = TransportReport(agent_name, proto_log)
        self._first_read: Optional[ReadHandle] = None  # the report is logged once it finished
        try:
            self._tracker = XferTracker(f"atomkv-nixl-completion-{self.key}", self._agent)
        except BaseException:  # no thread to stop: release the agent in NIXL's order before the error goes on
            self._agent.teardown()
            raise
        # closes the agent even when the owner never calls close(): at garbage
        # collection, or at interpreter exit before modules are torn down
        self._finalizer = weakref.finalize(self, teardown, self._tracker, "NIXL backend closed", self._agent.teardown)
        logger.info("NIXL agent %s up (plugins %s; UCX_TLS=%s, UCX_NET_DEVICES=%s)", agent_name,
                    ", ".join(self._agent.plugins), os.environ.get("UCX_TLS", "unset"),
                    os.environ.get("UCX_NET_DEVICES", "unset"))

    # -- memory -----------------------------------------------------------------------
    def register_memory(self, ptr: int, size: int, *, align: int = 1, memory: MemoryKind = HOST) -> list[int]:
        self.check_memory(memory)
        if not isinstance(ptr, int) or ptr <= 0:
            raise ValueError(f"register_memory: ptr must be a positive address, got {ptr!r}")
        sizes = chunk_sizes(size, align, self.max_region_bytes)
        addrs = list(itertools.accumulate([ptr] + sizes[:-1]))
        device = memory.device if memory.is_gpu else -1
        rows = np.array([[a, n, max(device, 0)] for a, n in zip(addrs, sizes)], dtype=np.uint64)
        with self._lock:
            self._check_open()
            try:
                self._agent.register(rows, segment_of(device))
            except Exception as exc:
                raise TransferError(f"NIXL could not register {size} bytes of {memory.label} memory: "
                                    f"{nixl_error(exc)}") from None
            first = len(self._regions)
            self._regions.add(addrs, sizes, device, align)
            self._drop_local_lists()  # their layout no longer covers every region
        logger.debug("NIXL %s registered %d bytes of %s memory as %d regions", self.key, size, memory.label, len(sizes))
        return list(range(first, first + len(sizes)))

    def region_sizes(self) -> list[int]:
        with self._lock:
            return [int(s) for s in self._regions.sizes]

    # -- peers ------------------------------------------------------------------------
    def export_descriptor(self) -> bytes:
        with self._lock:
            self._check_open()
            msg = wire.NixlDescriptor(
                agent=self._agent.name, metadata=self._agent.metadata(), plugins=list(self._agent.plugins),
                addrs=self._regions.addrs.tolist(), sizes=self._regions.sizes.tolist(),
                devices=self._regions.devices.tolist(), align=max(self._regions.align, 1),
            )
        return wire.encode(msg)

    def add_peer(self, descriptor: bytes) -> str:
        try:
            msg = wire.decode(descriptor, wire.NixlDescriptor)
        except wire.WireError as exc:
            raise TransferError(f"not a NIXL peer descriptor: {exc}") from None
        if msg.align < 1:
            raise TransferError(f"NIXL descriptor of {msg.agent}: align must be >= 1, got {msg.align}")
        shared = [p for p in msg.plugins if p in self._agent.plugins]
        if not shared:
            raise TransferError(f"NIXL peer {msg.agent} runs plugins {msg.plugins} and this engine "
                                f"{self._agent.plugins}; set a common `nixl.plugins` on both sides")
        regions = Regions.of(msg.addrs, msg.sizes, msg.devices, msg.align)
        with self._lock:
            self._check_open()
            old = self._peers.get(msg.agent)
            if old is not None and old.metadata == msg.metadata:
                if np.array_equal(old.regions.sizes, regions.sizes) and np.array_equal(old.regions.addrs, regions.addrs):
                    return old.agent
            if old is not None:
                self._forget(old.agent, old, "the peer re-sent a different descriptor")
            try:
                name = self._agent.add_remote(msg.metadata)
            except Exception as exc:
                raise TransferError(f"NIXL could not load the metadata of peer {msg.agent}: {nixl_error(exc)}") from None
            if name != msg.agent:
                self._agent.remove_remote(name)
                raise TransferError(f"NIXL peer descriptor names agent {msg.agent} but its metadata is agent {name}")
            peer = _Peer(name, bytes(msg.metadata), regions, math.gcd(max(self._regions.align, 1), msg.align))
            self._peers[name] = peer
        logger.info("NIXL %s added peer %s (%d regions)", self.key, name, len(regions))
        return name

    def _release_peer(self, peer: _Peer) -> None:
        for handle in peer.dlists.values():
            self._agent.release_dlist(handle)
        peer.dlists.clear()
        try:
            self._agent.remove_remote(peer.agent)
        except Exception as exc:
            logger.warning("NIXL could not remove remote agent %s: %s", peer.agent, nixl_error(exc))

    # -- reads ------------------------------------------------------------------------
    def read(self, peer_id: str, ops: Sequence[ReadOp] | Any, *, timeout_s: float) -> ReadHandle:
        """Start reading; ``ops`` may also be an (n, 5) int array in ReadOp column order."""
        if not self._transports.done:
            self._report_transports()
        with self._lock:
            peer = self._peers.get(peer_id)
            refusal = (ReadRefusal(ReadFailure.CLOSED, "backend is closed") if self._closed
                       else None if peer is not None else ReadRefusal(ReadFailure.UNKNOWN_PEER, f"unknown peer {peer_id!r}"))
            handle, table = begin_read("NIXL read", ops, self._regions.sizes, refusal=refusal)
            if table is None:
                return handle
            assert peer is not None
            try:
                check_remote(table, peer.regions, peer.agent)
                transfers = plan_read(table, self._regions, peer.regions, *self._layouts(peer))
                pending = self._start(peer, transfers, handle, timeout_s)
            except TransferError as exc:
                outside = isinstance(exc, OutOfBounds)
                handle._finish(str(exc), ReadFailure.OUT_OF_BOUNDS if outside else ReadFailure.TRANSPORT)
                self._count("refused" if outside else "start_failed")
                logger.warning("NIXL read %d from peer %s: %s", next(self._reads), peer_id, exc)
                return handle
        self._tracker.add(pending)
        if self._first_read is None:
            self._first_read = handle
        return handle

    def _report_transports(self) -> None:
        """Log UCX's transports once the first read finished well (``nixl.ucx_proto_info``)."""
        first = self._first_read
        if first is not None and first.done():
            if first.error is None:
                self._transports.log()
            else:
                self._first_read = None  # the next read's choices, then

    def _layouts(self, peer: _Peer) -> tuple[Optional[UnitLayout], Optional[UnitLayout]]:
        """Both sides' unit layouts for ``peer`` (built on first use)."""
        local = self._local.get(peer.unit)
        if local is None:
            layout = UnitLayout.build(self._regions, peer.unit)
            if layout is None:
                return None, None
            local = _Local(layout, {})
            self._local[peer.unit] = local
        if peer.layout is None:
            peer.layout = UnitLayout.build(peer.regions, peer.unit)
        return local.layout, peer.layout

    def _start(self, peer: _Peer, transfers: list[Transfer], handle: ReadHandle, timeout_s: float) -> Pending:
        """The read's :class:`Pending`, its transfers to be made and posted by
        the tracker's thread (prepared lists are made here, once per peer)."""
        pending = Pending(handle, peer.agent, timeout_s, time.monotonic() + timeout_s)
        for t in transfers:
            try:
                if t.local_idx is not None and t.remote_idx is not None:
                    launch = functools.partial(self._agent.start_prepped, self._local_dlist(peer.unit, t.local_seg),
                                               t.local_idx, self._peer_dlist(peer, t.remote_seg), t.remote_idx)
                else:
                    assert t.local_rows is not None and t.remote_rows is not None  # plan_read fills one of the pairs
                    launch = functools.partial(self._agent.start_rows, t.local_rows, t.local_seg, t.remote_rows,
                                               t.remote_seg, peer.agent)
            except Exception as exc:
                raise TransferError(f"NIXL could not prepare descriptor lists for peer {peer.agent}: "
                                    f"{nixl_error(exc)}") from None
            pending.launches.append(launch)
            self._count("prepped_transfers" if t.prepped else "transfers")
        handle._track_io()  # from here NIXL may write; the tracker settles it
        return pending

    def _local_dlist(self, unit: int, seg: str) -> Any:
        local = self._local[unit]
        handle = local.dlists.get(seg)
        if handle is None:
            handle = local.dlists[seg] = self._agent.prep(LOCAL_SIDE, local.layout.rows[seg], seg)
        return handle

    def _peer_dlist(self, peer: _Peer, seg: str) -> Any:
        handle = peer.dlists.get(seg)
        if handle is None:
            assert peer.layout is not None
            handle = peer.dlists[seg] = self._agent.prep(peer.agent, peer.layout.rows[seg], seg)
        return handle

    def _drop_local_lists(self) -> None:
        # a read already planned may still launch from the old lists: they
        # stay with the agent (released at close), only the cache forgets them
        self._local.clear()

    def native_agent(self) -> tuple[Any, threading.Lock]:
        """NIXL's own ``nixl_agent`` and the lock every call into it must hold:
        for side-by-side benchmarks of raw NIXL on the same registered memory."""
        return self._agent.native, self._agent.lock

    # -- lifecycle ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("nixl: backend is closed")

    def _count(self, reason: str) -> None:
        self._counts[reason] = self._counts.get(reason, 0) + 1

    def stats(self) -> dict[str, int]:
        """NIXL transfers issued (``prepped_transfers`` from prepared lists,
        ``transfers`` from explicit rows) and reads refused (``refused``:
        outside the peer's regions; ``start_failed``)."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        if not self._transports.done:
            self._report_transports()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._peers.clear()
            self._local.clear()
        self._finalizer()
        logger.info("NIXL agent of %s closed", self.key)


def ucx_hint(plugins: Any) -> str:
    """What to look at when a UCX plugin could not start: the two variables that decide which devices and
    transports UCX may use, with their values here (a device this host lacks, e.g. an RDMA port on an
    Ethernet host, leaves UCX no transport)."""
    if "UCX" not in plugins:
        return ""
    values = ", ".join(f"{name}={os.environ[name]!r}" if name in os.environ else f"{name} unset"
                       for name in ("UCX_NET_DEVICES", "UCX_TLS"))
    return (f"; where UCX finds no device or transport it can use, look at UCX_NET_DEVICES (this host's devices: "
            f"`ibv_devices` for RDMA ports, `ip -br link` for interfaces, or `ucx_info -d`) and UCX_TLS ({values}; "
            f"docs/nixl.md, 'Choosing UCX_NET_DEVICES')")


def _ucx_port_range(config: KVTransferConfig, ports: Optional[RankPorts]) -> Optional[str]:
    """``UCX_TCP_PORT_RANGE`` for this rank: the plan's ``ucx`` range, else the config's key."""
    planned = ports.port_range("ucx") if ports is not None else None
    if planned is not None:
        return f"{planned[0]}-{planned[1]}"
    return config.nixl_ucx_tcp_port_range


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
