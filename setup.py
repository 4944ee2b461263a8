"""The one build step pyproject.toml cannot express: ship ``atom_kv_atom.pth``.

Everything else about the package is in pyproject.toml. The ``.pth`` file
goes to the root of the wheel, so pip installs it into site-packages, where
Python runs it at every start-up: that is how ATOM's processes learn the
``atom_kv`` connector name (see ``atom_kv/integrations/atom/hook.py``).
Editable installs do not get it; ``python -m atom_kv.integrations.atom
install-hook`` writes the same file.
"""

import importlib.util
import os

from setuptools import setup
from setuptools.command.build_py import build_py

_HOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "atom_kv", "integrations", "atom", "hook.py")


def _hook_module():
    """``hook.py`` alone (it imports only the standard library), without importing the package."""
    spec = importlib.util.spec_from_file_location("_atom_kv_hook_at_build", _HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithPth(build_py):
    """``build_py`` plus the start-up hook at the top of the build tree."""

    def run(self):
        super().run()
        hook = _hook_module()
        self.mkpath(self.build_lib)
        with open(os.path.join(self.build_lib, hook.PTH_NAME), "w", encoding="utf-8") as f:
            f.write(hook.pth_text())

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, _hook_module().PTH_NAME)]


setup(cmdclass={"build_py": BuildPyWithPth})
