"""Executors that run a step on every tensor-parallel rank.

- :class:`LocalExecutor`: TP=1, rank 0 in the engine process.
- :class:`ProcessExecutor`: TP>1, every rank in its own worker process
  (``torch.distributed`` with gloo on 127.0.0.1), driven over pipes; each
  rank also has a wake pipe, on which its connector says it has news
  (:class:`WakePipes` turns that into the engine's wake-up). Rank 0
  creates the rendezvous store, a file (``FileStore``: no listener, where
  torch's ``TCPStore`` would listen on every interface), and reports its
  path up its pipe; the engine hands it to the other ranks. Gloo's own
  sockets stay on loopback (``GLOO_SOCKET_IFNAME=lo`` unless set), so the
  ranks open no port another host can reach. The
  engine process never joins a collective, so a dead or stuck worker shows up
  as a bounded wait that fails (:class:`WorkerFailure`) instead of a hang.
  Ranks are forked from a fork server (started by this process; it exits when
  this process does). Each rank dies with its parent (``PR_SET_PDEATHSIG``)
  and also exits when the engine process is gone.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import select
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional

from atom_kv.engine_hooks import ConnectorMetadata
from atom_kv.gc_heap import freeze_startup_heap
from atom_kv.logfmt import configure_logging, root_format
from atom_kv.reference.rank_io import ChunkTuple, RankSpec, StepResult

__all__ = ["WorkerFailure", "LocalExecutor", "ProcessExecutor", "WakePipes", "create_executor"]

log = logging.getLogger(__name__)


class WorkerFailure(RuntimeError):
    """A TP worker died, failed or did not answer in time; the engine must stop."""


class LocalExecutor:
    """Runs the single rank in this process."""

    def __init__(self, spec: RankSpec, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        from atom_kv.reference.runner import ModelRunner

        self._runner: Optional[ModelRunner] = ModelRunner(spec)

    def execute(self, chunks: list[ChunkTuple], meta: Optional[ConnectorMetadata]) -> list[StepResult]:
        if self._runner is None:
            raise WorkerFailure("executor is closed")
        return [self._runner.step(chunks, meta)]

    def set_waker(self, wake: Callable[[], None]) -> None:
        """``wake()`` runs on a connector thread whenever the rank's connector has news."""
        if self._runner is not None:
            self._runner.set_waker(wake)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _engine_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pipe_waker(fd: int) -> Callable[[], None]:
    """A rank's waker: one byte down its wake pipe (never blocks: a full pipe already wakes the engine)."""
    os.set_blocking(fd, False)

    def wake() -> None:
        try:
            os.write(fd, b"w")
        except (BlockingIOError, BrokenPipeError):
            pass

    return wake


class WakePipes:
    """Owns the engine side of the ranks' wake pipes and the named thread that waits on them:
    any byte on any of them calls ``wake()``. Stops on :meth:`close`."""

    def __init__(self, conns: list[Connection], name: str) -> None:
        self._conns = conns
        self._fds = [c.fileno() for c in conns]
        self._stop_r, self._stop_w = os.pipe()
        self._wake: Optional[Callable[[], None]] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False

    def start(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        if not self._started:
            self._started = True
            self._thread.start()

    def _run(self) -> None:
        fds = list(self._fds)
        while True:
            try:
                ready, _, _ = select.select([*fds, self._stop_r], [], [], 1.0)
            except (OSError, ValueError):
                return
            if self._stop_r in ready:
                return
            for fd in ready:
                try:
                    data = os.read(fd, 4096)
                except OSError:
                    data = b""
                if not data:  # the rank is gone; the step that notices says so
                    fds.remove(fd)
            if ready and self._wake is not None:
                self._wake()

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        if self._started:
            self._thread.join(5.0)
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)
        for conn in self._conns:
            conn.close()


def _rendezvous_store(spec: RankSpec, conn: Connection, timeout_s: float) -> Any:
    """Rank 0 creates the gloo rendezvous store in a new temporary file and reports its path to
    the engine; every other rank waits (bounded) for that path from the engine and opens it.
    The engine removes the file once every rank has started."""
    import tempfile
    from datetime import timedelta

    import torch.distributed as dist

    if spec.tp_rank == 0:
        fd, path = tempfile.mkstemp(prefix=f"atom-kv-tp-store-dp{spec.dp_rank}-")
        os.close(fd)
        store = dist.FileStore(path, spec.tp_size)
        store.set_timeout(timedelta(seconds=timeout_s))
        conn.send(("rendezvous", path))
        return store
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no rendezvous store from the engine within {timeout_s:.0f} s")
    kind, path = conn.recv()
    if kind != "rendezvous":
        raise RuntimeError(f"expected the rendezvous store, got {kind!r}")
    store = dist.FileStore(path, spec.tp_size)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def _remove_quietly(path: Any) -> None:
    try:
        os.unlink(path)
    except (OSError, TypeError):
        pass


