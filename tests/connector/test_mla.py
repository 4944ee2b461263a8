"""MLA caches (one latent per token, replicated on every rank): a consumer
rank reads the latent from a single producer rank, and every producer rank
still learns that the transfer is over (the consumer's release)."""

from atom_kv.connector import ConnectorScheduler, ConsumerWorker, ProducerWorker
from tests.connector.engines import Engine, LocalRank, run_until
from tests.connector.kvutil import BLOCK, check_blocks, compat, config, make_caches, port_range

NB = 16


def test_mla_latent_from_one_producer_rank_of_two():
    base = port_range(2)
    pcfg = config("kv_producer", base, backend="tcp")
    ccfg = config("kv_consumer", base, backend="tcp")
    mla = compat(is_mla=True)
    pws = [ProducerWorker(pcfg, engine_id="P", host="127.0.0.1", tp_rank=r, tp_size=2, compat=mla,
                          bind_host="127.0.0.1") for r in range(2)]
    cw = ConsumerWorker(ccfg, engine_id="D", host="127.0.0.1", tp_rank=0, tp_size=1, compat=mla)
    try:
        for pw in pws:
            pw.register_kv_caches(make_caches(NB, 0, 1, fill=True, is_mla=True))
        dcache = make_caches(NB, 0, 1, fill=False, is_mla=True)
        cw.register_kv_caches(dcache)
        P = Engine(ConnectorScheduler(pcfg, engine_id="P", host="127.0.0.1", tp_size=2, block_size=BLOCK),
                   [LocalRank(w) for w in pws], NB)
        D = Engine(ConnectorScheduler(ccfg, engine_id="D", host="127.0.0.1", tp_size=1, block_size=BLOCK),
                   [LocalRank(cw)], NB)
        P.pool.alloc("offset", 3)
        params = P.prefill("r1", 50)
        blocks = D.admit("d1", 50, params)
        # a rank's share is freed on its first notice (done or release); the other notice may still be in flight
        run_until([P, D], lambda: "d1" in D.ready and "r1" in P.freed
                  and all(pw.stats().get("releases_received", 0) >= 1 for pw in pws))
        pairs = list(zip(blocks, params["remote_block_ids"]))
        assert check_blocks(dcache, pairs, 0, 1, NB, is_mla=True) == ""
        assert cw.stats()["handshakes"] == 1  # only rank 0 was read from
        assert [pw.stats()["done_received"] for pw in pws] == [1, 0]  # the rank read from confirmed
        assert [pw.stats()["releases_received"] for pw in pws] == [1, 1]  # and both were released
    finally:
        for w in (*pws, cw):
            w.close()
