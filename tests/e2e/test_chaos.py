"""The chaos soak for a minute: ``python -m atom_kv.bench chaos --duration 60``, its invariants read from its JSON.

Two proxies, two prefill and two decode reference engines on hosts of their own (network namespaces named
after the bench's pid, so this runs beside tests/e2e/test_multihost.py), mixed traffic to both proxies,
faults drawn from the seed while it runs, and 5 % of the decode engines' reads failed by the test-only
fault injector (atom_kv/bench/chaos.py). The bench checks the invariants itself (its exit status); this
test also asserts each from the report, so a failure says which one broke and shows the examples. Needs
root, ``ip``, ``unshare``, ``ss``, ``tc`` and ``iptables``; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from typing import Optional

import pytest

from atom_kv.testing.netns import unavailable_reason
from atom_kv.testing.processes import REPO_ROOT


def _unavailable() -> Optional[str]:
    reason = unavailable_reason()
    for tool in ("tc", "iptables"):
        if reason is None and shutil.which(tool) is None:
            reason = f"needs `{tool}` on PATH (iproute2, iptables)"
    return reason


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=_unavailable() or "")


def test_a_minute_of_overlapping_faults_no_wrong_answer_no_hung_request_no_leaked_block(tmp_path):
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, "-m", "atom_kv.bench", "chaos", "--duration", "60", "--seed", "36", "--json", str(out),
         "--log-dir", str(tmp_path / "logs")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert out.exists(), f"no report (exit status {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    detail = f"{proc.stdout[-4000:]}\nexamples: {report['examples']}\nlogs: {tmp_path / 'logs'}"
    total = report["requests"]["all"]
    assert total["ok"] >= 20, detail  # the traffic ran, and was served most of the time
    assert total["wrong"] == 0, detail
    assert total["late"] == 0 and report["unfinished_requests"] == 0, detail
    assert total["unclean"] == 0, detail
    assert report["leaked_blocks"] == 0 and all(report["blocks"].values()), detail
    assert report["rss"] and all(r["flat"] for r in report["rss"].values()), report["rss"]
    assert report["tracebacks"] == {}, list(report["tracebacks"].items())[:1]
    assert len(report["faults"]) >= 4 and not any(f["failed"] for f in report["faults"]), report["faults"]
    reads = report["transient_reads"]
    # injected read failures happened, and loads that hit one recovered on a retry
    assert reads["injected"] > 0 and reads["loads_recovered"] > 0, reads
    assert report["all_invariants_held"] and proc.returncode == 0, detail
