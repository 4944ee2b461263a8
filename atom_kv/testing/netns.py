"""Simulated hosts for the multi-host test: Linux network namespaces on a private bridge.

:class:`Hosts` builds a "switch" namespace holding a bridge, and one
namespace per host, each joined to the bridge by a veth pair created inside
the switch namespace: nothing is added to the machine's own network
namespace, and no address outside ``SUBNET`` is used. Every name starts with
``akvmh<pid>-``; :func:`remove_leftovers` deletes what a crashed run left
behind (namespaces whose owning pid is gone, and the processes in them).

A process is started on a host with :meth:`Hosts.spawn`: inside the host's
network namespace, and (``own_host=True``) under its own pid, mount (fresh
``/proc``) and UTS namespace with its own hostname, so two engines on two
hosts do not share a hostname or a pid namespace, as on two machines.
:meth:`Hosts.call` runs a function on a thread that entered a host's network
namespace (``setns``), so the test's HTTP clients connect from that host.
Needs root, ``ip`` and ``ss`` (iproute2), ``unshare`` (util-linux) and ``hostname``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from atom_kv.testing.processes import ManagedProcess, interrupts_held

log = logging.getLogger(__name__)

PREFIX = "akvmh"
SUBNET = "10.231.7"  # /24 on the private bridge; nothing outside it is ever addressed
NIC = "mh0"  # each host's interface
_CLONE_NEWNET = 0x40000000
_OWNED = re.compile(rf"^{PREFIX}(\d+)-")


def unavailable_reason() -> Optional[str]:
    """Why namespaced hosts cannot be built here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (network, pid and UTS namespaces); CI runs it as root"
    for tool in ("ip", "unshare", "ss", "hostname"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` on PATH (iproute2, util-linux, hostname)"
    if not hasattr(ctypes.CDLL(None), "setns"):
        return "libc has no setns"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *args]
    return _checked(argv) if check else subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


def _checked(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace(name: str) -> None:
    """SIGKILL every process in namespace ``name``, then delete it."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "delete", name, check=False)


def remove_leftovers() -> list[str]:
    """Delete the namespaces (and kill their processes) of earlier runs whose process is gone."""
    removed = []
    for name in _namespaces():
        match = _OWNED.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _kill_namespace(name)
            removed.append(name)
    return removed


def _enter_netns(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


class NsProcess(ManagedProcess):
    """A process started on a simulated host. With its own pid namespace, the process under
    ``unshare`` is the namespace's init: :meth:`stop` sends SIGTERM to it (``unshare`` itself
    does not pass signals on), and when it exits the kernel kills whatever is left in the namespace."""

    own_host = True  # False: started without unshare (SIGTERM goes to the process itself)

    def init_pid(self, timeout: float = 10.0) -> int:
        """The pid (as this process sees it) of the command under ``unshare``."""
        path = f"/proc/{self.pid}/task/{self.pid}/children"
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(path) as f:
                    children = f.read().split()
            except OSError:
                children = []
            if children:
                return int(children[0])
            if not self.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no process under unshare")
            time.sleep(0.02)

    def freeze(self, frozen: bool) -> None:
        """SIGSTOP (``frozen``) or SIGCONT every process of this one's group: the process and its
        children stop answering anything, as on a host that hangs, and go on where they were."""
        if not self.alive():  # reaped: its group id may belong to somebody else by now
            return
        try:
            os.killpg(self.pid, signal.SIGSTOP if frozen else signal.SIGCONT)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 8.0, *, signalled: bool = False) -> None:
        self.freeze(False)  # a frozen process would not see the SIGTERM
        if not signalled:
            self.terminate()
        super().stop(timeout, signalled=True)

    def terminate(self) -> None:
        """SIGTERM to the process under ``unshare`` (or the process itself, without one)."""
        if not self.alive():
            return
        try:
            os.kill(self.init_pid() if self.own_host else self.pid, signal.SIGTERM)
        except (ProcessLookupError, RuntimeError):
            pass


def stop_all(processes: list[NsProcess]) -> None:
    """Stop ``processes`` together: SIGTERM to each, then wait for each (SIGKILL after its timeout)."""
    for proc in processes:
        try:
            proc.terminate()
        except Exception:  # keep going: whatever happens, every process must be stopped
            log.warning("could not signal %s", proc.name, exc_info=True)
    for proc in processes:
        try:
            proc.stop(signalled=True)
        except Exception:
            log.warning("could not stop %s", proc.name, exc_info=True)


class Hosts:
    """Simulated hosts named by role, each with one address on a private /24; see the module docstring."""

    def __init__(self, names: list[str], log_dir: str) -> None:
        self.tag = f"{PREFIX}{os.getpid()}"
        self.names = names
        self.log_dir = log_dir
        self.switch = f"{self.tag}-sw"
        self.ns = {name: f"{self.tag}-{name}" for name in names}
        self.addr = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(names)}
        self.port_of = {name: f"p{i + 1}" for i, name in enumerate(names)}  # bridge port in the switch
        self.processes: list[NsProcess] = []
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def build(self) -> "Hosts":
        try:
            remove_leftovers()
            for ns in (self.switch, *self.ns.values()):  # our own pid's, from an earlier failed build
                if ns in _namespaces():
                    _kill_namespace(ns)
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for name in self.names:
                ns, port = self.ns[name], self.port_of[name]
                _ip("netns", "add", ns)
                _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", NIC, "netns", ns)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", NIC)
                _ip("-n", ns, "link", "set", NIC, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    # ------------------------------------------------------------------ processes
    def spawn(self, host: str, name: str, argv: list[str], *, env: Optional[dict[str, str]] = None,
              own_host: bool = True) -> NsProcess:
        """Start ``argv`` on ``host`` (see the module docstring); ``env`` adds variables."""
        prefix = ["ip", "netns", "exec", self.ns[host]]
        if own_host:
            prefix += ["unshare", "--pid", "--uts", "--mount", "--mount-proc", "--fork", "--kill-child",
                       "sh", "-c", 'hostname "$0" && exec "$@"', f"{host}-{name}"]
        if env:
            prefix += ["env", *(f"{k}={v}" for k, v in env.items())]
        with interrupts_held():
            proc = NsProcess(name, prefix + argv, self.log_dir)
            proc.own_host = own_host
            self.processes.append(proc)
        return proc

    def call(self, host: str, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on a thread inside ``host``'s network namespace."""
        return self.submit(host, fn, *args, **kwargs).result(timeout)

    def submit(self, host: str, fn: Callable[..., Any], *args: Any, **kwargs: Any):
        with self._lock:
            pool = self._pools.get(host)
            if pool is None:
                pool = self._pools[host] = ThreadPoolExecutor(
                    8, thread_name_prefix=f"netns-{host}", initializer=_enter_netns, initargs=(self.ns[host],))
        return pool.submit(fn, *args, **kwargs)

    def run(self, host: str, *argv: str) -> str:
        """A short command in ``host``'s network namespace; its stdout."""
        return _checked(["ip", "netns", "exec", self.ns[host], *argv]).stdout

    def listening(self, host: str) -> set[tuple[str, int]]:
        """Every listening TCP socket on ``host``: ``(address, port)``, as ``ss -ltn`` shows them."""
        out = set()
        for line in self.run(host, "ss", "-ltnH").splitlines():
            fields = line.split()
            if len(fields) >= 4:
                address, _, port = fields[3].rpartition(":")
                out.add((address.strip("[]"), int(port)))
        return out

    def link(self, host: str, up: bool) -> None:
        """Take ``host``'s cable out of the switch (or put it back): its switch port down or up."""
        _ip("-n", self.switch, "link", "set", self.port_of[host], "up" if up else "down")

    def throttle(self, host: str, rate_kbit: Optional[int]) -> None:
        """Everything ``host`` sends through a token bucket of ``rate_kbit`` (``tc ... tbf``); None lifts it."""
        if rate_kbit is None:
            self.run(host, "tc", "qdisc", "del", "dev", NIC, "root")
        else:
            burst = max(4, rate_kbit // 64)  # about 16 ms of the rate: a burst, never a window
            self.run(host, "tc", "qdisc", "replace", "dev", NIC, "root", "tbf", "rate", f"{rate_kbit}kbit",
                     "burst", f"{burst}kbit", "latency", "300ms")

    def close_port(self, host: str, port: int, closed: bool, *, reject: bool = False) -> None:
        """An ``iptables`` rule on ``host`` for TCP packets to ``port`` coming in on its interface: dropped
        (a firewall's silence) or, ``reject``, answered with a reset (a closed port); ``closed=False`` removes it."""
        action = ["REJECT", "--reject-with", "tcp-reset"] if reject else ["DROP"]
        self.run(host, "iptables", "-A" if closed else "-D", "INPUT", "-i", NIC, "-p", "tcp", "--dport", str(port),
                 "-j", *action)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop every process, then delete every namespace (the veths and the bridge go with them)."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        stop_all(list(reversed(self.processes)))
        for ns in (*self.ns.values(), self.switch):
            if ns in _namespaces():
                _kill_namespace(ns)

    def __enter__(self) -> "Hosts":
        return self.build()

    def __exit__(self, *exc: Any) -> None:
        self.close()
