"""Prefill pipeline stages: each stage's ranks register only their layers and
say so in the handshake; a decode rank reads each layer from the stage that
holds it (ATOM's ``consumer_region_indices``), on each stage's own ports
(``pp_rank*(dp_size*tp_size) + dp_rank*tp_size + tp_rank``); a layout that
cannot be mapped is refused in one line."""

from __future__ import annotations

import pytest

from atom_kv.connector import ConnectorScheduler, ConsumerWorker, ProducerWorker
from atom_kv.connector.pipeline import check_stage_cover, consumer_region_indices, stage_layers
from atom_kv.wire import handshake_port
from tests.connector.engines import Engine, LocalRank, run_until
from tests.connector.kvutil import BLOCK, LAYERS, check_blocks, compat, config, make_caches, port_range

NB = 16


def test_consumer_region_indices_follow_atoms_definition():
    assert consumer_region_indices(6, 6, 0, 6, 1) == list(range(6))  # one stage: identity
    # stage holding layers 18..37 of 78, K and V groups: group-major onto 156 consumer regions
    got = consumer_region_indices(40, 20, 18, 156, 4)
    assert got == list(range(18, 38)) + list(range(96, 116))
    assert consumer_region_indices(41, 20, 18, 156, 4) is None  # not whole groups
    assert consumer_region_indices(40, 20, 18, 157, 4) is None  # consumer groups not uniform
    assert consumer_region_indices(40, 20, 70, 156, 4) is None  # past the consumer's layers
    assert stage_layers(40, 20, 18, 78, 4, 1) == list(range(18, 38))
    with pytest.raises(ValueError, match=r"^pipeline stage 3 of 4: 20 layers \(40 tensors\) starting at layer 70 "
                                         r"do not map onto the model's 78 layers$"):
        stage_layers(40, 20, 70, 78, 4, 3)


def test_stage_cover_names_what_is_wrong():
    assert check_stage_cover(range(4), [[0, 1], [2, 3]]) is None
    assert check_stage_cover(range(4), [[0, 1], [1, 2, 3]]) == "layer 1 is held by prefill stages 0 and 1"
    assert check_stage_cover(range(4), [[0, 1], [2]]) == "no prefill stage holds layer(s) [3] (the stages hold [0, 1, 2])"


def _stages(pcfg, *, pp: int, tp: int, dp_rank: int, dp_size: int, is_mla: bool, starts=None):
    """Producer workers of one DP rank: stage ``s`` holds ``LAYERS // pp`` layers from ``starts[s]``."""
    per = LAYERS // pp
    starts = starts or [s * per for s in range(pp)]
    ranks = []
    for s in range(pp):
        for r in range(tp):
            w = ProducerWorker(pcfg, engine_id="P", host="127.0.0.1", tp_rank=r, tp_size=tp, dp_rank=dp_rank,
                               dp_size=dp_size, pp_rank=s, pp_size=pp, start_layer=starts[s],
                               compat=compat(is_mla=is_mla))
            ranks.append(w)
            full = make_caches(NB, 0 if is_mla else r, 1 if is_mla else tp, fill=True, is_mla=is_mla)
            w.register_kv_caches(full[starts[s]:starts[s] + per])
    return ranks


@pytest.mark.parametrize("is_mla,p_tp,d_tp", [(False, 2, 1), (False, 1, 2), (True, 2, 2)],
                         ids=["gqa-P2-D1", "gqa-P1-D2", "mla-P2-D2"])
def test_decode_reads_each_layer_from_the_stage_that_holds_it(is_mla, p_tp, d_tp):
    pp, dp_rank, dp_size = 2, 1, 2
    base = port_range(pp * dp_size * p_tp)
    pcfg = config("kv_producer", base, backend="tcp")
    ccfg = config("kv_consumer", port_range(d_tp), backend="tcp")
    prod = _stages(pcfg, pp=pp, tp=p_tp, dp_rank=dp_rank, dp_size=dp_size, is_mla=is_mla)
    cons = [ConsumerWorker(ccfg, engine_id="D", host="127.0.0.1", tp_rank=r, tp_size=d_tp,
                           compat=compat(is_mla=is_mla)) for r in range(d_tp)]
    try:
        # each stage's ranks listen where ATOM main puts them
        for w in prod:
            assert w.handshake_server is not None
        dcaches = [make_caches(NB, r, d_tp, fill=False, is_mla=is_mla) for r in range(d_tp)]
        for w, c in zip(cons, dcaches):
            w.register_kv_caches(c)
        P = Engine(ConnectorScheduler(pcfg, engine_id="P", host="127.0.0.1", tp_size=p_tp, dp_rank=dp_rank,
                                      dp_size=dp_size, pp_size=pp, block_size=BLOCK),
                   [LocalRank(w) for w in prod], NB)
        D = Engine(ConnectorScheduler(ccfg, engine_id="D", host="127.0.0.1", tp_size=d_tp, block_size=BLOCK),
                   [LocalRank(w) for w in cons], NB)
        P.pool.alloc("offset", 3)
        params = P.prefill("r1", 50)
        assert params["remote_pp_size"] == pp and params["remote_dp_size"] == dp_size
        blocks = D.admit("d1", 50, params)
        # a rank's share is freed on its first notice (done or release); the other notice may still be in flight
        run_until([P, D], lambda: "d1" in D.ready and "r1" in P.freed
                  and all(w.stats().get("releases_received", 0) >= 1 for w in prod))
        pairs = list(zip(blocks, params["remote_block_ids"]))
        for r, c in enumerate(dcaches):
            assert check_blocks(c, pairs, 0 if is_mla else r, 1 if is_mla else d_tp, NB, is_mla=is_mla) == ""
        # every stage was read from and confirmed; every producer rank of every stage was released
        stats = [w.stats() for w in prod]
        for s in range(pp):
            assert sum(st.get("done_received", 0) for st in stats[s * p_tp:(s + 1) * p_tp]) >= 1
        assert [st.get("releases_received", 0) for st in stats] == [1] * len(prod)
        assert handshake_port(base, dp_rank, p_tp, p_tp - 1, pp_rank=pp - 1, dp_size=dp_size) == base + len(prod) * 2 - 1
    finally:
        for w in (*prod, *cons):
            w.close()


