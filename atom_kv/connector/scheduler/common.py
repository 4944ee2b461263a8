"""What both roles' scheduler sides share: the load budgets, the deadline heap and its
:class:`TimerKind`, the releases an engine sends, and :class:`RoleScheduler`, their base."""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, ClassVar, Iterator, Optional

from atom_kv._lru import BoundedSet
from atom_kv.addresses import kv_addresses
from atom_kv.config import KVTransferConfig
from atom_kv.connector.base import SchedulerHooks
from atom_kv.connector.known_producers import KnownProducers
from atom_kv.connector.params import ParamsIn, RequestParams
from atom_kv.connector.release import NoticeSender, ReleaseSpec, engine_sender
from atom_kv.connector.types import LoadSpec

__all__ = [
    "MAX_RECENT_TRANSFERS",
    "SCHEDULER_SLACK_S",
    "Deadlines",
    "Releases",
    "RoleScheduler",
    "Timer",
    "TimerKind",
    "load_backstop_s",
    "load_budget_s",
    "rendezvous_wait_s",
]

logger = logging.getLogger(__name__)

#: Extra seconds the scheduler waits past a worker's own load budget (and
#: the time its last failed read may take to settle), so a worker always
#: gives up and stops writing into the blocks before the scheduler tells the
#: engine to free them.
SCHEDULER_SLACK_S = 2.0

#: transfer ids remembered after their lease ended (the workers remember as
#: many), so a request cannot adopt an id whose done-notices are still about;
#: also the releases remembered as sent
MAX_RECENT_TRANSFERS = 65536


def load_budget_s(config: KVTransferConfig) -> float:
    """Longest a worker spends on one load: handshake plus every read attempt and backoff."""
    attempts = config.transfer_retries + 1
    backoff = sum(config.transfer_retry_backoff_ms * (2**i) for i in range(config.transfer_retries)) / 1000.0
    return config.handshake_timeout_s + attempts * config.transfer_timeout_s + backoff


def rendezvous_wait_s(config: KVTransferConfig) -> float:
    """Longest a rendezvous load waits for its block ids: ``prefill_queue_timeout_s`` while the
    producer answers "still coming", at least one ``prefill_wait_timeout_s``."""
    return max(config.prefill_wait_timeout_s, config.prefill_queue_timeout_s)


def load_backstop_s(config: KVTransferConfig) -> float:
    """How long the scheduler waits for a load no rank reported: the workers' budget, plus one
    ``transfer_timeout_s`` for a read failed at its deadline to settle (backends stop writing
    within their I/O timeout), plus one ``handshake_timeout_s`` for the producer's confirmation
    of a finished read, plus slack."""
    return load_budget_s(config) + config.transfer_timeout_s + config.handshake_timeout_s + SCHEDULER_SLACK_S


class TimerKind(Enum):
    """What a deadline guards."""

    #: a producer's lease on lent blocks (``abort_timeout_s``): the blocks are freed when it passes
    LEASE = "lease"
    #: a consumer's load (the workers' budget plus slack): the load fails, or an aborted one's blocks are freed
    LOAD = "load"


@dataclass(order=True)
class Timer:
    deadline: float
    seq: int
    kind: TimerKind = field(compare=False)
    key: str = field(compare=False)


class Deadlines:
    """Owns one role's heap of timers, all of one :class:`TimerKind`. Deletion is lazy: the
    owner of a due timer acts on it only while the record it names still has that deadline."""

    def __init__(self, kind: TimerKind) -> None:
        self.kind = kind
        self._heap: list[Timer] = []
        self._seq = itertools.count()

    def add(self, deadline: float, key: str) -> None:
        heapq.heappush(self._heap, Timer(deadline, next(self._seq), self.kind, key))

    def due(self, now: float) -> Iterator[Timer]:
        """Pop and yield every timer whose deadline is ``now`` or earlier, the earliest first."""
        while self._heap and self._heap[0].deadline <= now:
            yield heapq.heappop(self._heap)

    def pending(self) -> list[Timer]:
        """The timers not yet due (earliest first), for inspection."""
        return sorted(self._heap)

    def clear(self) -> None:
        self._heap.clear()


