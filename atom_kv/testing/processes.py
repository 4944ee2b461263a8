"""The tests' and benches' name for :mod:`atom_kv.launch.processes`, re-exported: that code ships in the wheel
(the demo runs on it), while ``atom_kv.testing`` stays in the checkout."""

from atom_kv.launch.processes import *  # noqa: F401,F403  (exactly its __all__)
from atom_kv.launch.processes import __all__  # noqa: F401
