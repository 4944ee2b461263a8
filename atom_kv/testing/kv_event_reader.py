"""A test's subscriber to a reference engine's KV events (vLLM's wire): SUB plus replay DEALER.

Decodes with the publisher's own Structs; every wait is bounded (``timeout_ms``). The proxy's
subscriber lives in :mod:`atom_kv.proxy`; this one only reads what a test asserts on.
"""

from __future__ import annotations

from typing import Callable, Optional

import msgspec
import zmq

from atom_kv.reference.kv_events.events import KVEventBatch
from atom_kv.reference.kv_events.publisher import END_SEQ

__all__ = ["KVEventReader"]

_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_WAIT_MS = 5000


class KVEventReader:
    """Owns a SUB on an engine's KV events and a DEALER on their replay endpoint (its own context).

    Like any subscriber it fills a gap (a seq past the last one seen + 1, the first one included:
    ZeroMQ's slow joiner misses what went out before it joined) from the replay endpoint, and
    counts a seq below the last one seen as a restart."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(replay)
        self.last = -1
        self.gaps = 0  # gaps filled by replay
        self.restarts = 0  # seqs below the last one seen

    def raw(self, timeout_ms: int = _WAIT_MS) -> Optional[list[bytes]]:
        return self.sub.recv_multipart() if self.sub.poll(timeout_ms) else None

    def batches(self, timeout_ms: int = _WAIT_MS) -> list[tuple[int, KVEventBatch]]:
        """The next message, after the batches a gap before it missed (empty: nothing came)."""
        frames = self.raw(timeout_ms)
        if frames is None:
            return []
        seq, batch = int.from_bytes(frames[1], "big"), _DECODER.decode(frames[2])
        if seq <= self.last:
            self.restarts += 1
            self.last = -1
        got = []
        if seq > self.last + 1:
            self.gaps += 1
            got = [(s, b) for s, b in self.replay(self.last + 1) if s < seq]
        self.last = seq
        return [*got, (seq, batch)]

    def next_batches(self) -> list[tuple[int, KVEventBatch]]:
        """What came live, or else (a SUB still joining misses even that) what the replay has past the last."""
        got = self.batches(1000)
        if not got:
            got = self.replay(self.last + 1)
            self.last = got[-1][0] if got else self.last
        return got

    def events_until(self, done: Callable[[list], bool]) -> list:
        seen: list = []
        while not done(seen):
            got = self.next_batches()
            assert got, "no KV event batch arrived"
            seen += [ev for _, b in got for ev in b.events]
        return seen

    def replay(self, start: int) -> list[tuple[int, KVEventBatch]]:
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got: list[tuple[int, KVEventBatch]] = []
        while True:
            assert self.dealer.poll(_WAIT_MS), "the replay never ended"
            empty, seq, payload = self.dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), _DECODER.decode(payload)))

    def close(self) -> None:
        self.ctx.destroy(linger=0)
