"""Every command line of the package refuses a bad argument in one line, without the usage block, status 2.

Each runs as a real subprocess (``python -m ...``). Only our own words are checked: the line's form
(``PROG: error: ... (see PROG --help)``) and the argument it names; what argparse says in between is its own.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(("module", "args", "prog", "names"), [
    ("atom_kv.proxy", ["--host", "10.77.0.5"], "atom-kv-proxy", "--registration-token"),
    ("atom_kv.proxy", ["--no-such-flag"], "atom-kv-proxy", "--no-such-flag"),
    ("atom_kv.proxy", ["--max-concurrent-per-engine", "-1"], "atom-kv-proxy", "--max-concurrent-per-engine"),
    ("atom_kv.proxy", ["--queue-timeout", "0"], "atom-kv-proxy", "--queue-timeout"),
    ("atom_kv.proxy", ["--rate-limit", "5,0"], "atom-kv-proxy", "BURST"),
    ("atom_kv.reference", ["--tp", "two"], "python -m atom_kv.reference", "--tp"),
    ("atom_kv.ports", [], "python -m atom_kv.ports", "--kv-transfer-config"),
    ("atom_kv.bench", ["transfer", "--backend", "carrier-pigeon"], "python -m atom_kv.bench transfer", "--backend"),
    ("atom_kv.bench", ["no-such-suite"], "python -m atom_kv.bench", "no-such-suite"),
    ("atom_kv.bench.connector", ["--no-such-flag"], "python -m atom_kv.bench.connector", "--no-such-flag"),
    ("atom_kv.bench.proxy", ["--port", "1"], "proxy.py", "--prefill"),
    ("atom_kv.demo", ["--tp-prefill", "3"], "python -m atom_kv.demo", "--tp-prefill"),
    ("atom_kv.integrations.atom", ["no-such-action"], "python -m atom_kv.integrations.atom", "no-such-action"),
    ("atom_kv.testing.fake_engine", ["--prefills", "many"], "fake_engine.py", "--prefills"),
])
def test_a_refused_argument_is_one_line(module, args, prog, names):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1, res.stderr
    (line,) = lines
    assert line.startswith(f"{prog}: error: ") and line.endswith(f"(see {prog} --help)"), line
    assert names in line, line
    assert res.stdout == ""
