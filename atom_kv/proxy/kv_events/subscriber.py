"""The KV event subscriber: one named thread that follows every engine's publishers and feeds the index.

Per instance and DP rank a ZeroMQ SUB connects to the rank's endpoint (port + rank, as vLLM publishes) and,
where the engine has a replay endpoint, a DEALER asks it for missed batches. Sequence rules (vLLM's):

- a seq below the last one seen: the publisher restarted; its workers are cleared;
- a gap (the first message after a connect included: seq 0 may have gone out before we were there): replay
  from the last seq + 1; without a replay endpoint the workers are cleared (or, never seen, start cold);
- a replay whose first batch is past the one asked for, or that times out (``replay_timeout_s``), or whose
  live batches pile up past ``max_pending`` while it runs: the workers are cleared and follow on cold.

Without a seq (ATOM today) a restart is not visible here: :meth:`KvEventSubscriber.reset` is for whoever
sees the engine id change (the health prober, the registration pings). Every socket is bounded:
``ZMQ_MAXMSGSIZE`` per frame (the peer is disconnected past it) and ``ZMQ_RCVHWM`` messages queued.
Every decode failure is counted and logged, rate-limited, and the message dropped.

The thread owns its sockets; other threads talk to it through a command queue and a wake-up socket pair,
never touching a socket. It blocks in one poll (bounded by ``replay_timeout_s``), never spins.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Hashable, Optional

import zmq

from atom_kv._ratelimit import RateLimitedLog
from atom_kv.proxy.kv_events.endpoints import rank_endpoint
from atom_kv.proxy.kv_events.index import KvIndex
from atom_kv.proxy.kv_events.wire import END_SEQ, DecodedBatch, DecodeFailure, EventDecoder, encode_seq, parse_seq

__all__ = ["FeedSpec", "FeedState", "KvEventSubscriber", "SubscriberLimits"]

logger = logging.getLogger(__name__)

_DRAIN = 256  # messages taken from one socket before the others get a turn
#: the context's socket cap (libzmq's default is 1,023): three per feed (SUB, its monitor, the replay DEALER),
#: so the default stops a proxy at about 340 engines; feeds are bounded by the registry (--max-instances)
MAX_SOCKETS = 65536


@dataclass(frozen=True)
class FeedSpec:
    """What to follow for one instance: rank 0's endpoints (checked ``tcp://HOST:PORT``) and its DP size."""

    instance: Hashable
    endpoint: str
    replay_endpoint: Optional[str] = None
    dp_size: int = 1


@dataclass(frozen=True)
class SubscriberLimits:
    """The subscriber's bounds: frame bytes, queued messages per socket, replay wait, live batches held
    while a replay runs, and how long :meth:`KvEventSubscriber.close` waits for the thread."""

    max_message_bytes: int = 4 << 20
    hwm: int = 1000
    replay_timeout_s: float = 2.0
    max_pending: int = 1000
    close_timeout_s: float = 5.0


class FeedState(Enum):
    """Where one publisher's stream stands."""

    FRESH = "fresh"  # nothing applied since connect or reset: the next seq sets the start
    LIVE = "live"  # in sequence
    REPLAYING = "replaying"  # asked the replay endpoint for the missed batches; live ones wait in ``pending``


class _Feed:
    """One publisher (one DP rank's endpoint) of one instance: its sockets and its sequence state."""

    __slots__ = ("instance", "rank", "dp_size", "endpoint", "replay_endpoint", "sub", "dealer", "monitor",
                 "state", "last_seq", "had_state", "pending", "deadline", "short", "ranks", "connected",
                 "refused")

    def __init__(self, instance: Hashable, rank: int, dp_size: int, endpoint: str,
                 replay_endpoint: Optional[str]) -> None:
        self.instance = instance
        self.rank = rank
        self.dp_size = dp_size
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.sub: Any = None
        self.dealer: Any = None
        self.monitor: Any = None
        self.state = FeedState.FRESH
        self.last_seq = -1
        self.had_state = False  # the replay under way follows applied batches (not a cold start)
        self.pending: deque[DecodedBatch] = deque()
        self.deadline = 0.0
        self.short = False  # the replay under way already found it does not reach back
        self.ranks: set[int] = {rank}  # DP ranks whose batches came through this feed
        self.connected = False
        self.refused = False  # a refused connect was reported (once until it connects)


