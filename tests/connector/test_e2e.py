"""End to end over real processes: TP ranks as processes, real tensors, the
tcp and cma backends, every destination byte checked."""

from __future__ import annotations

import os
import random
import signal

import pytest

from atom_kv.connector import ConnectorScheduler
from atom_kv.transfer import BackendUnavailable, create_backend
from tests.connector.engines import Engine, run_until
from tests.connector.kvutil import BLOCK, config, port_range
from tests.connector.rank_proc import ProcRank, RankProcess

NB = 1100


def _cma_reason() -> str:
    try:
        create_backend("cma").close()
        return ""
    except BackendUnavailable as exc:
        return str(exc)


CMA_UNAVAILABLE = _cma_reason()
BACKENDS = ["tcp", pytest.param("cma", marks=pytest.mark.skipif(bool(CMA_UNAVAILABLE), reason=CMA_UNAVAILABLE))]


class Cluster:
    """Producer engines of TP 1 and 2, consumer engines of TP 1 and 2, each hosting a tcp and a cma worker."""

    def __init__(self) -> None:
        backends = ["tcp"] + ([] if CMA_UNAVAILABLE else ["cma"])
        self.procs: dict[str, list[RankProcess]] = {}
        self.ports: dict[tuple[str, str], int] = {}
        for name, role, tp in [("P1", "kv_producer", 1), ("P2", "kv_producer", 2),
                               ("D1", "kv_consumer", 1), ("D2", "kv_consumer", 2)]:
            engines = {}
            for b in backends:
                port = port_range(tp)
                self.ports[(name, b)] = port
                engines[b] = (f"{name}-{b}", port)
            self.procs[name] = [RankProcess(f"{name}-tp{r}", role, r, tp, engines, NB) for r in range(tp)]
        for ps in self.procs.values():
            for p in ps:
                p.wait_ready()

    def engine(self, name: str, backend: str, **overrides) -> Engine:
        role = "kv_producer" if name.startswith("P") else "kv_consumer"
        tp = len(self.procs[name])
        cfg = config(role, self.ports[(name, backend)], backend=backend, **overrides)
        sched = ConnectorScheduler(cfg, engine_id=f"{name}-{backend}", host="127.0.0.1", tp_size=tp, block_size=BLOCK)
        return Engine(sched, [ProcRank(p, backend) for p in self.procs[name]], NB)

    def close(self) -> None:
        for ps in self.procs.values():
            for p in ps:
                p.stop()


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    yield c
    c.close()


def transfer(P: Engine, D: Engine, prompts: dict[str, int], timeout_s: float = 30.0) -> dict[str, list[tuple[int, int]]]:
    """Prefill on P, load on D, until every load is ready and P freed every lease; returns block pairs."""
    pairs = {}
    for i, (rid, n) in enumerate(prompts.items()):
        params = P.prefill(f"p-{rid}", n)
        blocks = D.admit(rid, n, params)
        pairs[rid] = list(zip(blocks, params["remote_block_ids"]))
    run_until([P, D], lambda: set(D.ready) >= set(prompts) or bool(D.failed) or bool(D.recompute),
              timeout_s=timeout_s, tick_s=0.002)
    assert D.failed == {} and D.recompute == []
    mine = {f"p-{r}" for r in prompts}
    run_until([P, D], lambda: not mine & set(P.pool.held), timeout_s=timeout_s)
    assert sorted(P.freed) == sorted(f"p-{r}" for r in prompts)  # each exactly once
    return pairs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p_name,d_name", [("P1", "D1"), ("P2", "D2"), ("P2", "D1"), ("P1", "D2")])
