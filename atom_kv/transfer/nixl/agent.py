"""One NIXL agent behind a lock, and the order it is torn down in.

:class:`NixlAgent` owns the native ``nixl_agent`` and every native object made
from it: registered memory, remote agents, prepared descriptor lists and
transfer requests. Every call into NIXL goes through it under one lock (the
agent is created without NIXL's own listener thread, so NIXL does no locking of
its own here). :meth:`NixlAgent.teardown` releases them in the order NIXL needs
(transfers, prepared lists, remote agents, memory, then the agent itself):
dropping the agent while a transfer or list handle still points into it is what
crashes an interpreter at exit.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from types import ModuleType
from typing import Any, Optional

import numpy as np

from atom_kv.transfer.base import TransferError
from atom_kv.transfer.nixl.ucx_modules import UCX_MODULES_VALUE, apply_ucx_modules, duplicate_libnl

__all__ = ["NixlAgent", "nixl_error"]

logger = logging.getLogger(__name__)

#: NIXL's name for "the local side" of a prepared descriptor list
LOCAL_SIDE = "NIXL_INIT_AGENT"

#: longest sleep of NIXL's progress thread between UCX events, in microseconds
#: (it wakes at once on an event; this bounds UCX's occasional missed wake-up)
PROGRESS_POLL_US = 1000

#: plugins whose thread count `nixl.progress_threads` sets (as NIXL's num_threads)
THREADED_PLUGINS = frozenset({"UCX", "LIBFABRIC", "OBJ"})


def nixl_error(exc: BaseException) -> str:
    """A NIXL exception as one line: its class (``nixlRemoteDisconnectError``) and message."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class NixlAgent:
    """A native NIXL agent, its lock, and every native handle made from it."""

    def __init__(self, api: ModuleType, name: str, *, plugins: list[str], progress_threads: int,
                 ucx_tls: Optional[str], loopback_only: bool = False, ucx_tcp_ports: Optional[str] = None) -> None:
        # UCX reads its environment when the agent's UCX context is created, just below
        _set_ucx_env("UCX_TLS", ucx_tls, "nixl.ucx_tls")
        _set_ucx_env("UCX_TCP_PORT_RANGE", ucx_tcp_ports, "nixl_ucx_tcp_port_range")
        if loopback_only and "UCX_NET_DEVICES" not in os.environ:
            # an engine bound to loopback: UCX's TCP transport would otherwise
            # listen on every interface; shared memory and cma are unaffected
            os.environ["UCX_NET_DEVICES"] = "lo"
        # read once, when the first agent loads UCX: keeps the system's libnl out (ucx_modules.py)
        apply_ucx_modules()
        self.lock = threading.Lock()
        self.name = name
        self._agent: Any = _create_agent(api, name, list(plugins), progress_threads)
        copies = duplicate_libnl()
        if copies:
            logger.warning("nixl: two copies of libnl-route are loaded (%s), so this process may end with SIGSEGV "
                           "at exit; export UCX_MODULES=%s before anything in it loads UCX (see docs/nixl.md, "
                           "'Exit on hosts with rdma-core')", ", ".join(copies), UCX_MODULES_VALUE)
        missing = [p for p in plugins if p not in self._agent.backends]
        if missing:
            available = ", ".join(self._agent.get_plugin_list()) or "none"
            self._agent = None
            raise TransferError(f"NIXL plugin(s) {', '.join(missing)} from `nixl.plugins` could not be created "
                                f"here (plugins found: {available})")
        self.plugins = list(plugins)
        self._regs: list[Any] = []
        self._remotes: set[str] = set()
        self._dlists: list[Any] = []
        self._xfers: dict[int, Any] = {}

    @property
    def native(self) -> Any:
        """The native ``nixl_agent`` (None once torn down); call it under :attr:`lock`."""
        return self._agent

    # -- memory and metadata ------------------------------------------------------
    def register(self, rows: np.ndarray, seg: str) -> None:
        """Register ``(address, length, device)`` rows of one segment."""
        with self.lock:
            reg = self._agent.register_memory(self._agent.get_reg_descs(_reg_rows(rows), seg))
            self._regs.append(reg)

    def metadata(self) -> bytes:
        with self.lock:
            return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        with self.lock:
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._remotes.add(name)
            return name

    def remove_remote(self, name: str) -> None:
        with self.lock:
            if name not in self._remotes:
                return
            self._remotes.discard(name)
            self._agent.remove_remote_agent(name)

    # -- descriptor lists and transfers -------------------------------------------
    def prep(self, side: str, rows: np.ndarray, seg: str) -> Any:
        """A prepared descriptor list of ``rows`` on ``side`` (a remote agent,
        or :data:`LOCAL_SIDE`)."""
        with self.lock:
            handle = self._agent.prep_xfer_dlist(side, rows, seg)
            self._dlists.append(handle)
            return handle

    def release_dlist(self, handle: Any) -> None:
        with self.lock:
            self._release_dlist(handle)

    def _release_dlist(self, handle: Any) -> None:
        try:
            self._dlists.remove(handle)
        except ValueError:
            return
        try:
            handle.release()
        except Exception as exc:
            logger.warning("nixl: releasing a prepared descriptor list failed: %s", nixl_error(exc))
            return
        _detach(handle)

    def start_prepped(self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray) -> tuple[Any, str]:
        """Make and post one READ from prepared lists; returns (xfer, state)."""
        with self.lock:
            xfer = self._agent.make_prepped_xfer("READ", local, local_idx, remote, remote_idx)
            return xfer, self._post(xfer)

    def start_rows(self, local_rows: np.ndarray, lseg: str, remote_rows: np.ndarray, rseg: str,
                   remote: str) -> tuple[Any, str]:
        """Make and post one READ from explicit descriptor rows; returns (xfer, state)."""
        with self.lock:
            local_descs = self._agent.get_xfer_descs(local_rows, lseg)
            remote_descs = self._agent.get_xfer_descs(remote_rows, rseg)
            xfer = self._agent.initialize_xfer("READ", local_descs, remote_descs, remote)
            return xfer, self._post(xfer)

    def _post(self, xfer: Any) -> str:
        self._xfers[id(xfer)] = xfer
        try:
            return self._agent.transfer(xfer)
        except Exception:
            self._release_xfer(xfer)
            raise

    def state(self, xfer: Any) -> str:
        """"DONE", "PROC" or "ERR" ("ERR: <reason>" when NIXL raised)."""
        with self.lock:
            try:
                return self._agent.check_xfer_state(xfer)
            except Exception as exc:
                return f"ERR: {nixl_error(exc)}"

    def release(self, xfer: Any) -> bool:
        """Release a transfer (cancelling it if still running); False when
        NIXL could not (it is then kept and retried at teardown)."""
        with self.lock:
            return self._release_xfer(xfer)

    def _release_xfer(self, xfer: Any) -> bool:
        try:
            xfer.release()
        except Exception as exc:
            logger.debug("nixl: releasing a transfer failed: %s", nixl_error(exc))
            return False
        self._xfers.pop(id(xfer), None)
        _detach(xfer)
        return True

    # -- teardown -------------------------------------------------------------------
    def teardown(self) -> None:
        """Release everything, in NIXL's order, then drop the agent. Idempotent."""
        with self.lock:
            agent, self._agent = self._agent, None
            if agent is None:
                return
            for xfer in list(self._xfers.values()):
                if not self._release_xfer(xfer):
                    logger.warning("nixl: a transfer could not be cancelled at close; NIXL frees it with the agent")
            self._xfers.clear()
            for handle in list(self._dlists):
                self._release_dlist(handle)
            for name in sorted(self._remotes):
                try:
                    agent.remove_remote_agent(name)
                except Exception as exc:
                    logger.warning("nixl: removing remote agent %s failed: %s", name, nixl_error(exc))
            self._remotes.clear()
            for reg in self._regs:
                try:
                    agent.deregister_memory(reg)
                except Exception as exc:
                    logger.warning("nixl: deregistering memory failed: %s", nixl_error(exc))
            self._regs.clear()
            native = _native_ref(agent)
        del agent  # the last reference: the native agent (UCX workers, progress thread) goes now
        if native is not None and native() is not None:
            logger.warning("nixl: the native agent outlived its teardown (something still holds it); "
                           "it is destroyed when that goes")


