"""Registers atom-kv with ATOM's connector factory in every ATOM process, ATOM unchanged.

ATOM resolves ``"kv_connector"`` through ``KVConnectorFactory``, a registry
filled by imports: no entry points, no module-path lookup. It checks the name
while parsing its config and builds connectors in the engine-core and
model-runner processes it spawns fresh (``spawn``), so the name must be
registered in every one of them before ATOM asks.

Python runs the ``import`` lines of every ``*.pth`` file in site-packages at
start-up, in spawned children too. The wheel therefore ships
``atom_kv_atom.pth``, one line that calls :func:`install`. That puts a
:class:`FactoryWatcher` on ``sys.meta_path``: it does nothing until a process
imports ``atom.kv_transfer.disaggregation.factory``, then registers
``atom_kv`` on the factory right after the module has run, and steps aside.
Nothing of ATOM or of the connector is imported early; a process that never
imports ATOM pays for importing this module only.

``pip install -e`` does not install a wheel's ``.pth`` files; there, run
``python -m atom_kv.integrations.atom install-hook`` once
(``remove-hook`` undoes it, ``hook-status`` shows where it is). Set ``ATOM_KV_ATOM_HOOK=0`` to switch the
hook off. Code that embeds ATOM may instead call :func:`register` before
creating the engine.

Both the hook and :func:`register` run only on an ATOM whose factory is as
verified (:func:`~atom_kv.integrations.atom.contract.check_factory`; else one
logged line says what changed). Where ATOM finds connectors by
``kv_connector_module_path`` (docs/atom-upstream.md), the hook steps aside:
``"kv_connector_module_path": "atom_kv.integrations.atom.connector"`` registers
``atom_kv`` when ATOM imports it.

Every Python process of the environment imports this module at start-up,
so it imports only ``os`` and ``sys`` (everything else lazily), and the wheel
build loads it on its own to write the ``.pth``.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Optional, Sequence, cast

if TYPE_CHECKING:
    from importlib.abc import Loader

__all__ = ["CONNECTOR_NAME", "FACTORY_MODULE", "PTH_NAME", "FactoryWatcher", "install", "pth_text", "register"]

#: The ``kv_connector`` value ATOM users write.
CONNECTOR_NAME = "atom_kv"
#: Also accepted where ATOM supports aliases (ATOM main; names are compared case-insensitively).
CONNECTOR_ALIASES = ("atom-kv",)
FACTORY_MODULE = "atom.kv_transfer.disaggregation.factory"
SCHEDULER = ("atom_kv.integrations.atom.scheduler", "AtomKVScheduler")
WORKER = ("atom_kv.integrations.atom.worker", "AtomKVWorker")
PTH_NAME = "atom_kv_atom.pth"
DISABLE_ENV = "ATOM_KV_ATOM_HOOK"


def pth_text() -> str:
    """The one line of ``atom_kv_atom.pth`` (site runs lines that start with ``import``)."""
    return "import atom_kv.integrations.atom.hook as _atom_kv_hook; _atom_kv_hook.install()\n"


def register(factory: Any = None) -> None:
    """Register ``atom_kv`` (and its alias) on ATOM's ``KVConnectorFactory``.

    Idempotent. ``factory`` defaults to ATOM's, imported here. Passes only the
    keyword arguments this ATOM's ``register`` takes (``aliases`` and
    ``requires_pd_staging`` are newer than ATOM's first P/D commit); raises
    :class:`~atom_kv.integrations.atom.contract.AtomChanged` (one line) where
    ``register`` no longer takes the module and class names.
    """
    import inspect

    from atom_kv.integrations.atom.contract import check_factory

    if factory is None:
        from atom.kv_transfer.disaggregation.factory import KVConnectorFactory

        factory = KVConnectorFactory
    check_factory(factory)
    kwargs: dict[str, Any] = dict(worker_module=WORKER[0], worker_class=WORKER[1],
                                  scheduler_module=SCHEDULER[0], scheduler_class=SCHEDULER[1])
    params = inspect.signature(factory.register).parameters
    if "aliases" in params:
        kwargs["aliases"] = CONNECTOR_ALIASES
    if "requires_pd_staging" in params:
        # compressor P/D staging is for DeepSeek-V4's per-request state, which
        # atom-kv refuses at registration (see caches.py)
        kwargs["requires_pd_staging"] = False
    factory.register(CONNECTOR_NAME, **kwargs)


def _report_failure(exc: BaseException) -> None:
    import logging

    from atom_kv.integrations.atom.contract import AtomChanged

    log = logging.getLogger(__name__)
    if isinstance(exc, AtomChanged):
        log.error("%s; the %r KV connector is not registered", exc, CONNECTOR_NAME)
    else:
        log.error("atom-kv: could not register the %r KV connector with ATOM", CONNECTOR_NAME, exc_info=exc)


def _hook_registers(factory: Any) -> None:
    """What the start-up hook does once ATOM's factory exists: register, unless this ATOM finds
    connectors by ``kv_connector_module_path`` itself (then the config names our module)."""
    from atom_kv.integrations.atom.contract import factory_resolves_module_paths

    try:
        if not factory_resolves_module_paths(factory):
            register(factory)
    except Exception as exc:  # never break ATOM's own import; say why the name will be unknown
        _report_failure(exc)


class _RegisteringLoader:
    """Runs the factory module with its own loader, then registers atom-kv on it."""

    def __init__(self, loader: Any, watcher: "FactoryWatcher") -> None:
        self._loader = loader
        self._watcher = watcher

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._watcher.registered(module)

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, is_package, ... of the real loader
        return getattr(self._loader, name)


class FactoryWatcher:
    """A ``sys.meta_path`` finder that waits for ATOM's connector factory module.

    It finds nothing itself: for the factory module it asks the finders after
    it and wraps the loader they return, so the module runs unchanged and
    atom-kv is registered the moment it has. Then it leaves ``sys.meta_path``.
    """

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if fullname != FACTORY_MODULE:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    # create_module and exec_module: the loader protocol, without importing importlib.abc here
                    spec.loader = cast("Loader", _RegisteringLoader(spec.loader, self))
                return spec
        return None

    def registered(self, module: Any) -> None:
        _hook_registers(getattr(module, "KVConnectorFactory", None))
        self.remove()

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def install() -> None:
    """Arrange for atom-kv to be registered when this process imports ATOM's factory (idempotent).

    Registers at once if the factory is already imported.
    """
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    factory_module = sys.modules.get(FACTORY_MODULE)
    if factory_module is not None:
        _hook_registers(getattr(factory_module, "KVConnectorFactory", None))
        return
    if not any(isinstance(f, FactoryWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, FactoryWatcher())
