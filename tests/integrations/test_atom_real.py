"""(b) The ATOM adapter inside ATOM itself: ``ATOM_SRC`` names a ROCm/ATOM checkout.

ATOM's own ``Scheduler``, ``BlockManager``, ``Sequence``, ``KVConnectorFactory``
(which builds our scheduler-side connector by name inside ``Scheduler``),
``KVCacheTensor`` and ``KVOutputAggregator``, for a producer and a consumer
engine; the model runners' part (KV tensors as ATOM allocates them, the
worker connectors, a deterministic "model") is played by ``atom_pd``. Real
reads over tcp and cma, every prompt KV byte checked on every consumer rank,
every block of both engines freed; a failed load under each policy, an abort
during a load and a lease expiry. Skipped, with the reason, without ``ATOM_SRC``.

Run (docs/atom.md, "Testing against ATOM"):
``ATOM_SRC=/path/to/ATOM <venv with ATOM's deps>/bin/python -m pytest -q tests/integrations/test_atom_real.py``
"""

from __future__ import annotations

import os

import pytest

from tests.integrations.atom_env import atom_commit, use_real_atom

_SKIP = use_real_atom()
if _SKIP:
    pytest.skip(_SKIP, allow_module_level=True)

from atom.kv_transfer.disaggregation import KVConnectorFactory  # noqa: E402
from atom.model_engine.block_manager import BlockManager  # noqa: E402
from atom.model_engine.scheduler import Scheduler  # noqa: E402
from tests.integrations import atom_scenarios as sc  # noqa: E402
from tests.integrations.atom_scenario_tests import *  # noqa: E402,F401,F403  (the shared P/D scenarios)


@pytest.fixture(autouse=True)
def _atom_advertises_loopback(monkeypatch):
    """ATOM's scheduler-side connector advertises ``atom.utils.network.get_ip()`` (``ATOM_HOST_IP``, else
    the default route's address) and the engines' listeners bind exactly the address they advertise:
    keep both on loopback, where this harness's model-runner side listens."""
    monkeypatch.setenv("ATOM_HOST_IP", "127.0.0.1")


def test_this_is_atom_itself(record_property):
    src = os.environ["ATOM_SRC"]
    commit = os.environ.get("ATOM_COMMIT") or atom_commit(src)
    record_property("atom_commit", commit)
    print(f"\nATOM from {src}, commit {commit}")
    assert "fake_atom" not in Scheduler.__module__ and "fake_atom" not in (Scheduler.__init__.__code__.co_filename)
    assert BlockManager.__module__ == "atom.model_engine.block_manager"
    assert KVConnectorFactory.canonical_name("atom_kv") == "atom_kv"


def test_prefix_hit_reads_only_uncached_blocks():
    sc.prefix_hit()  # the fake ATOM has no prefix cache: this one runs against ATOM only


def test_port_layout_is_atoms_own():
    """Our side-channel ports are ATOM main's, computed by ATOM's own function, for every (pp, dp, tp) tried."""
    from atom.kv_transfer.disaggregation.port_offset import side_channel_port_offset

    from atom_kv.wire import handshake_port

    for pp_size in (1, 2, 4):
        for dp_size in (1, 2, 8):
            for tp_size in (1, 2, 8):
                for pp in range(pp_size):
                    for dp in range(dp_size):
                        for tp in range(tp_size):
                            ours = handshake_port(6301, dp, tp_size, tp, pp_rank=pp, dp_size=dp_size)
                            assert ours == 6301 + side_channel_port_offset(dp, tp, tp_size, pp, pp_size, dp_size)
