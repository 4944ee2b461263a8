"""Launch a proxy and reference engines as real processes on loopback, and stop them cleanly.

Every process runs in its own session (process group); :meth:`ManagedProcess.stop`
sends SIGTERM to the process, then SIGKILL to its whole group after a timeout,
so nothing is orphaned even when a test or the demo fails half way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

__all__ = [
    "free_port",
    "free_port_range",
    "ManagedProcess",
    "EngineSpec",
    "Cluster",
    "http_json",
    "wait_until",
    "scrape_metrics",
]

log = logging.getLogger(__name__)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int, attempts: int = 200) -> int:
    """A base port such that ``base .. base+n-1`` are all free right now."""
    for _ in range(attempts):
        base = random.randint(20000, 60000 - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = _REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
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
    """One child process in its own process group, with its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_dir: str) -> None:
        self.name = name
        self.argv = argv
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=_env(),
                                     cwd=_REPO_ROOT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

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

    def stop(self, timeout: float = 8.0) -> None:
        """SIGTERM the leader (it stops its own children), then SIGKILL whatever is left
        of its group after ``timeout``. Idempotent."""
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


def http_json(method: str, url: str, body: Optional[dict] = None, timeout: float = 30.0,
              headers: Optional[dict[str, str]] = None) -> tuple[int, Any]:
    """A small blocking HTTP JSON call; returns ``(status, parsed body or text)``."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_until(predicate, timeout: float, interval: float = 0.2, what: str = "condition") -> Any:
    """Poll ``predicate`` (bounded, with a sleep between tries) until it returns a truthy value."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except (OSError, urllib.error.URLError):
            value = None
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def scrape_metrics(url: str, timeout: float = 5.0) -> dict[str, float]:
    """Prometheus text -> ``{"name{labels}": value}``, plus ``name`` summed over label sets."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        out[key] = v
        name = key.split("{", 1)[0]
        if "{" in key:
            sums[name] = sums.get(name, 0.0) + v
    for name, v in sums.items():
        out.setdefault(name, v)
    return out


@dataclass
class EngineSpec:
    """One reference engine to launch."""

    role: str  # "P", "D" or "colocated"
    tp: int = 1
    num_blocks: int = 256
    backend: str = "auto"
    extra_config: dict = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    register: bool = True  # P/D engines: register with the cluster's proxy


class Cluster:
    """A proxy plus prefill and decode engines (or one colocated engine), all on 127.0.0.1."""

    def __init__(self, engines: list[EngineSpec], *, with_proxy: bool = True, heartbeat_timeout: float = 3.0,
                 ping_interval_s: float = 0.5, log_dir: Optional[str] = None,
                 proxy_args: Optional[list[str]] = None) -> None:
        self.specs = engines
        self.with_proxy = with_proxy
        self.heartbeat_timeout = heartbeat_timeout
        self.ping_interval_s = ping_interval_s
        self.proxy_args = proxy_args or []
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="atom-kv-cluster-")
        self.proxy: Optional[ManagedProcess] = None
        self.proxy_port = 0
        self.discovery_port = 0
        self.engines: list[ManagedProcess] = []
        self.ports: list[int] = []
        self._argvs: list[list[str]] = []

    # ------------------------------------------------------------------ launching
    def engine_argv(self, i: int) -> list[str]:
        spec = self.specs[i]
        argv = [sys.executable, "-m", "atom_kv.reference", "--host", "127.0.0.1", "--port", str(self.ports[i]),
                "--tp", str(spec.tp), "--num-blocks", str(spec.num_blocks), "--log-level", "INFO",
                "--instance-index", str(i), *spec.extra_args]
        if spec.role in ("P", "D"):
            cfg: dict[str, Any] = {
                "kv_role": "kv_producer" if spec.role == "P" else "kv_consumer",
                "backend": spec.backend,
                "handshake_port": free_port_range(spec.tp),
                "ping_interval_s": self.ping_interval_s,
            }
            if self.with_proxy and spec.register:
                cfg["proxy_ip"] = "127.0.0.1"
                cfg["proxy_ping_port"] = self.discovery_port
            cfg.update(spec.extra_config)
            argv += ["--kv-transfer-config", json.dumps(cfg)]
        return argv

    def start(self, timeout: float = 90.0) -> "Cluster":
        try:
            if self.with_proxy:
                self.proxy_port, self.discovery_port = free_port(), free_port()
                with _interrupts_held():
                    self.proxy = ManagedProcess("proxy", [
                        sys.executable, "-m", "atom_kv.proxy", "--host", "127.0.0.1", "--port", str(self.proxy_port),
                        "--discovery-host", "127.0.0.1", "--discovery-port", str(self.discovery_port),
                        "--heartbeat-timeout", str(self.heartbeat_timeout), *self.proxy_args], self.log_dir)
            self.ports = [free_port() for _ in self.specs]
            for i, spec in enumerate(self.specs):
                argv = self.engine_argv(i)
                self._argvs.append(argv)
                with _interrupts_held():
                    self.engines.append(ManagedProcess(f"engine{i}-{spec.role}", argv, self.log_dir))
            for i in range(len(self.specs)):
                self.wait_engine(i, timeout)
            if self.with_proxy:
                self.wait_registered(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def restart_engine(self, i: int, timeout: float = 90.0) -> None:
        """Start engine ``i`` again with the same command line (after a kill)."""
        with _interrupts_held():
            self.engines[i] = ManagedProcess(f"engine{i}-{self.specs[i].role}-restart", self._argvs[i], self.log_dir)
        self.wait_engine(i, timeout)

    def wait_engine(self, i: int, timeout: float) -> None:
        proc = self.engines[i]

        def ready() -> bool:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.tail()}")
            status, _ = http_json("GET", self.engine_url(i) + "/health", timeout=2.0)
            return status == 200

        wait_until(ready, timeout, what=f"{proc.name} /health")

    def wait_registered(self, timeout: float) -> dict:
        n_p = sum(1 for s in self.specs if s.role == "P" and s.register)
        n_d = sum(1 for s in self.specs if s.role == "D" and s.register)

        def ready() -> Optional[dict]:
            if self.proxy is not None and not self.proxy.alive():
                raise RuntimeError(f"proxy exited with {self.proxy.proc.returncode}:\n{self.proxy.tail()}")
            status, body = http_json("GET", self.proxy_url + "/health", timeout=2.0)
            if status != 200 or not isinstance(body, dict):
                return None
            if body.get("prefill", 0) >= n_p and body.get("decode", 0) >= n_d:
                return body
            return None

        return wait_until(ready, timeout, what=f"{n_p} prefill and {n_d} decode engines to register with the proxy")

    # ------------------------------------------------------------------ addresses
    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def engine_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def index_of(self, role: str, nth: int = 0) -> int:
        return [i for i, s in enumerate(self.specs) if s.role == role][nth]

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop every process (engines first, in parallel, then the proxy). Idempotent."""
        for proc in self.engines:
            if proc.alive():
                proc.proc.send_signal(signal.SIGTERM)
        for proc in self.engines:
            proc.stop()
        if self.proxy is not None:
            self.proxy.stop()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
