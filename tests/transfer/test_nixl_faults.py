"""A NIXL failure at any point between creating an agent and closing it:
``auto`` drops ``nixl`` with a warning (or, once a peer is routed to it, the
read fails with one line), and the process always ends with status 0, closed
or not (NIXL's teardown order; a native crash would end it by a signal).
Each case runs in its own process (:mod:`tests.transfer._nixl_faults`)
against real NIXL, the failure injected into NIXL's own Python API."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from atom_kv.transfer.nixl import probe as nixl_probe
from tests.transfer._nixl_faults import POINTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NIXL_REASON = nixl_probe.nixl_unavailable_reason()

#: what each point's process says, beyond ending with status 0
EXPECTED = {
    "agent": ["server offers nixl: False", "route tcp", "(('nixl', 'unavailable'), 1)", "read ok"],
    "register": ["server offers nixl: False", "route tcp", "(('nixl', 'register_failed'), 1)", "read ok"],
    "export": ["server offers nixl: False", "route tcp", "server [(('nixl', 'export_failed'), 1)]", "read ok"],
    "add_peer": ["server offers nixl: True", "route tcp", "(('nixl', 'add_peer_failed'), 1)", "read ok"],
    "plan": ["route nixl", "read failed: NIXL could not prepare descriptor lists", "prep_xfer_dlist"],
    "read": ["route nixl", "read failed: NIXL read from peer", "did not start", "injected NIXL failure in transfer"],
    "none": ["server offers nixl: True", "route nixl", "fallbacks [] server []", "read ok"],
    # torch refuses GPU memory on a CPU-only build (its words are its own: only the refusal is checked)
    "cuda-refusal": ["outcome: refused: RuntimeError: "],
}


def _cuda_refusal_skip() -> str | None:
    import torch

    return "this host has CUDA: GPU memory is not refused" if torch.cuda.is_available() else None


@pytest.mark.skipif(NIXL_REASON is not None, reason=NIXL_REASON or "")
@pytest.mark.parametrize("end", ["close", "exit"])
@pytest.mark.parametrize("point", POINTS)
def test_a_nixl_failure_ends_the_process_cleanly(point, end):
    if point == "cuda-refusal" and (why := _cuda_refusal_skip()):
        pytest.skip(why)
    out = subprocess.run([sys.executable, "-m", "tests.transfer._nixl_faults", point, end], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    said = [line for line in out.stdout.splitlines() if line.startswith("outcome: ")]
    assert out.returncode == 0, f"exit status {out.returncode} (a negative one is a signal): {out.stderr[-3000:]}"
    assert said and said[-1] == "outcome: end of main", out.stderr[-3000:]
    text = "\n".join(said)
    for expected in EXPECTED[point]:
        assert expected in text, f"{expected!r} not in:\n{text}\n{out.stderr[-2000:]}"
    if point in ("register", "export"):
        assert "auto: nixl is not used on this engine, tcp serves its peers" in out.stderr
    assert "Traceback" not in out.stderr


def test_every_point_has_its_expectations():
    assert set(EXPECTED) == set(POINTS)
