"""``examples/atom_pd.sh`` on a Python without ATOM: one line saying so, exit 1, nothing started or written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "atom_pd.sh")


def _atom_installed() -> bool:
    """Whether this Python, started afresh, imports ``atom`` (the test process may hold the fake ATOM of the
    contract tests in ``sys.modules``, which the script's own Python never sees)."""
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('atom') is None else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60).returncode != 0


def test_without_atom_the_script_says_so_in_one_line(tmp_path):
    if _atom_installed():
        pytest.skip("ATOM is installed for this Python")
    env = dict(os.environ, MODEL="/models/none", PY=sys.executable)
    out = subprocess.run(["bash", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: ATOM is not installed for {sys.executable}"), out.stderr
    assert "install-hook" not in out.stderr and "Traceback" not in out.stderr
    assert os.listdir(tmp_path) == []  # no log folder, no token file


def test_a_missing_python_is_named(tmp_path):
    env = dict(os.environ, MODEL="/models/none", PY=str(tmp_path / "no-python"))
    out = subprocess.run(["bash", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [f"error: no Python at PY={tmp_path / 'no-python'}: set PY to the "
                                               "Python that has ATOM and atom-kv"]
