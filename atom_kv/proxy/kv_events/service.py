"""One proxy's KV event ingestion, as one object: the index, its counters, the subscriber thread.

:class:`KvEvents` is what the rest of the proxy holds. :meth:`KvEvents.watch` is called with what an
instance announces (its registration ping, or its static spec), as often as it likes: the same
announcement again changes nothing, a changed engine id resets the instance (a restart seen by health),
changed endpoints follow the new ones. :meth:`KvEvents.forget` when an instance leaves. The subscriber
thread starts with the first instance watched and stops on :meth:`KvEvents.close`; queries
(:meth:`KvEvents.longest_prefix`) and predictions (:meth:`KvEvents.record`) run on the caller's thread
and never wait for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence, Union

from atom_kv.proxy.kv_events.index import KvIndex, PromptKeys, Worker
from atom_kv.proxy.kv_events.stats import KvEventsCollector, KvEventStats
from atom_kv.proxy.kv_events.subscriber import FeedSpec, KvEventSubscriber, SubscriberLimits

__all__ = ["KvEvents", "KvEventsConfig"]


@dataclass(frozen=True)
class KvEventsConfig:
    """The knobs (the proxy's ``--kv-*`` flags): socket bounds, replay wait, memory caps, prediction TTL."""

    hwm: int = 1000
    max_message_bytes: int = 4 << 20
    replay_timeout_s: float = 2.0
    max_blocks: int = 1 << 21
    max_blocks_per_worker: int = 1 << 18
    predict_ttl_s: float = 5.0
    predict_max_blocks: int = 1 << 16
    close_timeout_s: float = 5.0
    log_interval_s: float = 10.0


@dataclass(frozen=True)
class _Watched:
    spec: FeedSpec
    engine_id: Optional[str]


class KvEvents:
    """Owns the :class:`KvIndex`, its :class:`KvEventStats` and (once started) the subscriber; loop-side
    bookkeeping of what each instance announced, so repeated announcements cost a comparison."""

    def __init__(self, config: KvEventsConfig = KvEventsConfig()) -> None:
        self.config = config
        self.stats = KvEventStats()
        self.index = KvIndex(max_blocks=config.max_blocks, max_blocks_per_worker=config.max_blocks_per_worker,
                             predict_ttl_s=config.predict_ttl_s, predict_max_blocks=config.predict_max_blocks,
                             stats=self.stats)
        self._watched: dict[Hashable, _Watched] = {}
        self._subscriber: Optional[KvEventSubscriber] = None
        self._closed = False

    def collector(self) -> KvEventsCollector:
        """The ``/metrics`` collector of this ingestion (register it in the proxy's registry)."""
        return KvEventsCollector(self.stats, self.index)

    @property
    def subscriber(self) -> Optional[KvEventSubscriber]:
        return self._subscriber

    def watch(self, instance: Hashable, endpoint: str, replay_endpoint: Optional[str] = None, *, dp_size: int = 1,
              engine_id: Optional[str] = None) -> None:
        """Follow ``instance``'s publishers (``endpoint`` and ``replay_endpoint`` of DP rank 0, checked
        ``tcp://HOST:PORT``; rank N at port + N)."""
        if self._closed:
            return
        spec = FeedSpec(instance, endpoint, replay_endpoint, dp_size)
        known = self._watched.get(instance)
        self._watched[instance] = _Watched(spec, engine_id)
        if known is not None and known.spec == spec:
            if engine_id is not None and known.engine_id is not None and engine_id != known.engine_id:
                self.reset(instance)
            return
        self._started().follow(spec)

    def forget(self, instance: Hashable) -> None:
        """``instance`` left: its feeds close, its entries and predictions go."""
        if self._watched.pop(instance, None) is None:
            return  # never followed (its predictions, if any, expire with their TTL)
        self.index.forget_predictions(instance)
        if self._subscriber is not None:
            self._subscriber.forget(instance)

    def reset(self, instance: Hashable) -> None:
        """``instance`` restarted (e.g. its engine id changed): its entries and predictions go, its feeds start
        afresh."""
        self.index.forget_predictions(instance)
        if self._subscriber is not None:
            self._subscriber.reset(instance)

    def longest_prefix(self, prompt: Union[PromptKeys, Sequence[int]]) -> dict[Worker, int]:
        return self.index.longest_prefix(prompt)

    def record(self, instance: Hashable, dp_rank: int, prompt: Union[PromptKeys, Sequence[int]]) -> None:
        self.index.record(instance, dp_rank, prompt)

    def close(self) -> None:
        """Stop the subscriber (once)."""
        self._closed = True
        subscriber, self._subscriber = self._subscriber, None
        if subscriber is not None:
            subscriber.close()

    def _started(self) -> KvEventSubscriber:
        if self._subscriber is None:
            c = self.config
            self._subscriber = KvEventSubscriber(
                self.index, SubscriberLimits(max_message_bytes=c.max_message_bytes, hwm=c.hwm,
                                             replay_timeout_s=c.replay_timeout_s, max_pending=c.hwm,
                                             close_timeout_s=c.close_timeout_s),
                log_interval_s=c.log_interval_s)
        return self._subscriber
