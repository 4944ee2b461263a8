"""A TP rank as its own process: hosts one connector worker per backend
(two engines in one process) and obeys commands from the test over a pipe.

Rank processes are forked from multiprocessing's forkserver with torch and the
connector imported once (a spawned one spent seconds importing torch each);
importing torch initialises no CUDA, so each rank still starts its own."""

from __future__ import annotations

import logging
import multiprocessing as mp
from typing import Any

from atom_kv.connector.types import ConnectorMetadata, KVConnectorOutput

REPLY_TIMEOUT_S = 30.0

#: what the forkserver imports once, before it forks any rank process
PRELOAD = ["torch", "atom_kv.connector", "atom_kv.transfer.tcp", "tests.connector.kvutil", "tests.connector.rank_proc"]


def rank_main(conn, spec: dict[str, Any]) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank-proc {spec['name']} %(levelname)s %(name)s: %(message)s")
    from atom_kv.connector import create_worker
    from tests.connector.kvutil import check_blocks, compat, config, make_caches, untouched

    producer = spec["role"] == "kv_producer"
    workers, caches = {}, {}
    try:
        for backend, (engine_id, port) in spec["engines"].items():
            cfg = config(spec["role"], port, backend=backend, **spec.get("overrides", {}))
            stage = spec.get("stage", {})  # a pipeline stage: pp_rank, pp_size, dp_*, start_layer, num_layers
            w = create_worker(cfg, engine_id=engine_id, host="127.0.0.1", tp_rank=spec["tp_rank"],
                              tp_size=spec["tp_size"], compat=compat(), bind_host="127.0.0.1",
                              **{k: v for k, v in stage.items() if k != "num_layers"})
            c = make_caches(spec["num_blocks"], spec["tp_rank"], spec["tp_size"], fill=producer)
            if stage:
                first = stage.get("start_layer", 0)
                c = c[first:first + stage["num_layers"]]
            w.register_kv_caches(c)
            workers[backend], caches[backend] = w, c
        conn.send(("ready", None))
    except Exception as exc:  # report, don't hang the test
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            for w in workers.values():
                w.close()
            conn.send(None)
            return
        backend = args[0]
        if cmd == "step":
            w = workers[backend]
            w.start_load_kv(args[1])
            conn.send(w.get_finished())
        elif cmd == "check":
            conn.send(check_blocks(caches[backend], args[1], spec["tp_rank"], spec["tp_size"], spec["num_blocks"]))
        elif cmd == "untouched":
            conn.send(untouched(caches[backend], args[1]))
        elif cmd == "stats":
            conn.send(workers[backend].stats())
        elif cmd == "loading":
            conn.send(workers[backend].num_loading())


class RankProcess:
    """The test's handle on one rank process."""

    def __init__(self, name: str, role: str, tp_rank: int, tp_size: int, engines: dict[str, tuple[str, int]],
                 num_blocks: int, overrides: dict | None = None, stage: dict | None = None) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # only takes effect if this process's forkserver is not running yet
        self.conn, child = ctx.Pipe()
        spec = dict(name=name, role=role, tp_rank=tp_rank, tp_size=tp_size, engines=engines,
                    num_blocks=num_blocks, overrides=overrides or {}, stage=stage or {})
        self.proc = ctx.Process(target=rank_main, args=(child, spec), name=name, daemon=True)
        self.proc.start()
        child.close()

    def wait_ready(self) -> None:
        status, err = self.call_raw(timeout=60)
        assert status == "ready", err

    def call_raw(self, timeout: float = REPLY_TIMEOUT_S):
        if not self.conn.poll(timeout):
            raise AssertionError(f"{self.proc.name} did not answer within {timeout} s")
        return self.conn.recv()

    def call(self, *msg):
        self.conn.send(msg)
        return self.call_raw()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop")
            except (OSError, EOFError, AssertionError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class ProcRank:
    """One backend's worker inside a rank process, as an engine rank."""

    def __init__(self, proc: RankProcess, backend: str) -> None:
        self.proc = proc
        self.backend = backend

    def step(self, meta: ConnectorMetadata) -> KVConnectorOutput:
        return self.proc.call("step", self.backend, meta)

    def check(self, pairs) -> str:
        return self.proc.call("check", self.backend, pairs)

    def untouched(self, blocks) -> bool:
        return self.proc.call("untouched", self.backend, blocks)

    def stats(self) -> dict:
        return self.proc.call("stats", self.backend)

    def loading(self) -> int:
        """Loads this (consumer) rank has started and not yet reported."""
        return self.proc.call("loading", self.backend)
