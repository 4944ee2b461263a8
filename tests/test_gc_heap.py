"""The start-up heap frozen out of full collections, and full collections
counted over a timed section (what the connector bench's first-contact line
tells apart from the handshake itself)."""

from __future__ import annotations

import gc

from atom_kv.bench.connector import TARGET_HANDSHAKE_MS, handshake_target
from atom_kv.gc_heap import FullCollections, freeze_startup_heap


def test_full_collections_are_counted_only_while_active():
    with FullCollections() as full:
        gc.collect(1)  # a younger generation is not a full collection
        assert full.count == 0
        gc.collect()
        gc.collect()
    gc.collect()  # after the section: not counted
    assert full.count == 2 and full.seconds > 0
    assert full._callback not in gc.callbacks


def test_freeze_moves_the_live_heap_out_of_collections():
    class Marker:
        pass

    alive = [Marker() for _ in range(100)]
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(alive)
        assert not any(o is alive[0] for o in gc.get_objects(generation=2))  # frozen: no generation walks it
    finally:
        gc.unfreeze()  # the rest of the test process collects as usual


def test_bench_line_says_whether_the_first_contact_target_was_met():
    met = handshake_target({"tp": 1, "handshake_ms": TARGET_HANDSHAKE_MS / 2}).line()
    missed = handshake_target({"tp": 2, "handshake_ms": 80.0, "first_contact_full_gc_ms": 70.0}).line()
    edge = handshake_target({"tp": 1, "handshake_ms": TARGET_HANDSHAKE_MS}).line()
    assert met.startswith("target TP 1 first-contact handshake:") and f"< {TARGET_HANDSHAKE_MS:g} ms: met" in met
    assert "MISSED" in missed and "full garbage collection took 70.0 ms" in missed
    assert "garbage" not in met and "MISSED" in edge