def test_every_byte_arrives_for_each_tp_combination(cluster, backend, p_name, d_name):
    P, D = cluster.engine(p_name, backend), cluster.engine(d_name, backend)
    P.pool.alloc("offset", 7)  # producer and consumer block ids differ
    prompts = {f"{p_name}{d_name}-{n}": n for n in (3, 16, 40, 100)}
    pairs = transfer(P, D, prompts)
    for rank in D.ranks:
        for rid, pr in pairs.items():
            assert rank.check(pr) == "", (rid, rank.proc.proc.name)
    # the rest of the consumer cache was not written
    used = {lb for pr in pairs.values() for lb, _ in pr}
    assert all(r.untouched(sorted(set(range(NB - 1, NB - 50, -1)) - used)) for r in D.ranks)
    for rid in prompts:
        D.finish(rid)
    assert D.pool.held == {}
    stats = D.ranks[0].stats()
    assert stats["transfers"] >= len(prompts) and stats["failures"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_200_concurrent_requests_leave_no_blocks_held(cluster, backend):
    P, D = cluster.engine("P2", backend), cluster.engine("D2", backend)
    rng = random.Random(7)
    prompts = {f"c{i}": rng.randint(1, 80) for i in range(200)}
    pairs = transfer(P, D, prompts, timeout_s=60)
    sample = rng.sample(sorted(pairs), 20)
    for rank in D.ranks:
        assert rank.check([p for rid in sample for p in pairs[rid]]) == ""
    for rid in prompts:
        D.finish(rid)
    assert D.pool.held == {} and set(P.pool.held) <= {"offset"}
    P.step()  # hands the last `released` ids to the workers
    D.step()
    assert not P.sched.has_pending() and not D.sched.has_pending()


def test_producer_killed_mid_read(cluster):
    """tcp: the producer freezes mid-read and is killed; cma: it is dead when the read starts.
    Loads fail (policy fail) or recompute (policy recompute); aborted loads are freed; nothing leaks."""
    backends = ["tcp"] + ([] if CMA_UNAVAILABLE else ["cma"])
    engines = {}
    for b in backends:
        engines[b] = (f"PK-{b}", port_range(1))
    victim = RankProcess("PK-tp0", "kv_producer", 0, 1, engines, NB)
    victim.wait_ready()
    try:
        Ps, Ds = {}, {}
        for b in backends:
            cfg = config("kv_producer", engines[b][1], backend=b)
            Ps[b] = Engine(ConnectorScheduler(cfg, engine_id=engines[b][0], host="127.0.0.1", tp_size=1, block_size=BLOCK),
                           [ProcRank(victim, b)], NB)
            Ds[b] = cluster.engine("D1", b, load_failure_policy="fail" if b == "tcp" else "recompute")
            transfer(Ps[b], Ds[b], {f"warm-{b}": 20})  # handshake cached
            Ds[b].finish(f"warm-{b}")
        big = 60 * BLOCK
        tcp_params = [Ps["tcp"].prefill(f"pk-{i}", big) for i in range(2)]
        other = {b: Ps[b].prefill("pk-x", 40) for b in backends if b != "tcp"}
        os.kill(victim.proc.pid, signal.SIGSTOP)
        D = Ds["tcp"]
        D.admit("fail-me", big, tcp_params[0])
        abort_blocks = D.admit("abort-me", big, tcp_params[1])
        # both loads reach the rank and stay in flight there: the producer cannot answer
        run_until([D], lambda: D.ranks[0].loading() == 2, timeout_s=10)
        assert "fail-me" not in D.ready and "abort-me" not in D.ready
        D.finish("abort-me", aborted=True)
        assert "abort-me" in D.pool.held  # the backend may still write: blocks held
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.join(10)
        for b, params in other.items():
            Ds[b].admit("dead-peer", 40, params)
        run_until(list(Ds.values()), lambda: "fail-me" in D.failed and "abort-me" in D.freed
                  and all("dead-peer" in Ds[b].recompute for b in other), timeout_s=30)
        assert "abort-me" not in D.failed and D.freed.count("abort-me") == 1
        assert D.pool.held == {}
        assert abort_blocks  # were returned above
        for b in other:
            Ds[b].finish("dead-peer")  # recomputed locally, then finished normally
            assert Ds[b].pool.held == {}
        for _ in range(5):
            for d in Ds.values():
                d.step()
        assert all(not d.sched.has_pending() for d in Ds.values())
    finally:
        if victim.proc.is_alive():
            os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.join(5)
