"""Worker-side connector, one per TP rank: what both roles share.

A rank's worker is a :class:`~atom_kv.connector.producer.ProducerWorker`
(prefill: serves handshakes, counts done-reading notices, confirms reads) or
a :class:`~atom_kv.connector.consumer.ConsumerWorker` (decode: handshakes,
reads, notifies); :func:`atom_kv.connector.create_worker` picks the class
for the ``kv_role``. Both report through :meth:`ConnectorWorker.get_finished`.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from typing import Callable, ClassVar, Optional, Sequence

import zmq

from atom_kv.addresses import check_listeners_secured, kv_addresses
from atom_kv.config import KVTransferConfig
from atom_kv.connector.base import KVCacheLayer, WorkerHooks
from atom_kv.connector.kv_caches import RegisteredKV, describe_kv_caches, register_kv_tensors
from atom_kv.connector.layout import head_range
from atom_kv.connector.pipeline import stage_layers
from atom_kv.connector.routes_view import RouteReport, RouteView
from atom_kv.connector.stats import TransferStats
from atom_kv.connector.types import KVConnectorOutput
from atom_kv.ports import RankPorts, rank_ports
from atom_kv.transfer import TransferBackend, create_backend
from atom_kv.transfer.fault_injector import with_injected_faults
from atom_kv.wire import CompatInfo, prepare_decoders

__all__ = ["ConnectorWorker"]

logger = logging.getLogger(__name__)


class ConnectorWorker(WorkerHooks):
    """What every worker owns: the rank's identity, transfer backend,
    registered KV caches, ZeroMQ context, stats, the finished sets of the
    current step, and the close sequence. Subclasses add one role."""

    #: the ``kv_role`` a subclass serves
    role: ClassVar[str] = ""

    def __init__(
        self,
        config: KVTransferConfig,
        *,
        engine_id: str,
        host: str,
        tp_rank: int,
        tp_size: int,
        dp_rank: int = 0,
        dp_size: Optional[int] = None,
        pp_rank: int = 0,
        pp_size: int = 1,
        start_layer: int = 0,
        compat: CompatInfo,
        backend: Optional[TransferBackend] = None,
        bind_host: Optional[str] = None,
    ) -> None:
        """``host`` is the address peers dial; the rank's listeners (handshake
        server, the backend's servers) bind ``bind_host``, by default ``host``:
        never every interface unless ``"0.0.0.0"`` is asked for. The config's
        ``advertise_host`` and ``bind_host`` win over both; an unspecified
        address to advertise is refused. Each listener binds its port of the
        plan (:func:`atom_kv.ports.rank_ports`) once the worker starts: the
        constructor opens nothing (:meth:`start`, :meth:`close`)."""
        if config.kv_role != self.role:
            raise ValueError(f"{type(self).__name__} serves kv_role {self.role!r}, the config says {config.kv_role!r}")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is outside tp_size {tp_size}")
        if dp_size is None:  # only later pipeline stages' ports depend on it
            if pp_size > 1:
                raise ValueError("dp_size is needed with pipeline stages (pp_size > 1): it places their ports")
            dp_size = dp_rank + 1
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside dp_size {dp_size}")
        if not 0 <= pp_rank < pp_size:
            raise ValueError(f"pp_rank {pp_rank} is outside pp_size {pp_size}")
        if not compat.is_mla:
            head_range(compat.num_kv_heads, tp_size, tp_rank)  # raises LayoutError when heads don't divide
        self.config = config
        self.engine_id = engine_id
        self.host, self.bind_host = kv_addresses(config, host, bind_host)
        check_listeners_secured(config, self.bind_host)
        #: the ports this rank's listeners bind
        self.ports: RankPorts = rank_ports(config, pp_rank=pp_rank, dp_rank=dp_rank, tp_rank=tp_rank,
                                           pp_size=pp_size, dp_size=dp_size, tp_size=tp_size)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.start_layer = start_layer
        self.compat = compat
        self._name = f"{engine_id}/dp{dp_rank}/tp{tp_rank}"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self.stats_ = TransferStats(f"atom-kv {self._name}")
        self.routes_ = RouteView()  # each producer peer's backend, recorded at its handshake
        self._kv = RegisteredKV()
        # this step's results, handed out by get_finished()
        self._finished_send: list[str] = []
        self._finished_recv: list[str] = []
        self._failed_recv: dict[str, str] = {}
        self._first_tokens: dict[str, list[int]] = {}
        self._reached: list[str] = []
        self._waker: Optional[Callable[[], None]] = None
        # with_injected_faults: a test-only hook, off unless its environment variable is set
        self.backend = backend or with_injected_faults(create_backend(
            config.backend, config, host=self.host, bind_host=self.bind_host,
            key=f"{engine_id}-dp{dp_rank}-tp{tp_rank}", ports=self.ports,
        ))
        self._ctx = zmq.Context()  # its I/O threads start with its first socket, in start()
        self._started = False

    def start(self) -> "ConnectorWorker":
        """Open the role's sockets and start its threads (a prefill rank's handshake port, a decode rank's
        handshake and read pools). Idempotent; :meth:`register_kv_caches` calls it, so an engine that
        registers its caches before the first step need not. Raises what the role raises when a port of
        the plan is taken; the worker is closed then."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: start() after close()")
            if self._started:
                return self
            self._started = True
        prepare_decoders()  # not on the first handshake's path
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    @abc.abstractmethod
    def _start(self) -> None:
        """Start the role's sockets and threads (once, from :meth:`start`)."""

    @abc.abstractmethod
    def _close_role(self) -> None:
        """Stop the role's threads and sockets; call :meth:`_close_backend` at
        the point of the sequence where no role thread issues I/O any more."""

    # ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Sequence[KVCacheLayer]) -> None:
        """Register this rank's caches; a pipeline stage passes only its own layers
        (``start_layer`` onwards), which its handshake then names. Starts the worker first
        (:meth:`start`) when it has not started."""
        self.start()
        layers = None
        if self.pp_size > 1:
            n = len(kv_caches)
            regions = len(describe_kv_caches(kv_caches, self.compat, self.tp_size, layers=range(n)))
            layers = stage_layers(regions, n, self.start_layer, self.compat.num_layers, self.pp_size, self.pp_rank)
        tensors = describe_kv_caches(kv_caches, self.compat, self.tp_size, layers=layers)
        registered = register_kv_tensors(self.backend, tensors)
        with self._lock:
            self._kv = registered
        self._registered(registered.memory)
        logger.info("%s: registered %d KV tensors (%d layers, %s memory) with the %s backend",
                    self._name, len(registered.layouts), self.compat.num_layers, ", ".join(registered.memory),
                    self.backend.name)

    def _registered(self, memory: list[str]) -> None:
        """The KV caches are registered, in ``memory`` ("host", "gpu:N"): tell what the role built."""

    def set_engine_id(self, engine_id: str) -> None:
        """ATOM builds its model runners before the scheduler-side connector
        that names the engine; the name reaches them with the first step's
        metadata. Until then the rank answers handshakes under its provisional
        id, which no consumer can be reading from."""
        with self._lock:
            self.engine_id = engine_id
            self._name = f"{engine_id}/dp{self.dp_rank}/tp{self.tp_rank}"
            self.stats_.name = f"atom-kv {self._name}"
        self._renamed()

    def _renamed(self) -> None:
        """Pass a new :attr:`engine_id` on to what the role built with the old one."""

    def set_waker(self, wake: Optional[Callable[[], None]]) -> None:
        self._waker = wake

    def _wake(self) -> None:
        """Tell the engine that :meth:`get_finished` has news (any thread, after the lock is released)."""
        wake = self._waker
        if wake is None:
            return
        try:
            wake()
        except Exception:  # the engine's waker must never cost a transfer
            logger.exception("%s: waking the engine failed", self._name)

    def get_finished(self) -> KVConnectorOutput:
        with self._lock:
            out = KVConnectorOutput(finished_sending=self._finished_send, finished_recving=self._finished_recv,
                                    failed_recving=self._failed_recv, first_tokens=self._first_tokens,
                                    reached=self._reached)
            self._finished_send, self._finished_recv, self._failed_recv = [], [], {}
            self._first_tokens, self._reached = {}, []
            self._expire_locked(time.monotonic())
        self.stats_.maybe_log()
        return out

    def _expire_locked(self, now: float) -> None:
        """Forget bookkeeping gone stale (called under the lock once a step)."""

    def _fail_load(self, request_id: str, why: str) -> None:
        """Report a load of ``request_id`` as failed in the next :meth:`get_finished`."""
        with self._lock:
            self._failed_recv[request_id] = why
        self._wake()

    def stats(self) -> dict[str, float]:
        return self.stats_.snapshot()

    def routes(self) -> RouteReport:
        return self.routes_.report(self.backend)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._started:
            self._close_role()
        else:  # nothing of the role was opened: only the backend, made by the constructor
            self._close_backend()
        self._ctx.destroy(linger=0)
        logger.info("%s", self.stats_.summary())

    def _close_backend(self) -> None:
        try:
            self.backend.close()
        except Exception as exc:
            logger.warning("%s: closing the transfer backend failed: %s", self._name, exc)
