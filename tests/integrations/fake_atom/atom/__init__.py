"""FAKE ATOM for tests: the slice of ATOM's API the atom_kv adapter touches.

Written from reading ATOM main (ROCm/ATOM ffdf3bb5d): the connector factory,
the connector base classes and types, the TP aggregator, ``Sequence``, a
``BlockManager`` and a ``Scheduler`` that make the same connector calls, in
the same order and with the same consequences, as ATOM's. No model, no GPU,
no AITER. ``tests/integrations/test_atom_real.py`` runs the same scenarios
against ATOM's own classes when ``ATOM_SRC`` names a checkout.
"""
