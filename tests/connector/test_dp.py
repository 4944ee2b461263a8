"""Data parallel on both sides at the connector level: a decode DP rank reads
from exactly the prefill DP rank its request names (``remote_dp_rank``), over
that rank's TP ranks, and done/release notices go to that rank only."""

from __future__ import annotations

import pytest

from atom_kv.connector import ConnectorScheduler, ConsumerWorker, ProducerWorker
from tests.connector.engines import Engine, LocalRank, run_until
from tests.connector.kvutil import BLOCK, check_blocks, compat, config, make_caches, port_range

NB = 16


def _caches(tp_rank: int, tp_size: int, *, fill: bool, is_mla: bool, poison: bool = False):
    caches = make_caches(NB, tp_rank, tp_size, fill=fill, is_mla=is_mla)
    if poison:  # another DP rank's KV: what a read from the wrong rank would bring
        for entry in caches:
            for t in (entry,) if is_mla else entry:
                t.add_(1e6)
    return caches


# (prefill DP, prefill TP, decode DP, decode TP)
SHAPES = [(2, 2, 2, 1), (2, 1, 2, 2), (2, 2, 1, 2), (2, 1, 1, 2), (1, 2, 2, 1)]


@pytest.mark.parametrize("is_mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("p_dp,p_tp,d_dp,d_tp", SHAPES, ids=[f"P{a}x{b}-D{c}x{d}" for a, b, c, d in SHAPES])
def test_decode_rank_reads_only_the_named_prefill_rank(is_mla, p_dp, p_tp, d_dp, d_tp):
    p_base, d_base = port_range(p_dp * p_tp), port_range(d_dp * d_tp)
    pcfg = config("kv_producer", p_base, backend="tcp")
    ccfg = config("kv_consumer", d_base, backend="tcp")
    cinfo = compat(is_mla=is_mla)
    workers = []
    try:
        prefill = []
        for dp in range(p_dp):
            ranks = [ProducerWorker(pcfg, engine_id=f"P-dp{dp}", host="127.0.0.1", tp_rank=r, tp_size=p_tp,
                                    dp_rank=dp, dp_size=p_dp, compat=cinfo) for r in range(p_tp)]
            workers += ranks
            for r, w in enumerate(ranks):
                w.register_kv_caches(_caches(r, p_tp, fill=True, is_mla=is_mla, poison=dp != p_dp - 1))
            sched = ConnectorScheduler(pcfg, engine_id=f"P-dp{dp}", host="127.0.0.1", tp_size=p_tp, dp_rank=dp,
                                       block_size=BLOCK)
            prefill.append((Engine(sched, [LocalRank(w) for w in ranks], NB), ranks))
        decode = []
        for dp in range(d_dp):
            ranks = [ConsumerWorker(ccfg, engine_id=f"D-dp{dp}", host="127.0.0.1", tp_rank=r, tp_size=d_tp,
                                    dp_rank=dp, dp_size=d_dp, compat=cinfo) for r in range(d_tp)]
            workers += ranks
            caches = [_caches(r, d_tp, fill=False, is_mla=is_mla) for r in range(d_tp)]
            for w, c in zip(ranks, caches):
                w.register_kv_caches(c)
            sched = ConnectorScheduler(ccfg, engine_id=f"D-dp{dp}", host="127.0.0.1", tp_size=d_tp, dp_rank=dp,
                                       block_size=BLOCK)
            decode.append((Engine(sched, [LocalRank(w) for w in ranks], NB), ranks, caches))
        P, p_ranks = prefill[-1]
        D, d_ranks, d_caches = decode[-1]
        P.pool.alloc("offset", 2)
        params = P.prefill("r1", 40)
        assert params["remote_dp_rank"] == p_dp - 1 and params["remote_engine_id"] == f"P-dp{p_dp - 1}"
        blocks = D.admit("d1", 40, params)
        engines = [e for e, *_ in prefill] + [e for e, *_ in decode]
        # a rank's share is freed on its first notice (done or release); the other notice may still be in flight
        run_until(engines, lambda: "d1" in D.ready and "r1" in P.freed
                  and all(w.stats().get("releases_received", 0) >= 1 for w in p_ranks))
        pairs = list(zip(blocks, params["remote_block_ids"]))
        for r, c in enumerate(d_caches):
            assert check_blocks(c, pairs, 0 if is_mla else r, 1 if is_mla else d_tp, NB, is_mla=is_mla) == ""
        # the named prefill DP rank's TP ranks took every notice; the other DP rank heard nothing
        for _, other in prefill[:-1]:
            assert [w.stats().get("done_received", 0) for w in other] == [0] * p_tp
            assert [w.stats().get("releases_received", 0) for w in other] == [0] * p_tp
        assert sum(w.stats().get("done_received", 0) for w in p_ranks) >= 1
        assert [w.stats().get("releases_received", 0) for w in p_ranks] == [1] * p_tp
        # the decode DP rank that did not take the request read nothing
        for _, ranks, _ in decode[:-1]:
            assert all(w.stats().get("handshakes", 0) == 0 for w in ranks)
    finally:
        for w in workers:
            w.close()
