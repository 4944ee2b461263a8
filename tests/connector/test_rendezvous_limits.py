"""The rendezvous under strangers (without a token anyone may ask): waiting queries are capped per
address, strangers on 64 addresses cannot push a decode engine's waiting query out (the issue: 4,200
strangers' queries evicted it), and answers without blocks are logged at a bounded rate (the issue:
20k queries, 4.4 MB of INFO log)."""

from __future__ import annotations

import logging
import time

import zmq

from atom_kv import wire
from tests.conftest import free_port
from tests.connector.engines import run_until
from tests.connector.inproc import consumer_engine, producer_engine
from tests.connector.test_rendezvous import finish_prefill, pending, start_prefill


class Askers:
    """DEALER sockets from given addresses asking for transfers nobody issued."""

    def __init__(self, port: int, sources: list[str]) -> None:
        self.ctx = zmq.Context()
        self.socks = []
        for src in sources:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 100_000)
            s.connect(f"tcp://{src}:0;127.0.0.1:{port}")
            self.socks.append(s)

    def ask(self, n: int, wait_ms: int, prefix: str = "ghost") -> None:
        for i, s in enumerate(self.socks):
            for j in range(n):
                s.send(wire.encode(wire.BlocksQuery(transfer_id=f"{prefix}-{i}-{j}", engine_id="stranger", tp_rank=0,
                                                    tp_size=1, wait_ms=wait_ms)), zmq.NOBLOCK)

    def answers(self, timeout_s: float, want: int) -> list[wire.BlocksAnswer]:
        out = []
        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while len(out) < want and time.monotonic() < deadline:
            for s, _ in poller.poll(200):
                while True:
                    try:
                        out.append(wire.decode(s.recv_multipart(zmq.NOBLOCK)[-1], wire.BlocksAnswer))
                    except zmq.Again:
                        break
        return out

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.ctx.term()


def test_waiting_queries_are_capped_per_address():
    port = free_port()
    P, pw, _ = producer_engine(port, limits={"rendezvous_max_waiting_per_source": 256})
    askers = Askers(port, ["127.0.0.7"])
    try:
        askers.ask(300, wait_ms=60_000)
        refused = askers.answers(10, want=44)
        assert len(refused) == 44 and all(not a.found for a in refused)
        assert all("limits.rendezvous_max_waiting_per_source" in a.reason for a in refused), refused[0].reason
        assert not askers.answers(0.5, want=1)  # the other 256 wait
    finally:
        askers.close()
        pw.close()


def test_strangers_on_64_addresses_cannot_push_out_a_decode_engines_waiting_query():
    port = free_port()
    P, pw, _ = producer_engine(port)
    D, dw, _ = consumer_engine(port)
    askers = Askers(port, [f"127.0.0.{i}" for i in range(2, 66)])
    try:
        start_prefill(P, "p", "t-1", 40)
        D.admit("d", 40, pending(port, "t-1"))
        run_until([P, D], lambda: "t-1" in pw.rendezvous.queries, timeout_s=10)  # the decode's query waits
        askers.ask(66, wait_ms=60_000)  # 4,224 waiting queries: more than the 4,096 a rank keeps
        pushed_out = askers.answers(30, want=64 * 66 - 4095)
        assert len(pushed_out) == 64 * 66 - 4095  # strangers' own, the oldest of the largest holders
        finish_prefill(P, "p")
        run_until([P, D], lambda: "d" in D.ready or "d" in D.failed, timeout_s=15)
        assert D.failed == {}, D.failed
    finally:
        askers.close()
        pw.close()
        dw.close()


def test_answers_without_blocks_are_logged_at_a_bounded_rate(caplog):
    port = free_port()
    P, pw, _ = producer_engine(port)
    askers = Askers(port, ["127.0.0.8"])
    try:
        with caplog.at_level(logging.INFO, logger="atom_kv.connector.producer"):
            askers.ask(2000, wait_ms=0)
            assert len(askers.answers(30, want=2000)) == 2000
        lines = [r for r in caplog.records if "no blocks for transfer" in r.getMessage()]
        assert 1 <= len(lines) <= 3, f"{len(lines)} log lines for 2000 unknown transfers"
    finally:
        askers.close()
        pw.close()