def _set_ucx_env(name: str, value: Optional[str], key: str) -> None:
    """Set UCX's environment variable ``name`` from config key ``key`` (a different value already
    in the environment is replaced, with a warning)."""
    if not value:
        return
    previous = os.environ.get(name)
    if previous is not None and previous != value:
        logger.warning("nixl: `%s` %r replaces %s=%r from the environment", key, value, name, previous)
    os.environ[name] = value


def _create_agent(api: ModuleType, name: str, plugins: list[str], progress_threads: int) -> Any:
    """A ``nixl_agent`` whose progress thread sleeps in ``poll()`` between UCX
    events, waking at least every :data:`PROGRESS_POLL_US`.

    ``nixl_agent`` itself always asks for a zero delay, which makes the UCX
    plugin's progress thread spin a core even when idle. So the agent is made
    without plugins, its native agent (which holds nothing yet) is replaced by
    one configured with the delay, and the plugins are created on that one.
    Where the NIXL version does not allow it, the plain agent is used."""
    bind = getattr(api, "nixlBind", None)
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False,
                                                       backends=[]))
    if bind is None:
        logger.warning("nixl: this NIXL version has no nixlBind, so the progress thread cannot sleep; "
                       "it may keep a core busy")
    else:
        try:
            native_conf = bind.nixlAgentConfig()
            native_conf.useProgThread = True
            native_conf.useListenThread = False
            native_conf.syncMode = bind.NIXL_THREAD_SYNC_NONE
            native_conf.pthrDelay = PROGRESS_POLL_US
            native_conf.captureTelemetry = False
            agent.agent = bind.nixlAgent(name, native_conf)
        except Exception as exc:
            logger.warning("nixl: this NIXL version does not let the progress thread sleep (%s); "
                           "it may keep a core busy", nixl_error(exc))
    for plugin in plugins:
        if plugin not in agent.get_plugin_list():
            continue
        # the plugins that take a thread count call it num_threads
        init = {"num_threads": str(progress_threads)} if progress_threads > 0 and plugin in THREADED_PLUGINS else {}
        agent.create_backend(plugin, init)
    return agent


def _detach(handle: Any) -> None:
    """Drop a released handle's reference to the native agent.

    NIXL's handle wrappers keep the native agent alive; a released one never
    uses it again. Detached, a handle the caller still holds cannot keep the
    agent (and UCX's threads) alive past :meth:`NixlAgent.teardown`, to be
    destroyed at some later garbage collection or during interpreter exit."""
    try:
        if getattr(handle, "_released", False):
            handle._agent = None
    except (AttributeError, TypeError):  # another NIXL version's wrapper: left as it is
        pass


def _native_ref(agent: Any) -> Optional["weakref.ref[Any]"]:
    try:
        return weakref.ref(agent.agent)
    except (AttributeError, TypeError):
        return None


def _reg_rows(rows: np.ndarray) -> list[tuple[int, int, int, str]]:
    return [(int(a), int(n), int(d), "") for a, n, d in rows.tolist()]
