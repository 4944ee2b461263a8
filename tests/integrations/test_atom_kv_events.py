"""ATOM's own KV cache events, followed by the proxy's subscriber: ``ATOM_SRC`` names a ROCm/ATOM checkout.

ATOM's ``Scheduler`` and ``BlockManager`` (stepped by ``atom_pd`` as ATOM's
``EngineCore`` steps them, publishing after every step) publish through ATOM's
own ``ZmqEventPublisher``, configured by ``ATOM_KV_EVENTS_*`` as an operator
would, on 127.0.0.1; the proxy's :class:`~atom_kv.proxy.kv_events.KvEvents`
subscribes over real ZeroMQ. Checked against ATOM's own prefix cache: what the
index holds for a prompt is what ATOM's cache can find of it, after blocks are
stored, evicted, moved off the device (``BlockTransferred``) and cleared; an
ATOM restart, which its seq-less wire cannot show, is seen by the engine id (as
the proxy sees it in the registration ping); and a decode engine's blocks loaded
from a producer appear as stored with medium ``REMOTE``. Skipped, with the
reason, without ``ATOM_SRC``.

Run (docs/atom.md, "Testing against ATOM"):
``ATOM_SRC=/path/to/ATOM <venv with ATOM's deps>/bin/python -m pytest -q tests/integrations/test_atom_kv_events.py``
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from tests.integrations.atom_env import use_real_atom

_SKIP = use_real_atom()
if _SKIP:
    pytest.skip(_SKIP, allow_module_level=True)

from atom.config import KVEventsConfig  # noqa: E402
from atom.distributed.kv_events import (  # noqa: E402
    MEDIUM_CPU, MEDIUM_GPU, MEDIUM_REMOTE, BlockRemoved, BlockStored, BlockTransferred,
)
from atom.model_engine.block_manager import BlockManager  # noqa: E402

from atom_kv.proxy.kv_events import KvEvents, KvEventsConfig  # noqa: E402
from atom_kv.testing.ports import free_port  # noqa: E402
from tests.connector.kvutil import port_range  # noqa: E402
from tests.integrations import atom_scenarios as sc  # noqa: E402
from tests.integrations.atom_pd import AtomEngine, decode_params, expected_output, prefill_on, run_until  # noqa: E402

BS = 16
INST = ("D", "http://127.0.0.1:8000")  # the decode instance, keyed as the proxy keys it
WAIT_S = 10.0
PROBES = 50  # connect probes (one every PROBE_WAIT_S) before giving up on the subscription
PROBE_WAIT_S = 0.2


@pytest.fixture(autouse=True)
def _atom_advertises_loopback(monkeypatch):
    monkeypatch.setenv("ATOM_HOST_IP", "127.0.0.1")  # as in test_atom_real.py


@pytest.fixture
def events_config(monkeypatch) -> KVEventsConfig:
    """ATOM's KV events as an operator turns them on: ``ATOM_KV_EVENTS_*`` (ATOM's ``KVEventsConfig.from_env``,
    what its ``Config`` defaults to), with a topic, so ATOM frames each batch as ``[topic, payload]``."""
    monkeypatch.setenv("ATOM_KV_EVENTS_ENABLE", "1")
    monkeypatch.setenv("ATOM_KV_EVENTS_ENDPOINT", f"tcp://127.0.0.1:{free_port()}")
    monkeypatch.setenv("ATOM_KV_EVENTS_TOPIC", "kv")
    config = KVEventsConfig.from_env()
    assert config.enable and config.publisher == "zmq"
    return config


class Follower:
    """The proxy's side: one :class:`KvEvents` following one ATOM engine at a time, as the engine's registration
    ping would announce it (its endpoint and its engine id)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.kv = KvEvents(KvEventsConfig(replay_timeout_s=1.0, close_timeout_s=5.0, log_interval_s=1.0))
        self.stats = self.kv.stats

    def watch(self, engine: AtomEngine) -> None:
        """What a ping from ``engine`` does: follow its publisher (no replay: ATOM has none), under its engine id."""
        self.kv.watch(INST, self.endpoint, engine_id=engine.connector.engine_id)
        self.kv.subscriber.sync()

    def connected(self, engine: AtomEngine) -> None:
        """Wait until batches from ``engine``'s publisher arrive (a SUB hears nothing sent before it joined):
        ATOM's publisher sends a removal of a block nobody holds until one is applied."""
        applied = self.stats.events["BlockRemoved"]
        for _ in range(PROBES):
            engine.sched.kv_event_publisher.publish([BlockRemoved(block_hashes=[12345], medium=MEDIUM_GPU)])
            if self.kv.subscriber.wait_for(lambda: self.stats.events["BlockRemoved"] > applied, PROBE_WAIT_S):
                return
        raise AssertionError(f"no batch of ATOM's publisher at {self.endpoint} arrived: {self.snapshot()}")

    def held(self, tokens: list[int]) -> int:
        """Tokens of ``tokens``' prefix the index says the engine holds."""
        return self.kv.longest_prefix(tokens).get((INST, 0), 0)

    def until(self, predicate: Callable[[], bool], what: str) -> None:
        assert self.kv.subscriber.wait_for(predicate, WAIT_S), f"timed out waiting for {what}: {self.snapshot()}"

    def snapshot(self) -> dict:
        s = self.stats
        return {"events": s.events, "batches": s.batches, "decode_failures": s.decode_failures,
                "skipped_runs": s.skipped_runs, "resets": s.resets, "entries": self.kv.index.entries}

    def close(self) -> None:
        self.kv.close()


