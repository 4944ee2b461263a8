"""Scheduler-side connector, one class per role behind one factory: which requests need
remote KV, per-step metadata, producer leases (delayed frees) and consumer load timeouts.

- :class:`~atom_kv.connector.scheduler.producer.ProducerScheduler` (``kv_producer``): a
  transfer id per request that asks for a remote decode, a lease on its blocks, freed once.
- :class:`~atom_kv.connector.scheduler.consumer.ConsumerScheduler` (``kv_consumer``):
  matches, loads and their deadlines, and a release to the producer at every end of a load.
- :mod:`~atom_kv.connector.scheduler.common`: what both need (load budgets, the deadline
  heap and :class:`TimerKind`, releases, the :class:`RoleScheduler` base).

All transitions happen on the engine's scheduler thread. Releases go to every rank of a
producer a rank of this engine completed a handshake with, to the first rank only of any
other (:mod:`atom_kv.connector.known_producers`); releases are idempotent.
"""

from __future__ import annotations

from typing import Callable, Optional

from atom_kv.config import KVTransferConfig
from atom_kv.connector.release import ReleaseSpec
from atom_kv.connector.scheduler.common import (
    SCHEDULER_SLACK_S,
    RoleScheduler,
    TimerKind,
    load_backstop_s,
    load_budget_s,
    rendezvous_wait_s,
)
from atom_kv.connector.scheduler.consumer import ConsumerScheduler, LoadState
from atom_kv.connector.scheduler.producer import ProducerScheduler, SendState

__all__ = [
    "SCHEDULER_SLACK_S",
    "ConnectorScheduler",
    "ConsumerScheduler",
    "LoadState",
    "ProducerScheduler",
    "RoleScheduler",
    "SendState",
    "TimerKind",
    "load_backstop_s",
    "load_budget_s",
    "rendezvous_wait_s",
]


def ConnectorScheduler(  # noqa: N802  (named as the class it was: every caller builds the hooks this way)
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
    announce_sends: bool = False,
) -> RoleScheduler:
    """The scheduler side of one engine for ``config.kv_role``: a :class:`ProducerScheduler`
    or a :class:`ConsumerScheduler`.

    A request's ``kv_transfer_params`` enter at ``get_num_new_matched_tokens`` (or
    ``request_rejected``) and are parsed there once into a
    :class:`~atom_kv.connector.params.RequestParams`, which every later step takes.
    ``release_sender(spec, reason)`` replaces the built-in
    :class:`~atom_kv.connector.release.NoticeSender` for releases (started on the first
    one) when given. ``announce_sends`` (producer only; a consumer has nothing to announce):
    see :class:`ProducerScheduler`."""
    if config.is_producer:
        return ProducerScheduler(config, engine_id=engine_id, host=host, tp_size=tp_size, dp_rank=dp_rank,
                                 dp_size=dp_size, pp_size=pp_size, block_size=block_size,
                                 release_sender=release_sender, announce_sends=announce_sends)
    return ConsumerScheduler(config, engine_id=engine_id, host=host, tp_size=tp_size, dp_rank=dp_rank,
                             dp_size=dp_size, pp_size=pp_size, block_size=block_size, release_sender=release_sender)