class KvEventSubscriber:
    """Owns the subscriber thread, its ZeroMQ context and every feed's sockets; applies what arrives to
    ``index`` (the thread is the index's one writer)."""

    def __init__(self, index: KvIndex, limits: SubscriberLimits, *, log_interval_s: float = 10.0) -> None:
        self.index = index
        self.stats = index.stats
        self.limits = limits
        self._decoder = EventDecoder(limits.max_message_bytes)
        self._ctx = zmq.Context()
        self._ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._feeds: dict[Hashable, list[_Feed]] = {}
        self._by_socket: dict[Any, tuple[_Feed, str]] = {}
        self._poller = zmq.Poller()
        self._closing = False
        self._closed = False
        self._warn = RateLimitedLog(logger, "KV event problems", interval_s=log_interval_s, burst=4)
        self._progress = threading.Condition()  # notified after each round of work (see wait_for)
        self._reopen: list[_Feed] = []  # feeds whose SUB lost its connection this round
        self._thread = threading.Thread(target=self._run, name="atom-kv-proxy-kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def follow(self, spec: FeedSpec) -> None:
        """Follow ``spec.instance``'s publishers (instead of what it had, if anything: its entries go)."""
        self._send(("follow", spec))

    def forget(self, instance: Hashable) -> None:
        """``instance`` left: close its feeds and drop its entries."""
        self._send(("forget", instance))

    def reset(self, instance: Hashable) -> None:
        """``instance`` restarted (its engine id changed): clear its entries and start its feeds afresh."""
        self._send(("reset", instance))

    def sync(self) -> None:
        """Wait until every command sent before has been carried out (tests, benches), bounded by
        ``close_timeout_s``."""
        done = threading.Event()
        self._send(("sync", done))
        if not done.wait(self.limits.close_timeout_s):
            raise TimeoutError(f"the KV event subscriber did not answer within {self.limits.close_timeout_s}s")

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until ``predicate()`` (checked after each round of the thread's work) holds, or ``timeout``
        seconds pass; whether it holds."""
        with self._progress:
            return self._progress.wait_for(predicate, timeout)

    def close(self) -> None:
        """Stop the thread (it closes its sockets), then the context; once."""
        if self._closed:
            return
        self._closed = True
        self._send(("close", None))
        self._thread.join(self.limits.close_timeout_s)
        if self._thread.is_alive():
            logger.warning("the KV event subscriber thread did not stop within %.1fs", self.limits.close_timeout_s)
        else:
            self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending (or we are closed)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
        try:
            while not self._closing:
                try:
                    ready = self._poller.poll(self._poll_ms())
                except zmq.ZMQError as exc:
                    logger.error("KV event subscriber: poll failed (%s); stopping", exc)
                    break
                for sock, _ in ready:
                    if sock == self._wake_r.fileno():
                        self._commands_due()
                    else:
                        self._readable(sock)
                self._deadlines(time.monotonic())
                reopen, self._reopen = self._reopen, []
                for feed in reopen:
                    if self._feeds.get(feed.instance) and feed in self._feeds[feed.instance]:
                        self._reopen_sub(feed)
                self._warn.flush()  # summaries of what the rate limit kept out of the log
                with self._progress:
                    self._progress.notify_all()
        except Exception:
            logger.exception("KV event subscriber stopped on an unexpected error; events are no longer followed")
        finally:
            for feeds in self._feeds.values():
                for feed in feeds:
                    self._close_sockets(feed)
            self._feeds.clear()

    def _poll_ms(self) -> int:
        wait = self.limits.replay_timeout_s
        now = time.monotonic()
        for feeds in self._feeds.values():
            for feed in feeds:
                if feed.state is FeedState.REPLAYING:
                    wait = min(wait, max(0.0, feed.deadline - now))
        return int(wait * 1000) + 1

    def _commands_due(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while True:
            try:
                name, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if name == "close":
                self._closing = True
            elif name == "follow":
                self._follow(arg)
            elif name == "forget":
                self._drop_feeds(arg)
                self.index.drop(arg, "left")
            elif name == "reset":
                self.index.clear(arg, None, "health")
                for feed in self._feeds.get(arg, []):
                    self._restart_feed(feed)
            elif name == "sync":
                arg.set()

    def _follow(self, spec: FeedSpec) -> None:
        if spec.instance in self._feeds:
            self._drop_feeds(spec.instance)
            self.index.drop(spec.instance, "left")
        feeds = []
        for rank in range(spec.dp_size):
            try:
                endpoint = rank_endpoint(spec.endpoint, rank)
                replay = rank_endpoint(spec.replay_endpoint, rank) if spec.replay_endpoint else None
            except ValueError as exc:
                self._warn.event("endpoint", f"KV events of {spec.instance}: {exc}")
                break
            feed = _Feed(spec.instance, rank, spec.dp_size, endpoint, replay)
            self._open_sockets(feed)
            feeds.append(feed)
        self._feeds[spec.instance] = feeds

    def _drop_feeds(self, instance: Hashable) -> None:
        for feed in self._feeds.pop(instance, []):
            self._close_sockets(feed)

    # ------------------------------------------------------------------ sockets
    def _options(self, sock: Any, endpoint: str) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.limits.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)

    def _open_sockets(self, feed: _Feed) -> None:
        self._open_sub(feed)
        if feed.replay_endpoint:
            self._open_dealer(feed)

    def _open_sub(self, feed: _Feed) -> None:
        sub = self._ctx.socket(zmq.SUB)
        self._options(sub, feed.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: vLLM's default is empty, ATOM may set one
        feed.monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED)
        sub.connect(feed.endpoint)
        feed.sub = sub
        self._register(feed.sub, feed, "sub")
        self._register(feed.monitor, feed, "monitor")

    def _reopen_sub(self, feed: _Feed) -> None:
        """A new SUB for ``feed``: libzmq does not reconnect a socket that dropped a peer for a frame over
        ``ZMQ_MAXMSGSIZE``, so a lost connection is replaced (the next seq shows what was missed)."""
        if feed.sub is None:
            return
        try:
            feed.sub.disable_monitor()
        except zmq.ZMQError:
            pass
        self._close_socket(feed.monitor)
        self._close_socket(feed.sub)
        feed.connected = False
        self._open_sub(feed)

    def _open_dealer(self, feed: _Feed) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        endpoint = feed.replay_endpoint or ""
        self._options(dealer, endpoint)
        dealer.setsockopt(zmq.SNDHWM, 16)
        dealer.connect(endpoint)
        feed.dealer = dealer
        self._register(dealer, feed, "dealer")

    def _register(self, sock: Any, feed: _Feed, role: str) -> None:
        self._poller.register(sock, zmq.POLLIN)
        self._by_socket[sock] = (feed, role)

    def _close_socket(self, sock: Any) -> None:
        if sock is None:
            return
        self._by_socket.pop(sock, None)
        try:
            self._poller.unregister(sock)
        except KeyError:
            pass
        sock.close(linger=0)

    def _close_sockets(self, feed: _Feed) -> None:
        if feed.sub is not None:
            try:
                feed.sub.disable_monitor()
            except zmq.ZMQError:
                pass
        for sock in (feed.monitor, feed.dealer, feed.sub):
            self._close_socket(sock)
        feed.sub = feed.dealer = feed.monitor = None

    def _readable(self, sock: Any) -> None:
        found = self._by_socket.get(sock)
        if found is None:
            return
        feed, role = found
        for _ in range(_DRAIN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self._warn.event("socket", f"KV events of {feed.instance} from {feed.endpoint}: receive failed: {exc}")
                return
            if role == "sub":
                self._on_live(feed, frames)
            elif role == "dealer":
                self._on_replay(feed, frames)
                if feed.dealer is not sock:  # the replay ended with a new socket
                    return
            else:
                self._on_monitor(feed, frames)

    def _on_monitor(self, feed: _Feed, frames: list[bytes]) -> None:
        try:
            event = recv_monitor_message_from(frames)
        except (ValueError, IndexError):
            return
        if event == zmq.EVENT_CONNECT_RETRIED:
            self.stats.connect_failures += 1
            if not feed.refused:
                feed.refused = True
                self._warn.event("connect", (
                    f"cannot connect to the KV event publisher of {feed.instance} (DP rank {feed.rank}) at "
                    f"{feed.endpoint}: nothing accepts connections there. A vLLM engine binds its publisher only "
                    "with an endpoint like tcp://*:PORT (with a host address it connects out instead); retrying"))
        elif event == zmq.EVENT_DISCONNECTED:
            self._warn.event("disconnect", (
                f"lost the connection to the KV event publisher of {feed.instance} at {feed.endpoint} (it went "
                "away, or sent a frame over --kv-events-max-message-bytes); connecting again"))
            self._reopen.append(feed)
        elif event == zmq.EVENT_CONNECTED:
            if feed.refused:
                logger.info("connected to the KV event publisher of %s at %s", feed.instance, feed.endpoint)
            feed.refused = False
            feed.connected = True

    # ------------------------------------------------------------------ sequence rules
    def _decode_failed(self, feed: _Feed, exc: DecodeFailure) -> None:
        self.stats.decode_failures[exc.reason] = self.stats.decode_failures.get(exc.reason, 0) + 1
        self._warn.event(exc.reason, f"bad KV event message from {feed.endpoint} ({feed.instance}): {exc}")

    def _on_live(self, feed: _Feed, frames: list[bytes]) -> None:
        try:
            batch = self._decoder.decode_frames(frames)
        except DecodeFailure as exc:
            self._decode_failed(feed, exc)
            if len(frames) == 3 and feed.state is not FeedState.REPLAYING:
                try:  # a bad batch in sequence is skipped, not replayed (it would come back as bad)
                    if parse_seq(frames[1]) == feed.last_seq + 1:
                        feed.last_seq += 1
                        feed.state = FeedState.LIVE
                except DecodeFailure:
                    pass
            return
        seq = batch.seq
        if seq is None:  # no sequence numbers (ATOM): apply as it comes
            self._apply(feed, batch)
            return
        if feed.state is FeedState.REPLAYING:
            if len(feed.pending) < self.limits.max_pending:
                feed.pending.append(batch)
                return
            self.stats.replays["overflow"] += 1
            self._clear(feed, "replay_overflow")
            feed.last_seq = -1  # what waited follows on cold
            self._end_replay(feed, reopen=True)
        if feed.last_seq >= 0 and seq < feed.last_seq:
            self._clear(feed, "restart")
            self._restart_feed(feed)
        if feed.last_seq >= 0 and seq == feed.last_seq:
            self.stats.duplicates += 1
            return
        expected = feed.last_seq + 1
        if seq == expected:
            self._in_sequence(feed, batch)
            return
        self.stats.gaps += 1
        if feed.dealer is None:
            self.stats.replays["unavailable"] += 1
            if feed.last_seq >= 0:
                self._clear(feed, "no_replay")
            self._in_sequence(feed, batch)
            return
        feed.had_state = feed.last_seq >= 0
        feed.short = False
        feed.pending.append(batch)
        feed.state = FeedState.REPLAYING
        feed.deadline = time.monotonic() + self.limits.replay_timeout_s
        try:
            feed.dealer.send_multipart([b"", encode_seq(expected)], zmq.NOBLOCK)
        except zmq.ZMQError:  # the replay endpoint is not connected (yet): treat as timed out now
            feed.deadline = 0.0

    def _in_sequence(self, feed: _Feed, batch: DecodedBatch, *, replayed: bool = False) -> None:
        feed.last_seq = batch.seq if batch.seq is not None else feed.last_seq
        feed.state = FeedState.LIVE
        self._apply(feed, batch, replayed=replayed)

    def _on_replay(self, feed: _Feed, frames: list[bytes]) -> None:
        if frames and frames[0] == b"":
            frames = frames[1:]  # the DEALER keeps the delimiter the ROUTER sent
        if feed.state is not FeedState.REPLAYING:
            return  # a late answer to a replay already given up
        if len(frames) != 2:
            self._decode_failed(feed, DecodeFailure("frames", f"replay answer of {len(frames)} frames "
                                                              "(expected [seq, payload])"))
            return
        try:
            seq = parse_seq(frames[0])
        except DecodeFailure as exc:
            self._decode_failed(feed, exc)
            return
        if seq == END_SEQ:
            self.stats.replays["short" if feed.short else "complete"] += 1
            self._end_replay(feed, reopen=False)
            return
        try:
            batch = self._decoder.decode_payload(frames[1], seq)
        except DecodeFailure as exc:
            self._decode_failed(feed, exc)
            return
        if seq <= feed.last_seq:
            self.stats.duplicates += 1
            return
        if seq != feed.last_seq + 1 and not feed.short:
            feed.short = True  # the buffer does not reach back to what we miss: what we hold is not to be trusted
            if feed.had_state:
                self._clear(feed, "replay_short")
        self._in_sequence(feed, batch, replayed=True)
        feed.state = FeedState.REPLAYING

    def _end_replay(self, feed: _Feed, *, reopen: bool) -> None:
        """The replay is over: apply the live batches that waited, in order (a hole left among them clears
        the workers once more: they follow on cold); ``reopen`` the DEALER so late answers cannot arrive."""
        pending, feed.pending = feed.pending, deque()
        feed.state = FeedState.LIVE if feed.last_seq >= 0 else FeedState.FRESH
        if reopen and feed.dealer is not None:
            self._close_socket(feed.dealer)
            feed.dealer = None
            self._open_dealer(feed)
        for batch in sorted(pending, key=lambda b: -1 if b.seq is None else b.seq):
            if batch.seq is None or batch.seq <= feed.last_seq:
                continue
            if feed.last_seq >= 0 and batch.seq != feed.last_seq + 1:
                self._clear(feed, "replay_short")
            self._in_sequence(feed, batch)

    def _deadlines(self, now: float) -> None:
        for feeds in list(self._feeds.values()):
            for feed in feeds:
                if feed.state is FeedState.REPLAYING and now >= feed.deadline:
                    self.stats.replays["timeout"] += 1
                    self._warn.event("replay", f"replay of missed KV events from {feed.replay_endpoint} "
                                               f"({feed.instance}) timed out after {self.limits.replay_timeout_s}s; "
                                               "its entries are cleared")
                    if feed.had_state or feed.last_seq >= 0:
                        self._clear(feed, "replay_timeout")
                    feed.last_seq = -1
                    self._end_replay(feed, reopen=True)

    def _restart_feed(self, feed: _Feed) -> None:
        """Forget the stream's position (a restart or a reset): the next seq starts it again."""
        if feed.state is FeedState.REPLAYING and feed.dealer is not None:
            self._close_socket(feed.dealer)
            feed.dealer = None
            self._open_dealer(feed)
        feed.pending = deque()
        feed.state = FeedState.FRESH
        feed.last_seq = -1
        feed.had_state = False

    def _clear(self, feed: _Feed, reason: str) -> None:
        for rank in sorted(feed.ranks):
            self.index.clear(feed.instance, rank, reason)

    def _apply(self, feed: _Feed, batch: DecodedBatch, *, replayed: bool = False) -> None:
        rank = batch.dp_rank
        if rank is None or not 0 <= rank < feed.dp_size:
            rank = feed.rank
        feed.ranks.add(rank)
        self.stats.batches += 1
        if not replayed and batch.ts > 0:  # a replayed batch is old by design: not ingestion lag
            self.stats.observe_lag(time.time() - batch.ts)
        if batch.bad_events:
            self.stats.decode_failures["event"] += batch.bad_events
            self._warn.event("event", f"{batch.bad_events} unusable event(s) in a KV event batch from "
                                      f"{feed.endpoint} ({feed.instance}); the rest applied")
        try:
            self.index.apply(feed.instance, rank, batch.events)
        except Exception:  # one bad batch must not stop the feeds; say what and go on
            logger.exception("applying a KV event batch from %s (%s) failed", feed.endpoint, feed.instance)


def recv_monitor_message_from(frames: list[bytes]) -> int:
    """The event number of a socket monitor message (its first frame: event u16, value u32)."""
    if not frames or len(frames[0]) < 6:
        raise ValueError("short monitor message")
    return int.from_bytes(frames[0][:2], "little")
