"""The old path of :mod:`atom_kv.transfer.nixl.probe` (docs and scripts named it): the very same module."""

import sys

from atom_kv.transfer.nixl import probe

sys.modules[__name__] = probe
