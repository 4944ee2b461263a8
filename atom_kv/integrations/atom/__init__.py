"""ATOM (ROCm/ATOM) loads atom-kv by name: ``--kv-transfer-config '{"kv_connector": "atom_kv", ...}'``.

- :mod:`.hook`: registers ``atom_kv`` with ATOM's ``KVConnectorFactory`` in
  every ATOM process (through the ``atom_kv_atom.pth`` start-up hook).
- :mod:`.scheduler`: :class:`AtomKVScheduler`, ATOM's scheduler-side connector.
- :mod:`.sequences`: the scheduler side's record of each sequence (one ``SeqState`` per ``seq.id``).
- :mod:`.worker`: :class:`AtomKVWorker`, ATOM's worker-side connector, one per TP rank.

- :mod:`.contract`: what the two workarounds (taking ATOM's ``Scheduler``
  from the stack, the ``.pth`` hook) rely on, checked before either is used.
- :mod:`.connector`: what an ATOM with ``kv_connector_module_path`` imports
  (docs/atom-upstream.md).

Only ``scheduler``, ``worker``, ``metadata`` and ``connector`` import ATOM, and
only ATOM imports them. Written against ATOM main ffdf3bb5d; see ``docs/atom.md``.
"""

from atom_kv.integrations.atom.hook import CONNECTOR_NAME, install, register

__all__ = ["CONNECTOR_NAME", "install", "register"]
