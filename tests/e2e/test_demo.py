"""`python -m atom_kv.demo` (what `make demo` runs) succeeds and leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

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
    log_dir = re.search(r"\(logs: (\S+) removed at the end", proc.stdout).group(1)
    assert log_dir.startswith(tempfile.gettempdir()) and "atom-kv-cluster-" in log_dir
    assert not os.path.exists(log_dir)  # a run that succeeded leaves nothing behind
    assert _processes_writing_into(log_dir) == []


def test_ctrl_c_during_startup_leaves_no_process_behind(tmp_path):
    """SIGINT while the engines are still starting: exit 130, every child stopped."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "atom_kv.demo", "--num-prompts", "1"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        # the demo, its proxy and its three engines hold their log files open
        while len(_processes_writing_into(str(tmp_path))) < 5:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out + err
    assert "interrupted" in err and "Traceback" not in err
    survivors = _processes_writing_into(str(tmp_path))
    assert survivors == [], [open(f"/proc/{pid}/cmdline").read().replace("\0", " ") for pid in survivors]


def test_startup_failure_exits_with_one_line_and_leaves_no_process_behind(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "atom_kv.demo", "--num-prompts", "1", "--startup-timeout", "0.5"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: timed out after 0.5 s waiting for engine0-P /health"]
    (kept,) = os.listdir(tmp_path)  # it did start processes, and keeps their logs: it failed
    assert f"logs kept in {tmp_path / kept} (remove the folder when done)" in proc.stdout
    assert os.listdir(tmp_path / kept)
    assert _processes_writing_into(str(tmp_path)) == []
