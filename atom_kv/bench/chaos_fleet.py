"""The chaos soak's fleet: two proxies, two prefill and two decode reference engines, each on a host of its own.

Every host is a network namespace on a private bridge (:mod:`atom_kv.testing.netns`), and each engine also
runs under its own pid, mount and UTS namespace, as in ``tests/e2e/test_multihost.py``: the engines see
separate hosts, so ``auto`` reads over ``tcp``. Every engine registers with both proxies (``proxy_ip``
lists both), signed with a token made up for the run; the client host sends the traffic. An engine or a
proxy is started again on the same host and ports after a kill (:meth:`ChaosFleet.restart`). The decode
engines run with the test-only read fault injector on (``ATOM_KV_FAULT_INJECT_READ_FAIL``) when asked.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from atom_kv.launch.token_files import write_token_file
from atom_kv.launch.web import http_json
from atom_kv.testing.netns import Hosts, NsProcess
from atom_kv.transfer.fault_injector import READ_FAIL_ENV, SEED_ENV

__all__ = ["ENGINES", "PROXIES", "ChaosFleet", "Incarnation", "Settings"]

PROXY_PORT, DISCOVERY_PORT = 10001, 36367
ENGINE_PORT, HANDSHAKE_PORT = 8000, 6301
PROXIES = ("proxy1", "proxy2")
ENGINES = ("prefill1", "prefill2", "decode1", "decode2")


@dataclass(frozen=True)
class Settings:
    """The timeouts every process of the soak runs with (short, so a fault shows within seconds)."""

    read_fail: float = 0.0
    seed: int = 0
    num_blocks: int = 128
    ping_interval_s: float = 0.5
    heartbeat_s: float = 3.0
    abort_timeout_s: float = 8.0
    handshake_timeout_s: float = 3.0
    connect_timeout_s: float = 2.0
    transfer_timeout_s: float = 4.0
    prefill_timeout_s: float = 20.0
    decode_timeout_s: float = 15.0


@dataclass
class Incarnation:
    """One start of one process: its log, when it started, and its RSS samples ``(t, bytes)``."""

    name: str
    proc: NsProcess
    started: float
    rss: list[tuple[float, int]] = field(default_factory=list)


class ChaosFleet:
    """Owns the hosts and every process the soak starts on them (each start an :class:`Incarnation`)."""

    def __init__(self, log_dir: str, settings: Settings) -> None:
        self.settings = settings
        # the fleet's secret, in a file only its owner may read: no process list shows it
        self.token_file = write_token_file(os.path.join(log_dir, "token"), secrets.token_hex(16))
        self.hosts = Hosts([*PROXIES, *ENGINES, "client"], log_dir)
        self.current: dict[str, Incarnation] = {}
        self.history: list[Incarnation] = []
        self._starts = 0
        self._lock = threading.Lock()

    # -- start and stop ------------------------------------------------------
    def start(self, timeout: float) -> "ChaosFleet":
        self.hosts.build()
        for name in (*PROXIES, *ENGINES):
            self._spawn(name)
        if self.wait_ready(list(ENGINES) + list(PROXIES), timeout) is None:
            raise RuntimeError(f"the fleet was not up within {timeout:.0f} s (every engine serving, both proxies "
                               f"holding all four up); the logs are in {self.log_dir()}")
        return self

    def close(self) -> None:
        self.hosts.close()

    def role(self, name: str) -> str:
        return "proxy" if name in PROXIES else ("P" if name.startswith("prefill") else "D")

    def _argv(self, name: str) -> tuple[list[str], Optional[dict[str, str]]]:
        s, addr = self.settings, self.hosts.addr[name]
        if name in PROXIES:
            return [
                sys.executable, "-m", "atom_kv.proxy", "--host", addr, "--port", str(PROXY_PORT),
                "--discovery-port", str(DISCOVERY_PORT), "--registration-token-file", self.token_file,
                "--heartbeat-timeout", str(s.heartbeat_s), "--probe-interval", "1.0", "--probe-timeout", "1.0",
                "--connect-timeout", str(s.connect_timeout_s), "--prefill-timeout", str(s.prefill_timeout_s),
                "--decode-timeout", str(s.decode_timeout_s), "--log-level", "INFO"], None
        role = self.role(name)
        config = {
            "kv_role": "kv_producer" if role == "P" else "kv_consumer", "backend": "auto",
            "handshake_port": HANDSHAKE_PORT, "auth_token_file": self.token_file,
            "proxy_ip": ",".join(self.hosts.addr[p] for p in PROXIES), "ping_interval_s": s.ping_interval_s,
            "abort_timeout_s": s.abort_timeout_s, "handshake_timeout_s": s.handshake_timeout_s,
            "connect_timeout_s": s.connect_timeout_s, "transfer_timeout_s": s.transfer_timeout_s,
        }
        env = None
        if role == "D" and s.read_fail > 0:
            env = {READ_FAIL_ENV: str(s.read_fail), SEED_ENV: str(s.seed * 100 + self._starts)}
        return [
            sys.executable, "-m", "atom_kv.reference", "--host", addr, "--port", str(ENGINE_PORT),
            "--num-blocks", str(s.num_blocks), "--log-level", "INFO",
            "--kv-transfer-config", json.dumps(config)], env

    def _spawn(self, name: str) -> Incarnation:
        argv, env = self._argv(name)
        with self._lock:
            self._starts += 1
            proc = self.hosts.spawn(name, f"{name}-{self._starts}", argv, env=env)
            inc = Incarnation(proc.name, proc, time.monotonic())
            self.current[name] = inc
            self.history.append(inc)
        return inc

    def kill(self, name: str) -> None:
        """SIGKILL ``name``'s process (and everything of its group), as a crash."""
        self.current[name].proc.kill()

    def restart(self, name: str) -> Incarnation:
        """``name`` started again on its host and ports (its old process must be gone)."""
        return self._spawn(name)

    # -- what the fleet says ----------------------------------------------------
    def url(self, name: str) -> str:
        return f"http://{self.hosts.addr[name]}:{PROXY_PORT if name in PROXIES else ENGINE_PORT}"

    def get(self, url: str, timeout: float = 3.0) -> tuple[int, Any]:
        """A GET from the client host; ``(0, error)`` when it could not connect or timed out."""
        try:
            return self.hosts.submit("client", http_json, "GET", url, None, timeout).result(timeout + 2.0)
        except Exception as exc:  # any failure to ask is "not answered"
            return 0, f"{type(exc).__name__}: {exc}"

    def engine_ids(self) -> dict[str, str]:
        """Each engine's id, for those that answer ``/health`` now."""
        ids = {}
        for name in ENGINES:
            status, body = self.get(self.url(name) + "/health")
            if status == 200 and isinstance(body, dict):
                ids[name] = body.get("engine_id", "")
        return ids

    def up_on(self, proxy: str) -> set[str]:
        """The engine ids ``proxy`` holds as up."""
        status, body = self.get(self.url(proxy) + "/instances")
        if status != 200 or not isinstance(body, list):
            return set()
        return {i["engine_id"] for i in body if i.get("state") == "up"}

    def ready(self, names: list[str]) -> bool:
        """Whether every process in ``names`` runs, every engine in it serves and every running proxy holds
        it up; with a proxy in ``names``, that proxy holds all four engines up."""
        if any(not self.current[n].proc.alive() for n in names):
            return False
        ids = self.engine_ids()
        if any(n in ENGINES and n not in ids for n in names):
            return False
        if any(n in PROXIES for n in names):
            if len(ids) < len(ENGINES):
                return False
            wanted = set(ids.values())
        else:
            wanted = {ids[n] for n in names}
        return all(wanted <= self.up_on(p) for p in PROXIES if self.current[p].proc.alive())

    def wait_ready(self, names: list[str], timeout: float, stop: Optional[threading.Event] = None) -> Optional[float]:
        """Until :meth:`ready` (the time it was, monotonic) or ``timeout`` (None); checked twice a second."""
        deadline = time.monotonic() + timeout
        waiter = stop or threading.Event()
        while time.monotonic() < deadline:
            if self.ready(names):
                return time.monotonic()
            for name in names:
                proc = self.current[name].proc
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.tail(30)}")
            if waiter.wait(0.5):
                return None
        return None

    def blocks(self) -> dict[str, dict]:
        """Each engine's ``kv_blocks`` (free and total) from its ``/health``; ``{}`` for one that does not answer."""
        out = {}
        for name in ENGINES:
            status, body = self.get(self.url(name) + "/health")
            out[name] = body.get("kv_blocks", {}) if status == 200 and isinstance(body, dict) else {}
        return out

    def sample_rss(self) -> None:
        """One RSS sample of every running process (its main process, under ``unshare``)."""
        now = time.monotonic()
        for inc in list(self.current.values()):
            if not inc.proc.alive():
                continue
            try:
                pid = inc.proc.init_pid(timeout=0.5)
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            inc.rss.append((now, int(line.split()[1]) * 1024))
                            break
            except (OSError, RuntimeError, ValueError):
                continue

    def logs(self) -> dict[str, str]:
        """Every incarnation's log, by its name."""
        out = {}
        for inc in self.history:
            try:
                out[inc.name] = inc.proc.log_text()
            except OSError:
                out[inc.name] = ""
        return out

    def log_dir(self) -> str:
        return os.path.abspath(self.hosts.log_dir)
