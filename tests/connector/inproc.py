"""Producer/consumer engines with their workers in this process (one TP rank each)."""

from __future__ import annotations

import torch

from atom_kv.connector import ConnectorScheduler, create_worker
from tests.connector.engines import Engine, LocalRank
from tests.connector.kvutil import BLOCK, compat, config, make_caches

NB = 32


def producer_engine(port: int, backend: str = "tcp", *, engine_id: str = "P", shift_regions: bool = False,
                    **overrides):
    cfg = config("kv_producer", port, backend=backend, **overrides)
    w = create_worker(cfg, engine_id=engine_id, host="127.0.0.1", tp_rank=0, tp_size=1, compat=compat(),
                      bind_host="127.0.0.1")
    caches = make_caches(NB, 0, 1, fill=True)
    pad = torch.zeros(4096, dtype=torch.uint8)
    if shift_regions:  # register something first so the KV regions get different ids
        w.backend.register_memory(pad.data_ptr(), pad.numel(), align=1)
    w.register_kv_caches(caches)
    sched = ConnectorScheduler(cfg, engine_id=engine_id, host="127.0.0.1", tp_size=1, block_size=BLOCK)
    engine = Engine(sched, [LocalRank(w)], NB)
    engine.keepalive.append(pad)  # registered memory lives as long as the engine
    return engine, w, caches


def consumer_engine(port: int, backend: str = "tcp", *, model: str = "tiny", **overrides):
    cfg = config("kv_consumer", port, backend=backend, **overrides)
    w = create_worker(cfg, engine_id="D", host="127.0.0.1", tp_rank=0, tp_size=1, compat=compat(model=model))
    caches = make_caches(NB, 0, 1, fill=False)
    w.register_kv_caches(caches)
    sched = ConnectorScheduler(cfg, engine_id="D", host="127.0.0.1", tp_size=1, block_size=BLOCK)
    return Engine(sched, [LocalRank(w)], NB), w, caches
