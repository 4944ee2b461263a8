"""A test publisher of KV cache events that follows vLLM's protocol (``vllm/distributed/kv_events.py``).

:class:`KvEventsTestPublisher` binds a publishing socket and a ROUTER for replay on 127.0.0.1 (OS-assigned
ports unless given), numbers each batch from 0 (8 bytes big-endian, ``[topic, seq, payload]``), keeps the
last ``buffer_steps`` for replay and answers a replay request (``[start seq]`` from a DEALER) with every
buffered batch from ``start`` on, then the end marker (seq -1, empty payload), as vLLM's publisher does.
With ``seq=False`` it frames like ATOM today (``[payload]``, or ``[topic, payload]``) and has no replay.

The publishing socket is an XPUB (a PUB that also reports subscriptions), so a test can wait for the
subscriber to be connected (:meth:`wait_subscribed`) instead of sleeping. Test-only hooks: ``live=False``
(number and buffer a batch but do not send it: a gap), :meth:`restart` (the seq counts from 0 again, the
buffer empties: a publisher restart) and :meth:`send_frames` (anything at all). One named thread owns the
sockets and stops on :meth:`close`.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections import deque
from typing import Any, Optional, Sequence

import msgspec
import zmq

from atom_kv.proxy.kv_events.wire import EventBatch, MapEventBatch, encode_seq

__all__ = ["KvEventsTestPublisher"]


class KvEventsTestPublisher:
    """Owns an XPUB and a replay ROUTER bound on ``host`` and the thread that serves them."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, replay: bool = True, replay_port: int = 0,
                 seq: bool = True, topic: bytes = b"", buffer_steps: int = 10_000) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, repeated ones too (a reconnect)
        self._pub.bind(f"tcp://{host}:{port or '*'}")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router = None
        self.replay_endpoint: Optional[str] = None
        if replay and seq:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(f"tcp://{host}:{replay_port or '*'}")
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = seq
        self._topic = topic
        self._next = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._subscribed = threading.Condition()
        self.subscriptions = 0
        self.replay_requests: list[int] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-events-test-publisher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ test side
    def publish(self, events: Sequence[Any], *, dp_rank: Optional[int] = None, shape: str = "array",
                live: bool = True, ts: float = 0.0) -> Optional[int]:
        """Publish one batch of wire Structs (positional ones for ``shape="array"``, ``Map*`` ones for
        ``"map"``); its seq (None without seqs). ``live=False`` buffers it for replay without sending it;
        ``ts``: the batch's timestamp (0: none, so no lag is measured for it)."""
        batch_type = EventBatch if shape == "array" else MapEventBatch
        payload = self._encoder.encode(batch_type(ts=ts, events=list(events), data_parallel_rank=dp_rank))
        return self.publish_payload(payload, live=live)

    def publish_payload(self, payload: bytes, *, live: bool = True) -> Optional[int]:
        """Publish an encoded ``EventBatch`` (or anything) as the next batch."""
        if not self._seq:
            self._do(("send", [self._topic, payload] if self._topic else [payload]))
            return None
        seq = self._next
        self._next += 1
        self._do(("batch", (seq, payload, live)))
        return seq

    def send_frames(self, frames: list[bytes]) -> None:
        """Send ``frames`` as they are (malformed messages)."""
        self._do(("send", frames))

    def restart(self) -> None:
        """As if the publisher process restarted: the seq counts from 0 again and the buffer is empty."""
        self._next = 0
        self._do(("restart", None))

    def wait_subscribed(self, count: int = 1, timeout: float = 5.0) -> bool:
        """Block until ``count`` subscriptions arrived in all (a subscriber's connect, or its reconnect)."""
        with self._subscribed:
            return self._subscribed.wait_for(lambda: self.subscriptions >= count, timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._do(("close", None))
        self._thread.join(5.0)
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> "KvEventsTestPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _do(self, job: tuple) -> None:
        done = threading.Event()
        self._jobs.put((job, done))
        self._wake_w.send(b"\0")
        if not done.wait(5.0):
            raise TimeoutError("the test publisher's thread did not take the job within 5 s")

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        running = True
        try:
            while running:
                for sock, _ in poller.poll(1000):
                    if sock is self._pub:
                        if self._pub.recv()[:1] == b"\x01":  # a subscription (\x00: a subscriber left)
                            with self._subscribed:
                                self.subscriptions += 1
                                self._subscribed.notify_all()
                    elif sock is self._router:
                        self._serve_replay()
                    else:
                        self._wake_r.recv(4096)
                        running = self._jobs_due()
        finally:
            for sock in (self._pub, self._router):
                if sock is not None:
                    sock.close(linger=0)

    def _jobs_due(self) -> bool:
        while True:
            try:
                (name, arg), done = self._jobs.get_nowait()
            except queue.Empty:
                return True
            try:
                if name == "close":
                    return False
                if name == "send":
                    self._pub.send_multipart(arg)
                elif name == "batch":
                    seq, payload, live = arg
                    self._buffer.append((seq, payload))
                    if live:
                        self._pub.send_multipart([self._topic, encode_seq(seq), payload])
                elif name == "restart":
                    self._buffer.clear()
            finally:
                done.set()

    def _serve_replay(self) -> None:
        assert self._router is not None
        frames = self._router.recv_multipart()
        if len(frames) != 3:  # vLLM: "Invalid replay request"
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        self.replay_requests.append(start)
        for seq, payload in self._buffer:
            if seq >= start:
                self._router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self._router.send_multipart([client, b"", encode_seq(-1), b""])