def test_stage_past_the_models_layers_is_refused_at_registration():
    pcfg = config("kv_producer", port_range(2), backend="tcp")  # stage 1 listens on base + 1
    w = ProducerWorker(pcfg, engine_id="P", host="127.0.0.1", tp_rank=0, tp_size=1, dp_size=1, pp_rank=1,
                       pp_size=2, start_layer=LAYERS, compat=compat())
    try:
        with pytest.raises(ValueError, match=r"^pipeline stage 1 of 2: 1 layers \(2 tensors\) starting at layer 2 "
                                             r"do not map onto the model's 2 layers$"):
            w.register_kv_caches(make_caches(NB, 0, 1, fill=True)[:1])
    finally:
        w.close()


def test_stages_that_do_not_cover_the_layers_fail_the_load_in_one_line():
    base = port_range(2)
    pcfg = config("kv_producer", base, backend="tcp")
    ccfg = config("kv_consumer", port_range(1), backend="tcp")
    prod = _stages(pcfg, pp=2, tp=1, dp_rank=0, dp_size=1, is_mla=False, starts=[0, 0])  # both hold layer 0
    cons = ConsumerWorker(ccfg, engine_id="D", host="127.0.0.1", tp_rank=0, tp_size=1, compat=compat())
    try:
        cons.register_kv_caches(make_caches(NB, 0, 1, fill=False))
        P = Engine(ConnectorScheduler(pcfg, engine_id="P", host="127.0.0.1", tp_size=1, pp_size=2, block_size=BLOCK),
                   [LocalRank(w) for w in prod], NB)
        D = Engine(ConnectorScheduler(ccfg, engine_id="D", host="127.0.0.1", tp_size=1, block_size=BLOCK),
                   [LocalRank(cons)], NB)
        params = P.prefill("r1", 20)
        D.admit("d1", 20, params)
        run_until([P, D], lambda: "d1" in D.failed and "r1" in P.freed)
        why = D.failed["d1"]
        assert "\n" not in why
        assert "cannot map the prefill's pipeline stages onto this engine's layers: layer 0 is held by " \
               "prefill stages 0 and 1" in why
    finally:
        for w in (*prod, cons):
            w.close()


def test_stages_as_processes_on_their_ports():
    """Two prefill stages of DP rank 1 (of 2), each its own process, read by a decode rank here."""
    from tests.connector.rank_proc import ProcRank, RankProcess

    pp, dp_rank, dp_size = 2, 1, 2
    base = port_range(pp * dp_size)
    procs = [RankProcess(f"stage{s}", "kv_producer", 0, 1, {"tcp": ("P", base)}, NB,
                         stage=dict(pp_rank=s, pp_size=pp, dp_rank=dp_rank, dp_size=dp_size, start_layer=s,
                                    num_layers=1))
             for s in range(pp)]
    pcfg = config("kv_producer", base, backend="tcp")
    ccfg = config("kv_consumer", port_range(1), backend="tcp")
    cons = ConsumerWorker(ccfg, engine_id="D", host="127.0.0.1", tp_rank=0, tp_size=1, compat=compat())
    try:
        for p in procs:
            p.wait_ready()
        dcache = make_caches(NB, 0, 1, fill=False)
        cons.register_kv_caches(dcache)
        ranks = [ProcRank(p, "tcp") for p in procs]
        P = Engine(ConnectorScheduler(pcfg, engine_id="P", host="127.0.0.1", tp_size=1, dp_rank=dp_rank,
                                      dp_size=dp_size, pp_size=pp, block_size=BLOCK), ranks, NB)
        D = Engine(ConnectorScheduler(ccfg, engine_id="D", host="127.0.0.1", tp_size=1, block_size=BLOCK),
                   [LocalRank(cons)], NB)
        params = P.prefill("r1", 40)
        blocks = D.admit("d1", 40, params)
        run_until([P, D], lambda: "d1" in D.ready and "r1" in P.freed
                  and all(r.stats().get("done_received", 0) >= 1 for r in ranks))
        assert check_blocks(dcache, list(zip(blocks, params["remote_block_ids"])), 0, 1, NB) == ""
        assert cons.stats()["handshakes"] == pp  # one per stage, each on its own port
        assert [r.stats().get("done_received", 0) for r in ranks] == [1, 1]
    finally:
        cons.close()
        for p in procs:
            p.stop()