class Releases:
    """Owns how one engine tells producer ranks it will not read a transfer: each
    (transfer, host, port) once, to every rank of a producer a rank of this engine completed
    a handshake with, else the first rank only (:mod:`atom_kv.connector.known_producers`)."""

    def __init__(self, send: Callable[[ReleaseSpec, str], None]) -> None:
        self._send = send
        self._sent: BoundedSet[tuple[str, str, int]] = BoundedSet(MAX_RECENT_TRANSFERS)
        self._known = KnownProducers()

    def of_params(self, params: RequestParams, reason: str) -> None:
        """Release the transfer ``params`` name, if they name one a release can reach."""
        spec = params.release_spec
        if spec is not None:
            self.send(spec, reason)

    def of_load(self, spec: LoadSpec, reason: str) -> None:
        """Release the transfer a load reads (or would have read)."""
        self.send(ReleaseSpec.from_load(spec), reason)

    def send(self, spec: Optional[ReleaseSpec], reason: str) -> None:
        if spec is None:
            return
        key = (spec.transfer_id, spec.host, spec.handshake_port)
        if not spec.transfer_id or not spec.host or not spec.handshake_port or key in self._sent:
            return
        self._sent.add(key)
        self._send(self._known.reach(spec), reason)

    def answered(self, spec: LoadSpec) -> None:
        """A rank completed a handshake with the producer ``spec`` reads from: releases go to all its ranks."""
        producer = ReleaseSpec.from_load(spec)
        if producer is not None:
            self._known.answered(producer)


class RoleScheduler(SchedulerHooks):
    """The scheduler side of one engine in one role: owns the engine's identity as its
    responses name it, the sender of its signed notices (started on first use, closed by
    :meth:`close`) and its :class:`Releases`.

    ``release_sender(spec, reason)`` replaces the built-in
    :class:`~atom_kv.connector.release.NoticeSender` for releases when given (tests, engines
    that route them themselves). Every hook is called from the engine's scheduler thread only."""

    #: who signs this role's notices (``engine_sender``)
    notice_role: ClassVar[str]
    #: the ``kv_role`` this class serves
    kv_role: ClassVar[str]

    def __init__(
        self,
        config: KVTransferConfig,
        *,
        engine_id: str,
        host: str,
        tp_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        pp_size: int = 1,
        block_size: int,
        release_sender: Optional[Callable[[ReleaseSpec, str], None]] = None,
    ) -> None:
        if config.kv_role != self.kv_role:
            raise ValueError(f"{type(self).__name__} serves kv_role {self.kv_role!r}, got {config.kv_role!r}; "
                             f"build the scheduler side with ConnectorScheduler(config, ...), which picks the role")
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.config = config
        self.engine_id = engine_id
        self.host = kv_addresses(config, host)[0]  # what prefill responses name as `remote_host`
        self.tp_size = tp_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.pp_size = pp_size
        self.block_size = block_size
        self._sender: Optional[NoticeSender] = None
        self._releases = Releases(release_sender if release_sender is not None
                                  else lambda spec, reason: self._notices().release(spec, reason))

    def _notices(self) -> NoticeSender:
        if self._sender is None:
            self._sender = NoticeSender(auth_token=self.config.auth_token,
                                        sender=engine_sender(self.notice_role, self.engine_id),
                                        proof_timeout_s=self.config.handshake_timeout_s,
                                        close_wait_s=self.config.release_close_wait_s)
        return self._sender

    def request_rejected(self, kv_transfer_params: ParamsIn) -> None:
        """The engine dropped a request the connector never saw (see
        :meth:`SchedulerHooks.request_rejected`). Idempotent: a transfer is released at most once
        whatever the number of calls. Side effect: at most one release message per transfer
        (queued on the notice sender's thread, never blocking). Called at most once per
        rejected request, by the engine adapter, on the scheduler thread. Both roles: a
        producer handed a decode leg's params releases the producer they name too."""
        self._releases.of_params(RequestParams.of(kv_transfer_params), "the decode engine rejected the request")

    def num_leases(self) -> int:
        """Producer leases outstanding (0 on a consumer)."""
        return 0

    def num_loads(self) -> int:
        """Consumer loads outstanding (0 on a producer)."""
        return 0

    def _close_sender(self) -> None:
        if self._sender is not None:
            self._sender.close()
