"""``nixl.ucx_proto_info``: the UCX transports a NIXL agent's reads went over, logged once
per agent, from UCX's own protocol report (real NIXL over UCX on this host, in a fresh process:
UCX reads its environment once per process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from atom_kv.transfer.nixl.probe import nixl_unavailable_reason
from atom_kv.transfer.nixl.transports import parse_proto_tables

ROOT = Path(__file__).resolve().parents[2]
NIXL_REASON = nixl_unavailable_reason()

#: a report as UCX prints it with UCX_PROTO_INFO=y (two agents' tables, one warning in between)
REPORT = """\
[1796173753.104516] [vm:584  :0]   +--------+-------------+-----------------------------------+
[1796173753.104516] [vm:584  :0]   | reader-1 self cfg#0                                      |
[1796173753.104516] [vm:584  :0]   | remote memory read by ucp_get* from host memory to host  |
[1796173753.104516] [vm:584  :0]   +--------+-------------+-----------------------------------+
[1796173753.104516] [vm:584  :0]   | Range  | Description |              Config               |
[1796173753.104516] [vm:584  :0]   +--------+-------------+-----------------------------------+
[1796173753.104516] [vm:584  :0]   | 0..8k  | short       | sysv/memory                       |
[1796173753.104516] [vm:584  :0]   | 8k..inf| zero-copy   | cma/memory                        |
[1796173753.104516] [vm:584  :0]   +--------+-------------+-----------------------------------+
[1796173753.105000] [vm:584  :0]    ucp_worker.c:1234 UCX  WARN  something to say
[1796173753.106492] [vm:584  :0]   +------------+--------------------+---------------+
[1796173753.106492] [vm:584  :0]   | other-2 self cfg#0                              |
[1796173753.106492] [vm:584  :0]   | active message by ucp_am_send* from host memory |
[1796173753.106492] [vm:584  :0]   +------------+--------------------+---------------+
[1796173753.106492] [vm:584  :0]   |          0 | short              | tcp/lo        |
"""


def test_the_report_is_read_per_agent_and_other_lines_are_kept():
    choices, other = parse_proto_tables(REPORT, "reader-1")
    assert choices == {"remote memory read by ucp_get* from host memory to host": ["sysv/memory", "cma/memory"]}
    assert other == ["ucp_worker.c:1234 UCX  WARN  something to say"]
    assert parse_proto_tables(REPORT, "other-2")[0] == {"active message by ucp_am_send* from host memory": ["tcp/lo"]}


SCRIPT = r"""
import logging, sys
import numpy as np
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
from atom_kv.config import KVTransferConfig
from atom_kv.transfer import ReadOp, create_backend
cfg = KVTransferConfig.from_dict({"kv_role": "kv_consumer", "backend": "nixl", "nixl": {"ucx_proto_info": True}})
a, b = create_backend("nixl", cfg, key="served"), create_backend("nixl", cfg, key="reader")
src = np.arange(1 << 20, dtype=np.uint8)
dst = np.zeros_like(src)
(ra,) = a.register_memory(src.ctypes.data, src.nbytes)
(rb,) = b.register_memory(dst.ctypes.data, dst.nbytes)
peer = b.add_peer(a.export_descriptor())
for _ in range(3):
    h = b.read(peer, [ReadOp(rb, 0, ra, 0, src.nbytes)], timeout_s=10)
    assert h.wait(15) and h.error is None, h.error
b.close()
a.close()
print("done", bool((src == dst).all()))
"""


@pytest.mark.skipif(NIXL_REASON is not None, reason=NIXL_REASON or "")
def test_a_nixl_agent_logs_the_ucx_transports_of_its_reads_once():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in __import__("os").environ.items() if not k.startswith("UCX_")})
    assert out.returncode == 0 and "done True" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    reports = [line for line in out.stdout.splitlines() if "UCX transports chosen:" in line]
    assert len(reports) == 1, out.stdout[-3000:]  # the reader's agent, once, though it read three times
    assert "nixl reader-" in reports[0] and "/" in reports[0].split("chosen:", 1)[1]
