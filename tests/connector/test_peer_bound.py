"""A decode rank's producer peers are bounded, and a peer that left is dropped: the cap evicts the least
recently used peer (its tcp connections and reader threads go), and a producer that comes back under a
new engine id on the same port replaces the peer cached for the old id. Real engines on 127.0.0.1."""

from __future__ import annotations

import socket
import threading


from tests.conftest import free_port
from tests.connector.engines import run_until
from tests.connector.inproc import NB, consumer_engine, producer_engine
from tests.connector.kvutil import check_blocks


def _reader_threads(data_port: int) -> int:
    """This process's tcp reader threads connected to the read server on ``data_port``."""
    prefix = f"atomkv-tcp-read-{data_port}-"
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive())


def _load(P, D, dcache, rid: str) -> None:
    params = P.prefill(f"p-{rid}", 40)
    blocks = D.admit(rid, 40, params)
    run_until([P, D], lambda: rid in D.ready or rid in D.failed)
    assert D.failed == {}
    assert check_blocks(dcache, list(zip(blocks, params["remote_block_ids"])), 0, 1, NB) == ""
    D.finish(rid)


def test_peers_past_the_cap_evict_the_least_recently_used():
    producers = [producer_engine(free_port(), engine_id=f"P{i}") for i in range(3)]
    D, dw, dcache = consumer_engine(free_port(), max_producer_peers=2)
    try:
        for i, (P, _pw, _) in enumerate(producers):
            _load(P, D, dcache, f"d{i}")
        # P0 was the least recently used when P2 came: gone from the table and from the backend
        held = {key[0] for key in dw.peer_handshakes()}
        assert held == {"P1", "P2"}, held
        assert dw.stats()["peers_evicted"] == 1
        run_until([D], lambda: _reader_threads(producers[0][1].backend.server.port) == 0, timeout_s=10.0)
        assert _reader_threads(producers[2][1].backend.server.port) > 0
        # P0 again: a fresh handshake, and now P1 is the one evicted
        _load(producers[0][0], D, dcache, "d3")
        assert {key[0] for key in dw.peer_handshakes()} == {"P2", "P0"}
        assert dw.stats()["handshakes"] == 4
    finally:
        dw.close()
        for _P, pw, _ in producers:
            pw.close()


def test_a_producer_back_under_a_new_engine_id_replaces_the_old_peer():
    port = free_port()
    P1, pw1, _ = producer_engine(port, engine_id="P-old")
    D, dw, dcache = consumer_engine(port)
    pw2 = None
    try:
        _load(P1, D, dcache, "d1")
        old_data_port = pw1.backend.server.port
        assert _reader_threads(old_data_port) > 0
        pw1.close()  # the engine restarts on the same ports and registers under a new id
        P2, pw2, _ = producer_engine(port, engine_id="P-new")
        _load(P2, D, dcache, "d2")
        held = {key[0] for key in dw.peer_handshakes()}
        assert held == {"P-new"}, held
        assert dw.stats()["peers_evicted"] == 1
        if pw2.backend.server.port != old_data_port:
            run_until([D], lambda: _reader_threads(old_data_port) == 0, timeout_s=10.0)
    finally:
        dw.close()
        pw1.close()
        if pw2 is not None:
            pw2.close()


def test_a_step_contacts_every_producer_at_once_however_many_loads_wait_for_a_read_thread():
    """Four loads from silent handshake ports hold the four read threads; a fifth load's producer is
    contacted all the same, before those four give up (the handshakes start with the step)."""
    P, pw, _ = producer_engine(free_port(), engine_id="P-live")
    D, dw, dcache = consumer_engine(free_port(), num_worker_threads=4, handshake_timeout_s=5.0)
    silent = []
    try:
        for _ in range(4):  # accepted by the kernel, never answered: each handshake waits its full timeout
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(16)
            silent.append(s)
        for i, s in enumerate(silent):
            port = s.getsockname()[1]
            params = P.prefill(f"p-silent{i}", 40)
            D.admit(f"silent{i}", 40, dict(params, remote_engine_id=f"P-silent{i}", remote_port=port,
                                         remote_handshake_port=port))
        params = P.prefill("p-live", 40)
        D.admit("live", 40, params)
        run_until([P, D], lambda: any(key[0] == "P-live" for key in dw.peer_handshakes()), timeout_s=30.0)
        assert not any(rid.startswith("silent") for rid in D.failed), D.failed
        run_until([P, D], lambda: all(f"silent{i}" in D.failed for i in range(4)), timeout_s=60.0)
    finally:
        dw.close()
        pw.close()
        for s in silent:
            s.close()
