"""Real processes for the proxy tests: ``python -m atom_kv.proxy`` and the fake engines, on OS-assigned ports."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT)

_READY = re.compile(r"proxy ready on http://[^:]+:(\d+)(?:, discovery on tcp://[^:]+:(\d+))?")


class _LineReader:
    """Reads a child's output lines on a named thread (stops at EOF), so a test can wait for one."""

    def __init__(self, stream, name: str) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(stream,), name=name, daemon=True)
        self._thread.start()

    def _run(self, stream) -> None:
        for line in stream:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, proc: subprocess.Popen, pattern: re.Pattern, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise TimeoutError(f"no line matching {pattern.pattern!r} (exit {proc.poll()}):\n{''.join(self.lines)}")
            match = pattern.search(line)
            if match:
                return match

    def text(self, timeout: float = 5.0) -> str:
        """Everything read so far, after the child closed its end (call once it exited)."""
        self._thread.join(timeout)
        return "".join(self.lines)


class ProxyProcess:
    """``python -m atom_kv.proxy`` on port 0; reads its ports back from its ready line. ``env``: variables
    added to its environment."""

    def __init__(self, *args: str, timeout: float = 15.0, host: str | None = "127.0.0.1",
                 env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "atom_kv.proxy", *(("--host", host) if host is not None else ()), "--port", "0",
               *args]
        if "--no-discovery" not in args and "--discovery-port" not in args:
            cmd += ["--discovery-port", "0"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, **(env or {})}, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.output = _LineReader(self.proc.stderr, "test-proxy-stderr")
        try:
            match = self.output.wait_for(self.proc, _READY, timeout)
        except BaseException:
            self.kill()
            raise
        self.port = int(match.group(1))
        self.discovery_port = int(match.group(2)) if match.group(2) else None
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def discovery(self) -> str:
        return f"tcp://127.0.0.1:{self.discovery_port}"

    @property
    def lines(self) -> list[str]:
        return self.output.lines

    def stderr_rest(self) -> str:
        """Everything the process wrote (call after it exited)."""
        return self.output.text()

    def terminate(self, timeout: float = 10.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class FakeEngines:
    """``python -m atom_kv.testing.fake_engine`` in its own process; ``prefill``/``decode`` are its URLs."""

    _READY = re.compile(r"ready prefill=(\S*) decode=(\S*)")

    def __init__(self, *args: str, timeout: float = 15.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "atom_kv.testing.fake_engine", *args], cwd=ROOT, env=ENV,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.output = _LineReader(self.proc.stdout, "test-fake-engines-stdout")
        try:
            match = self.output.wait_for(self.proc, self._READY, timeout)
        except BaseException:
            self.kill()
            raise
        self.prefill = [u for u in match.group(1).split(",") if u]
        self.decode = [u for u in match.group(2).split(",") if u]

    def kill(self) -> None:
        """SIGKILL: the engines vanish mid-request, as a crashed engine does."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")
