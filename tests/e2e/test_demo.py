"""`python -m atom_kv.demo` (what `make demo` runs) succeeds and leaves no process behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _processes_writing_into(log_dir: str) -> list[int]:
    """Processes holding a file open in the demo's log directory: exactly the demo's children."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}").startswith(log_dir):
                    pids.append(int(entry))
                    break
            except OSError:
                continue
    return pids


def test_demo_runs_and_cleans_up():
    proc = subprocess.run([sys.executable, "-m", "atom_kv.demo", "--num-prompts", "2", "--max-tokens", "8"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all 2 outputs identical" in proc.stdout
    assert proc.stdout.count(" yes ") == 2
    log_dir = re.search(r"\(logs: (\S+)\)", proc.stdout).group(1)
    assert os.listdir(log_dir)  # the proxy and engines did write there
    assert _processes_writing_into(log_dir) == []
