"""A proxy and reference engines as real processes on 127.0.0.1, started and stopped as one.

Engines bind HTTP port 0 and report the port they got through a port file
(``--port-file``), so no engine port is guessed; the proxy and the engines'
handshake ports are still picked free beforehand (those servers cannot
report a port yet).

Registration is signed, as in production: by default the cluster makes up a
secret and writes it to a file only its owner may read (``token_file``, in the
log directory), given to the proxies as ``--registration-token-file`` and to
every P/D engine as ``auth_token_file``, so no process list shows it. An
engine spec or proxy flags that set the token themselves (``auth_token``,
``--registration-token``: the inline form) are left as they are.
``token=None`` runs without one, and then the proxies are started with
``--allow-open-registration`` (said explicitly).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional

from atom_kv.launch.polling import wait_until
from atom_kv.launch.ports import free_plan_base, free_port
from atom_kv.launch.processes import ManagedProcess, interrupts_held
from atom_kv.launch.token_files import write_token_file
from atom_kv.launch.web import http_json

__all__ = ["EngineSpec", "Cluster", "AUTO_TOKEN"]

#: ``Cluster(token=AUTO_TOKEN)``: make up a fresh cluster secret
AUTO_TOKEN = "<auto>"


@dataclass
class EngineSpec:
    """One reference engine to launch."""

    role: str  # "P", "D" or "colocated"
    tp: int = 1
    dp: int = 1  # data-parallel ranks behind the engine's one address
    num_blocks: int = 256  # per DP rank
    backend: str = "auto"
    extra_config: dict = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    register: bool = True  # P/D engines: register with the cluster's proxy
    host: Optional[str] = None  # what this engine binds and advertises (a loopback address); None: the cluster's


class Cluster:
    """A proxy plus prefill and decode engines (or one colocated engine), all on 127.0.0.1."""

    def __init__(self, engines: list[EngineSpec], *, with_proxy: bool = True, heartbeat_timeout: float = 3.0,
                 ping_interval_s: float = 0.5, log_dir: Optional[str] = None,
                 proxy_args: Optional[list[str]] = None, extra_proxies: Optional[list[list[str]]] = None,
                 token: Optional[str] = AUTO_TOKEN, engine_host: str = "127.0.0.1") -> None:
        self.specs = engines
        # the cluster secret: every proxy's --registration-token and every P/D engine's auth_token
        self.token = secrets.token_hex(16) if token == AUTO_TOKEN else token
        self.engine_host = engine_host  # what engines bind and advertise (a loopback address)
        self.with_proxy = with_proxy
        self.heartbeat_timeout = heartbeat_timeout
        self.ping_interval_s = ping_interval_s
        self.proxy_args = proxy_args or []
        self.extra_proxy_args = extra_proxies or []  # more proxies the engines register with, each with these flags
        self.extra_proxies: list[ManagedProcess] = []
        self.extra_ports: list[tuple[int, int]] = []  # (HTTP, discovery) of each extra proxy
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="atom-kv-cluster-")
        #: the file holding the token (mode 0600), None without a token
        self.token_file = (write_token_file(os.path.join(self.log_dir, "token"), self.token)
                           if self.token is not None else None)
        self.proxy: Optional[ManagedProcess] = None
        self.proxy_port = 0
        self.discovery_port = 0
        self.engines: list[ManagedProcess] = []
        self.ports: list[int] = []  # each engine's HTTP port, known once it is up (0 before)
        self._configs: list[list[str]] = []

    # ------------------------------------------------------------------ launching
    def _engine_config(self, i: int) -> list[str]:
        spec = self.specs[i]
        if spec.role not in ("P", "D"):
            return []
        cfg: dict[str, Any] = {
            "kv_role": "kv_producer" if spec.role == "P" else "kv_consumer",
            "backend": spec.backend,
            "handshake_port": free_plan_base(spec.tp * spec.dp),  # its whole default port plan is free
            "ping_interval_s": self.ping_interval_s,
        }
        if self.token_file is not None and not {"auth_token", "auth_token_file"} & set(spec.extra_config):
            cfg["auth_token_file"] = self.token_file
        if self.with_proxy and spec.register:
            cfg["proxy_ip"] = ",".join(f"127.0.0.1:{d}" for d in [self.discovery_port] + [d for _, d in self.extra_ports])
            cfg["proxy_ping_port"] = self.discovery_port
        cfg.update(spec.extra_config)
        return ["--kv-transfer-config", json.dumps(cfg)]

    def _port_file(self, i: int) -> str:
        return os.path.join(self.log_dir, f"engine{i}.port")

    def engine_argv(self, i: int, port: int = 0) -> list[str]:
        """Engine ``i``'s command line: HTTP on ``port`` (0: the OS picks), reported in its port file."""
        spec = self.specs[i]
        return [sys.executable, "-m", "atom_kv.reference", "--host", self.host_of(i), "--port", str(port),
                "--port-file", self._port_file(i), "--tp", str(spec.tp), "--data-parallel-size", str(spec.dp),
                "--num-blocks", str(spec.num_blocks),
                "--log-level", "INFO", "--instance-index", str(i), *spec.extra_args, *self._configs[i]]

    def _launch_engine(self, i: int, name: str, port: int) -> None:
        """Start engine ``i`` and record it as ``self.engines[i]`` before a held Ctrl-C is re-raised
        (a process started but not yet recorded would be left behind by :meth:`close`)."""
        try:
            os.unlink(self._port_file(i))
        except FileNotFoundError:
            pass
        with interrupts_held():
            proc = ManagedProcess(name, self.engine_argv(i, port), self.log_dir)
            if i < len(self.engines):
                self.engines[i] = proc
            else:
                self.engines.append(proc)

    def _registration_args(self, extra: list[str]) -> list[str]:
        """How a proxy with flags ``extra`` accepts registration: the token's file (unless ``extra`` gives the
        token), or open registration said explicitly."""
        if self.token_file is None:
            return ["--allow-open-registration"]
        if {"--registration-token", "--registration-token-file"} & set(extra):
            return []
        return ["--registration-token-file", self.token_file]

    def start(self, timeout: float = 90.0) -> "Cluster":
        try:
            if self.with_proxy:
                self.proxy_port, self.discovery_port = free_port(), free_port()
                with interrupts_held():
                    self.proxy = ManagedProcess("proxy", [
                        sys.executable, "-m", "atom_kv.proxy", "--host", "127.0.0.1", "--port", str(self.proxy_port),
                        "--discovery-host", "127.0.0.1", "--discovery-port", str(self.discovery_port),
                        "--heartbeat-timeout", str(self.heartbeat_timeout),
                        *self._registration_args(self.proxy_args), *self.proxy_args], self.log_dir)
                for n, args in enumerate(self.extra_proxy_args):
                    ports = (free_port(), free_port())
                    with interrupts_held():
                        self.extra_proxies.append(ManagedProcess(f"proxy{n + 1}", [
                            sys.executable, "-m", "atom_kv.proxy", "--host", "127.0.0.1", "--port", str(ports[0]),
                            "--discovery-host", "127.0.0.1", "--discovery-port", str(ports[1]),
                            "--heartbeat-timeout", str(self.heartbeat_timeout),
                            *self._registration_args(args), *args], self.log_dir))
                        self.extra_ports.append(ports)
            self.ports = [0] * len(self.specs)
            self._configs = [self._engine_config(i) for i in range(len(self.specs))]
            for i, spec in enumerate(self.specs):
                self._launch_engine(i, f"engine{i}-{spec.role}", 0)
            for i in range(len(self.specs)):
                self.wait_engine(i, timeout)
            if self.with_proxy:
                self.wait_registered(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def restart_engine(self, i: int, timeout: float = 90.0) -> None:
        """Start engine ``i`` again (after a kill) with the same configuration and HTTP port, so
        the proxy sees the same instance come back."""
        self._launch_engine(i, f"engine{i}-{self.specs[i].role}-restart", self.ports[i])
        self.wait_engine(i, timeout)

    def wait_engine(self, i: int, timeout: float) -> None:
        """Wait until engine ``i`` has reported its port and answers ``/health`` with 200."""
        proc = self.engines[i]

        def ready() -> bool:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.tail()}")
            if not os.path.exists(self._port_file(i)):
                return False
            with open(self._port_file(i)) as f:
                self.ports[i] = int(f.read())
            status, _ = http_json("GET", self.engine_url(i) + "/health", timeout=2.0)
            return status == 200

        wait_until(ready, timeout, what=f"{proc.name} /health")

    def wait_registered(self, timeout: float) -> dict:
        n_p = sum(1 for s in self.specs if s.role == "P" and s.register)
        n_d = sum(1 for s in self.specs if s.role == "D" and s.register)
        proxies = [(self.proxy, self.proxy_url)] + list(zip(self.extra_proxies, self.extra_proxy_urls))

        def registered(proc: Optional[ManagedProcess], url: str) -> Optional[dict]:
            if proc is not None and not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.tail()}")
            status, body = http_json("GET", url + "/health", timeout=2.0)
            if status != 200 or not isinstance(body, dict):
                return None
            if body.get("prefill", 0) >= n_p and body.get("decode", 0) >= n_d:
                return body
            return None

        def ready() -> Optional[dict]:
            bodies = [registered(proc, url) for proc, url in proxies]
            return bodies[0] if all(b is not None for b in bodies) else None

        return wait_until(ready, timeout, what=f"{n_p} prefill and {n_d} decode engines to register with the proxy")

    # ------------------------------------------------------------------ addresses
    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    @property
    def extra_proxy_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port, _ in self.extra_ports]

    def host_of(self, i: int) -> str:
        """The address engine ``i`` binds and advertises: its spec's ``host``, else the cluster's ``engine_host``."""
        return self.specs[i].host or self.engine_host

    def engine_url(self, i: int) -> str:
        return f"http://{self.host_of(i)}:{self.ports[i]}"

    def engine_health(self, i: int, timeout: float = 5.0) -> dict:
        """Engine ``i``'s ``/health`` answer (asserted 200)."""
        status, body = http_json("GET", self.engine_url(i) + "/health", timeout=timeout)
        assert status == 200, body
        return body

    def index_of(self, role: str, nth: int = 0) -> int:
        return [i for i, s in enumerate(self.specs) if s.role == role][nth]

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop every process (engines first, in parallel, then the proxy). Idempotent."""
        signalled = []
        for proc in self.engines:
            if proc.alive():
                proc.proc.send_signal(signal.SIGTERM)
                signalled.append(proc)
        for proc in self.engines:  # one SIGTERM each: a second one would cut an orderly shutdown short
            proc.stop(signalled=proc in signalled)
        if self.proxy is not None:
            self.proxy.stop()
        for proc in self.extra_proxies:
            proc.stop()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
