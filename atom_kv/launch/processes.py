"""Child processes on loopback that are always stopped: each in its own process group, its
output in a log file."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
from typing import Iterator

__all__ = ["ManagedProcess", "interrupts_held", "REPO_ROOT"]

log = logging.getLogger(__name__)

#: The directory holding the ``atom_kv`` package (the repository root in a checkout).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM (main thread only) and re-deliver them when the block ends.

    A Ctrl-C landing inside ``Popen`` after the fork (or before the caller
    records the new process) would leave a child nobody stops."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    old = {s: signal.signal(s, lambda signum, _frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        if caught:
            signal.raise_signal(caught[0])


class ManagedProcess:
    """One child process in its own process group, with its output in a log file.

    :meth:`stop` sends SIGTERM to the process, then SIGKILL to its whole group
    after a timeout, so nothing is orphaned even when a caller fails half way."""

    def __init__(self, name: str, argv: list[str], log_dir: str) -> None:
        self.name = name
        self.argv = argv
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=_env(),
                                     cwd=REPO_ROOT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        """Everything the process wrote so far (stdout and stderr), undecodable bytes replaced."""
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole group at once (simulates a crash)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(5)

    def stop(self, timeout: float = 8.0, *, signalled: bool = False) -> None:
        """SIGTERM the leader (it stops its own children; not again when the
        caller already ``signalled`` it), then SIGKILL whatever is left of its
        group after ``timeout``. Idempotent."""
        if not signalled:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        try:  # the leader is gone; make sure no member of its group survives
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) did not exit", self.name, self.proc.pid)
        self._log.close()