@pytest.fixture
def follower(events_config):
    f = Follower(events_config.endpoint)
    yield f
    f.close()


def atom_holds(engine: AtomEngine, tokens: list[int]) -> int:
    """Tokens of ``tokens``' leading full blocks that ATOM's own prefix cache can find (its hash index)."""
    bm = engine.sched.block_manager
    h, found = -1, 0
    for i in range(len(tokens) // bm.block_size):
        h = BlockManager.compute_hash(tokens[i * bm.block_size:(i + 1) * bm.block_size], h)
        if bm.kv.lookup(h) == -1:
            break
        found += 1
    return found * bm.block_size


def atom_hashes(tokens: list[int]) -> list[int]:
    """ATOM's chained hashes of ``tokens``' full blocks (``BlockManager.compute_hash``)."""
    out, h = [], -1
    for i in range(len(tokens) // BS):
        h = BlockManager.compute_hash(tokens[i * BS:(i + 1) * BS], h)
        out.append(h)
    return out


def spy_on_publisher(engine: AtomEngine) -> list[Any]:
    """Every event ``engine``'s ATOM publisher is given (still sent as ever)."""
    sent: list[Any] = []
    publisher = engine.sched.kv_event_publisher
    publish = publisher.publish

    def recorded(events) -> None:
        events = list(events)
        sent.extend(events)
        publish(events)

    publisher.publish = recorded
    return sent


def serve(engine: AtomEngine, prompt: list[int], max_tokens: int = 2) -> None:
    seq = engine.add(prompt, max_tokens)
    run_until([engine], lambda: seq.id in engine.finished and engine.idle())
    assert seq.output_tokens == expected_output(prompt, max_tokens) and engine.errors == []


def test_atoms_publisher_and_the_proxys_index_agree_through_evictions_clears_and_a_restart(events_config, follower):
    a = list(range(200, 250))  # 50 tokens: 3 full blocks (and a partial one)
    b = list(range(600, 700))  # 100 tokens: 6 full blocks; with a's 3 cached, 8 blocks make ATOM evict 2 of a's
    D = AtomEngine("D", "kv_consumer", tp=1, port=port_range(1), seed=2, prefix_caching=True, num_blocks=8,
                   kv_events_config=events_config)
    try:
        follower.watch(D)
        follower.connected(D)
        removed = follower.stats.events["BlockRemoved"]
        serve(D, a)
        follower.until(lambda: follower.held(a) == 48, "a's 3 blocks stored")
        assert atom_holds(D, a) == 48
        serve(D, b)
        follower.until(lambda: follower.held(b) == 96 and follower.stats.events["BlockRemoved"] == removed + 2,
                       "b's 6 blocks stored, 2 of a's removed")
        assert atom_holds(D, a) < 48 and follower.held(a) == atom_holds(D, a)  # ATOM evicted, the index followed
        assert atom_holds(D, b) == 96

        # a block moved off the device (ATOM emits this on a swap to CPU, which its block manager at ffdf3bb5
        # never makes, so its publisher is handed one): gone from the index from that block on
        D.sched.kv_event_publisher.publish([BlockTransferred(block_hashes=[atom_hashes(b)[5]],
                                                             from_medium=MEDIUM_GPU, to_medium=MEDIUM_CPU)])
        follower.until(lambda: follower.held(b) == 80, "the transferred block gone")
        assert follower.stats.events["BlockTransferred"] == 1

        # ATOM's cache reset (its /reset_prefix_cache): AllBlocksCleared, published after the step
        D.sched.block_manager.clear_cache()
        D.sched.publish_kv_events()
        follower.until(lambda: follower.stats.resets["cleared"] == 1, "the clear")
        assert follower.held(a) == follower.held(b) == 0 == atom_holds(D, b) and follower.kv.index.entries == 0

        serve(D, b)
        follower.until(lambda: follower.held(b) == 96, "b stored again")
        old_id = D.connector.engine_id
    finally:
        D.close()

    # ATOM restarts on the same endpoint: its wire has no seq, so nothing on it says so ...
    D = AtomEngine("D", "kv_consumer", tp=1, port=port_range(1), seed=2, prefix_caching=True, num_blocks=8,
                   kv_events_config=events_config)
    try:
        assert D.connector.engine_id != old_id
        assert follower.held(b) == 96  # ... and the old engine's entries are still there
        follower.watch(D)  # its first ping: a new engine id
        follower.until(lambda: follower.stats.resets["health"] == 1 and follower.held(b) == 0, "the reset")
        follower.connected(D)
        serve(D, a)
        follower.until(lambda: follower.held(a) == 48, "the new engine's blocks")
        assert follower.held(b) == 0 and sum(follower.stats.decode_failures.values()) == 0
        assert sum(follower.stats.skipped_runs.values()) == 0
    finally:
        D.close()


def test_blocks_loaded_from_a_producer_are_stored_remote_in_the_decode_engines_events(events_config, follower):
    """Turn 1 computed on the decode engine (stored, medium GPU), turn 2's prompt extends it and is loaded from
    the producer: ATOM publishes the loaded blocks past the local hit as stored with medium REMOTE, chained to the
    cached ones, once (the connector reports the load, ATOM's scheduler publishes it); the index holds the whole
    prompt for the decode engine, as ATOM's cache does, each block once."""
    shared = list(range(400, 448))                 # 3 blocks
    prompt = shared + list(range(500, 540))        # 88 tokens: 3 blocks cached on D, 2 more full ones loaded
    P, D = sc._engines(1, 2, "tcp", prefix_caching=True, d_kv={"kv_events_config": events_config})
    try:
        sent = spy_on_publisher(D)
        follower.watch(D)
        follower.connected(D)
        serve(D, shared + [7, 8])
        follower.until(lambda: follower.held(prompt) == 48, "turn 1's blocks")
        (prefilled,) = prefill_on(P, [prompt])
        seq = D.add(prompt, 3, decode_params(prefilled))
        run_until([P, D], lambda: seq.id in D.finished and D.idle() and P.idle())
        assert D.errors == [] and seq.id not in D.prefilled and seq.output_tokens == expected_output(prompt, 3)
        assert D.cached_at_alloc[seq.id] == 48
        follower.until(lambda: follower.held(prompt) == 80, "turn 2's loaded blocks")
        assert atom_holds(D, prompt) == 80

        stored = [e for e in sent if isinstance(e, BlockStored)]
        remote = [e for e in stored if e.medium == MEDIUM_REMOTE]
        hashes = atom_hashes(prompt)
        assert len(remote) == 1, stored  # once: ATOM's scheduler publishes it, the connector does not again
        assert remote[0].block_hashes == hashes[3:5] and remote[0].parent_block_hash == hashes[2]
        assert remote[0].token_ids == prompt[48:80] and remote[0].block_size == BS
        gpu = [e for e in stored if e.medium == MEDIUM_GPU]
        assert gpu[0].block_hashes == hashes[:3] and gpu[0].parent_block_hash is None  # turn 1, computed on D
        # ATOM's first decode step after a load hashes the prompt again from its first block (its decode-side
        # watermark starts at 0): the same blocks once more, as GPU; the index keys them once
        assert all(e.block_hashes == hashes[:len(e.block_hashes)] for e in gpu[1:]), stored
        assert follower.kv.index.block_counts()[(INST, 0)] == 5
    finally:
        P.close()
        D.close()