def _worker_main(spec: RankSpec, conn: Connection, wake_conn: Connection, threads: int, parent_pid: int,
                 log_level: int, log_format: str, collective_timeout_s: float, startup_timeout_s: float) -> None:
    """Entry point of a TP worker process."""
    _die_with_parent()
    # The engine decides when a rank stops (a "stop" message, then SIGKILL); a Ctrl-C or a
    # SIGTERM sent to the whole process group must not kill a rank in the middle of a step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # the engine's --log-format; every line of this process is its engine's rank
    configure_logging(log_level, log_format, fields={"engine": spec.engine_id, "tp_rank": spec.tp_rank},
                      text_format=f"%(asctime)s %(levelname)s tp{spec.tp_rank} %(name)s: %(message)s")
    runner = None
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from atom_kv.reference.runner import ModelRunner, host_all_reduce

        torch.set_num_threads(threads)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks of one engine share a host
        dist.init_process_group(
            "gloo",
            store=_rendezvous_store(spec, conn, startup_timeout_s),
            rank=spec.tp_rank,
            world_size=spec.tp_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        runner = ModelRunner(spec, all_reduce=host_all_reduce(dist.all_reduce))
        runner.set_waker(_pipe_waker(wake_conn.fileno()))
        freeze_startup_heap()  # full collections skip the rank's start-up heap from here on
        conn.send(("ready", None))
        while True:
            if not conn.poll(1.0):
                if not _engine_alive(parent_pid):
                    break
                continue
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, chunks, meta = msg
            conn.send(("ok", runner.step(chunks, meta)))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException:  # report any failure to the engine, then exit
        try:
            conn.send(("error", traceback.format_exc(limit=8)))
        except OSError:
            pass
    finally:
        if runner is not None:
            runner.close()


class ProcessExecutor:
    """Drives ``tp_size`` worker processes; every wait is bounded by ``step_timeout_s``."""

    def __init__(self, specs: list[RankSpec], *, threads: int, startup_timeout_s: float,
                 step_timeout_s: float) -> None:
        self._step_timeout_s = step_timeout_s
        # A fork server that has imported torch once forks every rank cheaply; the engine
        # process itself never imports torch for TP > 1.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "atom_kv.reference.runner"])
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._closed = False
        self._broken: Optional[str] = None
        level, log_format = logging.getLogger().getEffectiveLevel(), root_format()  # the ranks log as the engine
        wake_readers: list[Connection] = []
        for spec in specs:
            parent_conn, child_conn = ctx.Pipe()
            wake_r, wake_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker_main,
                args=(spec, child_conn, wake_w, threads, os.getpid(), level, log_format, step_timeout_s,
                      startup_timeout_s),
                name=f"atom-kv-dp{spec.dp_rank}-tp{spec.tp_rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            wake_w.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
            wake_readers.append(wake_r)
        self._wakes = WakePipes(wake_readers, name=f"atom-kv-engine-waker-dp{specs[0].dp_rank}")
        try:
            deadline = time.monotonic() + startup_timeout_s
            (store,) = self._gather(startup_timeout_s, "report the rendezvous store", ranks=[0])
            for i, conn in enumerate(self._conns[1:], start=1):
                try:
                    conn.send(("rendezvous", store))
                except OSError:
                    raise self._fail(f"TP worker {i} is gone (exit code {self._procs[i].exitcode})") from None
            try:
                self._gather(startup_timeout_s, "start", deadline=deadline)
            finally:  # every rank has joined (or failed): the rendezvous file has served its purpose
                _remove_quietly(store)
        except BaseException:
            self.close()
            raise

    def _gather(self, timeout_s: float, what: str, ranks: Optional[list[int]] = None,
                deadline: Optional[float] = None) -> list[Any]:
        """One message from each of ``ranks`` (default: all), by ``deadline`` (default: in ``timeout_s``)."""
        ranks = list(range(len(self._conns))) if ranks is None else ranks
        results: dict[int, Any] = {}
        pending = set(ranks)
        deadline = time.monotonic() + timeout_s if deadline is None else deadline
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(f"TP workers {sorted(pending)} did not {what} within {timeout_s:.0f} s")
            waitables: list[Any] = []
            for i in pending:
                waitables += [self._conns[i], self._procs[i].sentinel]
            ready = wait(waitables, timeout=remaining)
            for i in list(pending):
                conn = self._conns[i]
                if conn in ready or conn.poll(0):
                    try:
                        kind, payload = conn.recv()
                    except (EOFError, OSError):
                        raise self._fail(f"TP worker {i} closed its pipe (exit code {self._procs[i].exitcode})") from None
                    if kind == "error":
                        raise self._fail(f"TP worker {i} failed: {payload.strip().splitlines()[-1]}")
                    results[i] = payload
                    pending.discard(i)
                elif self._procs[i].sentinel in ready:
                    self._procs[i].join(0.1)
                    raise self._fail(f"TP worker {i} died (exit code {self._procs[i].exitcode})")
        return [results[i] for i in ranks]

    def _fail(self, message: str) -> WorkerFailure:
        self._broken = message
        log.error("%s", message)
        return WorkerFailure(message)

    def execute(self, chunks: list[ChunkTuple], meta: Optional[ConnectorMetadata]) -> list[StepResult]:
        if self._broken or self._closed:
            raise WorkerFailure(self._broken or "executor is closed")
        for i, conn in enumerate(self._conns):
            try:
                conn.send(("step", chunks, meta))
            except OSError:
                raise self._fail(f"TP worker {i} is gone (exit code {self._procs[i].exitcode})") from None
        return self._gather(self._step_timeout_s, "answer a step")

    def set_waker(self, wake: Callable[[], None]) -> None:
        """``wake()`` runs on the waker thread whenever any rank's connector has news."""
        self._wakes.start(wake)

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask every worker to stop; one still running after ``timeout_s`` is killed."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self._conns:
            conn.close()
        self._wakes.close()


def create_executor(specs: list[RankSpec], *, threads: int, startup_timeout_s: float = 120.0,
                    step_timeout_s: float = 300.0) -> "LocalExecutor | ProcessExecutor":
    if len(specs) == 1:
        return LocalExecutor(specs[0], threads)
    return ProcessExecutor(specs, threads=threads, startup_timeout_s=startup_timeout_s,
                           step_timeout_s=step_timeout_s)
