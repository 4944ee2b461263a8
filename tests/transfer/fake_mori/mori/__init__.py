"""FAKE ``mori`` package for tests: a host-memory stand-in for AMD MORI, no RDMA.

Only ``mori.io`` is provided (see ``mori/io/engine.py``). Tests put the
directory holding this package on ``sys.path`` to use it; it never ships.
"""

__fake__ = True
