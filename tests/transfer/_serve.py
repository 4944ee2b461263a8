"""A serving process for the transfer tests: builds a backend from a
``BackendSpec`` (by name), registers a buffer filled with a known pattern and
hands its descriptor back over a pipe, then serves until told to stop or
killed.

Serving processes are forked from multiprocessing's forkserver with this module,
the spec registry, the transfer backends and torch (the host seam's tensors)
imported once: a fresh interpreter per process, as "spawn" makes, costs two
seconds or more of imports each time. Importing torch initialises no CUDA, so a
child on a GPU machine still starts its own."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any, Optional

import numpy as np

SEED = 1234

#: what the forkserver imports once, before it forks any serving process
PRELOAD = ["numpy", "torch", "atom_kv.config", "atom_kv.transfer", "atom_kv.transfer.tcp", "atom_kv.transfer.gpu_ipc",
           "tests.transfer.backends", "tests.transfer._serve"]


def serving_context() -> Any:
    """The multiprocessing context serving processes start in: the forkserver, with :data:`PRELOAD`
    (which only takes effect if the forkserver of this process is not running yet)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def pattern(size: int, seed: int = SEED) -> np.ndarray:
    """The bytes the serving process registers (the reader regenerates them)."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def place(data: np.ndarray, device: str) -> tuple[Any, int, Any]:
    """``data`` where a spec keeps its memory: (buffer, its address, its memory kind)."""
    buf, ptr, memory, _ = place_owned(data, device)
    return buf, ptr, memory


def place_owned(data: np.ndarray, device: str) -> tuple[Any, int, Any, Any]:
    """:func:`place`, plus what owns the memory (a memfd's :class:`SharedBuffer`, else None)."""
    from atom_kv.transfer.memory import memory_of

    if device == "cpu":
        return data, data.ctypes.data, memory_of(data), None
    if device == "memfd":
        from atom_kv.transfer.gpu_ipc.host_seam import shared_buffer

        owner = shared_buffer(data.nbytes)
        owner.array[:] = data
        return owner.array, owner.array.ctypes.data, memory_of(owner.array), owner
    import torch

    t = torch.from_numpy(data).to(device)
    return t, t.data_ptr(), memory_of(t), None


def _serve(spec_name: str, config: dict[str, Any], size: int, align: int, region_limit: int, conn: Any) -> None:
    try:
        from tests.transfer.backends import by_name

        spec = by_name(spec_name)
        spec.run_setup()
        from atom_kv.config import KVTransferConfig
        cfg = KVTransferConfig.from_dict({"kv_role": "kv_producer", **spec.config, **config})
        backend = spec.create(cfg, host="127.0.0.1", key=f"serve-{spec_name}-{os.getpid()}")
        buf, ptr, memory = place(pattern(size), spec.device)
        backend.max_region_bytes = region_limit
        spec.prepare(backend)
        ids = backend.register_memory(ptr, size, align=align, memory=memory)
        conn.send(("ready", backend.export_descriptor(), ids, os.getpid()))
    except Exception as exc:  # reported to the test, which fails with it
        conn.send(("error", f"{type(exc).__name__}: {exc}", [], os.getpid()))
        return
    while True:
        if conn.poll(1.0):
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg == "stop":
                break
    backend.close()
    conn.send(("stopped", b"", [], os.getpid()))


class ServerProc:
    """A spawned serving process and what it exported."""

    def __init__(
        self, spec_name: str, *, size: int, align: int, region_limit: int, config: Optional[dict[str, Any]] = None
    ) -> None:
        ctx = serving_context()
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve, args=(spec_name, config or {}, size, align, region_limit, child),
            name=f"serve-{spec_name}", daemon=True,
        )
        self.proc.start()
        child.close()
        if not self._conn.poll(60):
            self.kill()
            raise RuntimeError(f"serving process for {spec_name} did not start within 60 s")
        status, desc, ids, pid = self._conn.recv()
        if status != "ready":
            self.kill()
            raise RuntimeError(f"serving process for {spec_name} failed: {desc}")
        self.descriptor: bytes = desc
        self.region_ids: list[int] = ids
        self.pid: int = pid
        self.size = size

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send("stop")
                deadline = time.monotonic() + 10
                while self.proc.is_alive() and time.monotonic() < deadline:
                    self.proc.join(0.5)
            except (BrokenPipeError, OSError):
                pass
        self.kill()
        self._conn.close()
