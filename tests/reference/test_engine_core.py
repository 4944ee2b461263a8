"""The engine core in-process (TP=1, colocated): determinism, batching, aborts."""

import queue
import time

from atom_kv.reference.engine import EngineArgs, EngineCore
from atom_kv.reference.request import Request


class _Collector:
    def __init__(self):
        self.q: "queue.Queue" = queue.Queue()

    def __call__(self, out):
        self.q.put(out)

    def run_to_end(self, n_requests, timeout=30):
        tokens, done = {}, {}
        while len(done) < n_requests:
            out = self.q.get(timeout=timeout)
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = out
        return tokens, done


def _engine(collector, **kw):
    args = EngineArgs(num_layers=2, num_blocks=kw.pop("num_blocks", 64), block_size=4, **kw)
    engine = EngineCore(args, None, collector)
    engine.start()
    return engine


def _prompt(seed, n):
    return [256] + [(seed * 31 + i * 7) % 256 for i in range(n)]


def test_batched_outputs_equal_one_at_a_time():
    c1 = _Collector()
    e1 = _engine(c1)
    try:
        for i in range(4):
            e1.submit(Request(request_id=f"r{i}", prompt_ids=_prompt(i, 5 + 3 * i), max_tokens=6))
        batched, done = c1.run_to_end(4)
        assert all(d.finish_reason == "length" and d.error is None for d in done.values())
        assert e1.snapshot()["kv_free"] == 64
    finally:
        e1.close()
    c2 = _Collector()
    e2 = _engine(c2)
    try:
        for i in range(4):
            e2.submit(Request(request_id=f"r{i}", prompt_ids=_prompt(i, 5 + 3 * i), max_tokens=6))
            single, _ = c2.run_to_end(1)
            assert single[f"r{i}"] == batched[f"r{i}"]
            assert all(32 <= t < 127 or t == 10 for t in single[f"r{i}"])
    finally:
        e2.close()


def test_abort_frees_blocks_and_other_requests_continue():
    c = _Collector()
    e = _engine(c, num_blocks=16)
    try:
        e.submit(Request(request_id="long", prompt_ids=_prompt(1, 10), max_tokens=40))
        # 13 + 4 blocks > 16: "short" waits until "long" is aborted
        e.submit(Request(request_id="short", prompt_ids=_prompt(2, 10), max_tokens=4))
        first = c.q.get(timeout=30)
        assert first.new_token_ids
        e.abort("long")
        while True:
            out = c.q.get(timeout=30)
            if out.request_id == "short" and out.finished:
                break
        assert out.error is None
        deadline = time.monotonic() + 5  # the abort is applied by the loop thread
        while e.snapshot()["kv_free"] != 16:
            assert time.monotonic() < deadline, e.snapshot()
            time.sleep(0.05)
        assert e.counters["requests_aborted"] == 1
    finally:
        e.close()
    e.close()  # idempotent


def test_stop_string_and_stop_token_end_the_request_early_and_free_its_blocks():
    c = _Collector()
    e = _engine(c, num_blocks=32)
    try:
        e.submit(Request(request_id="full", prompt_ids=_prompt(3, 8), max_tokens=24))
        full, _ = c.run_to_end(1)
        text = bytes(full["full"]).decode()
        stop = text[9:11]  # a stop string starting at the 10th generated character
        cut = text.index(stop)
        e.submit(Request(request_id="s", prompt_ids=_prompt(3, 8), max_tokens=24, stop=["never", stop]))
        e.submit(Request(request_id="t", prompt_ids=_prompt(3, 8), max_tokens=24,
                         stop_token_ids=[full["full"][5]]))
        tokens, done = c.run_to_end(2)
        assert bytes(tokens["s"]).decode() == text[:cut]
        assert (done["s"].finish_reason, done["s"].stop_reason) == ("stop", stop)
        assert done["s"].num_output_tokens == cut + len(stop)  # every generated token counts
        first = full["full"].index(full["full"][5])
        assert tokens["t"] == full["full"][:first]
        assert (done["t"].finish_reason, done["t"].stop_reason) == ("stop", full["full"][5])
        deadline = time.monotonic() + 5
        while e.snapshot()["kv_free"] != 32:
            assert time.monotonic() < deadline, e.snapshot()
            time.sleep(0.05)
    finally:
        e.close()
