"""What the ATOM adapter's two workarounds rely on in ATOM, checked before either is used.

ATOM main (ffdf3bb5d) gives a connector no way to free blocks and no way to
be found by module path, so the adapter works around both:

- **Taking ATOM's ``Scheduler`` from the stack.** The connector needs the
  ``BlockManager`` (to free the blocks of failed and aborted loads) and must
  hear of the requests ATOM ends while they wait (``take_rejected``: an abort
  or an unschedulable prompt, which ATOM never reports to a connector). It
  takes both from the ``Scheduler`` whose ``__init__`` is building it.
- **The ``.pth`` start-up hook** registers ``atom_kv`` on ATOM's
  ``KVConnectorFactory`` in every process (:mod:`.hook`).

Each is used only after :func:`check_scheduler` / :func:`check_factory` found
ATOM as it was verified; otherwise the adapter refuses in one line naming
what changed. ``docs/atom-upstream.md`` is the few-line ATOM change that makes
both unnecessary; where ATOM has it (:func:`factory_resolves_module_paths`,
a ``block_manager`` passed to the connector), the adapter uses it instead.

Imports only the standard library: :mod:`.hook` uses it at interpreter start-up.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

__all__ = ["VERIFIED_AT", "AtomChanged", "check_factory", "check_scheduler", "constructing_scheduler",
           "factory_resolves_module_paths"]

#: The ATOM commit both workarounds were verified against.
VERIFIED_AT = "ATOM main ffdf3bb5d"
UPSTREAM_DOC = "docs/atom-upstream.md"
_REGISTER_KEYWORDS = ("worker_module", "worker_class", "scheduler_module", "scheduler_class")
_SCHEDULER_CLASS = "atom.model_engine.scheduler.Scheduler"


class AtomChanged(RuntimeError):
    """ATOM differs from what a workaround was verified against (the message is one line)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"atom_kv: {what} (verified against {VERIFIED_AT}); see {UPSTREAM_DOC} for the ATOM change "
                         "that removes the need for it")


def check_factory(factory: Any) -> None:
    """Raise :class:`AtomChanged` unless ``KVConnectorFactory.register`` takes what :mod:`.hook` passes."""
    register = getattr(factory, "register", None)
    if not callable(register):
        raise AtomChanged("ATOM's KVConnectorFactory has no register() to add the atom_kv connector with")
    try:
        params = inspect.signature(register).parameters
    except (TypeError, ValueError):
        raise AtomChanged("ATOM's KVConnectorFactory.register() has no readable signature") from None
    missing = [k for k in _REGISTER_KEYWORDS if k not in params]
    if missing:
        raise AtomChanged(f"ATOM's KVConnectorFactory.register() no longer takes {', '.join(missing)}")


def factory_resolves_module_paths(factory: Any) -> bool:
    """True where ATOM finds a connector by ``kv_connector_module_path`` (the upstream change): then nothing
    needs registering at start-up."""
    canonical = getattr(factory, "canonical_name", None)
    try:
        return callable(canonical) and "module_path" in inspect.signature(canonical).parameters
    except (TypeError, ValueError):
        return False


def check_scheduler(owner: Any) -> None:
    """Raise :class:`AtomChanged` unless ``owner`` is ATOM's ``Scheduler`` as the connector uses it: a
    ``block_manager`` with ``deallocate`` and ``take_rejected()`` draining a ``_rejected`` list."""
    cls = type(owner)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if not any(f"{c.__module__}.{c.__qualname__}" == _SCHEDULER_CLASS for c in cls.__mro__):
        raise AtomChanged(f"ATOM's connector is built by {name}, not by {_SCHEDULER_CLASS}")
    if not callable(getattr(getattr(owner, "block_manager", None), "deallocate", None)):
        raise AtomChanged("ATOM's Scheduler builds its connector before its block_manager (or it has no deallocate)")
    if not callable(getattr(owner, "take_rejected", None)) or not isinstance(getattr(owner, "_rejected", None), list):
        raise AtomChanged("ATOM's Scheduler no longer hands requests it ends while they wait to take_rejected()")


def constructing_scheduler(start: Any, max_depth: int = 12) -> Optional[Any]:
    """The nearest caller frame's ``self`` that has a ``block_manager`` and a ``waiting`` queue: the ATOM
    ``Scheduler`` whose ``__init__`` builds the connector (ATOM main creates ``self.block_manager``
    first, the connector later, through ``get_kvconnector`` and the factory). ``start`` is the frame
    to search from."""
    frame = start
    for _ in range(max_depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and getattr(owner, "block_manager", None) is not None and hasattr(owner, "waiting"):
            return owner
        frame = frame.f_back
    return None
