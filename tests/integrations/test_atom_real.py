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

_NO_CMA = pytest.mark.skipif(bool(sc.cma_unavailable()), reason=sc.cma_unavailable())


def test_this_is_atom_itself(record_property):
    src = os.environ["ATOM_SRC"]
    commit = os.environ.get("ATOM_COMMIT") or atom_commit(src)
    record_property("atom_commit", commit)
    print(f"\nATOM from {src}, commit {commit}")
    assert "fake_atom" not in Scheduler.__module__ and "fake_atom" not in (Scheduler.__init__.__code__.co_filename)
    assert BlockManager.__module__ == "atom.model_engine.block_manager"
    assert KVConnectorFactory.canonical_name("atom_kv") == "atom_kv"


@pytest.mark.parametrize("p_tp,d_tp,backend", [(1, 1, "tcp"), (1, 2, "tcp"), (2, 1, "tcp"),
                                               pytest.param(2, 2, "cma", marks=_NO_CMA),
                                               pytest.param(1, 2, "cma", marks=_NO_CMA)])
def test_pd_exchange(p_tp, d_tp, backend):
    sc.exchange(p_tp, d_tp, backend)


def test_pd_exchange_mla_replicated_latent():
    sc.exchange(1, 2, "tcp", mla=True)


def test_pd_exchange_block_of_two_physical_blocks_heterogeneous_tp():
    sc.exchange(2, 1, "cma" if not sc.cma_unavailable() else "tcp", block_size=32)


def test_pd_exchange_fp8_with_scales():
    sc.exchange(1, 2, "tcp", fp8=True)


def test_prefix_hit_reads_only_uncached_blocks():
    sc.prefix_hit()


def test_engines_with_different_kv_layouts_refuse_each_other_in_one_line():
    lines = sc.layout_mismatch()
    assert lines, "the decode engine logged no layout refusal"
    assert all("\n" not in line for line in lines)
    assert any("KV layout mismatch: layout 'aiter-shuffle' (prefill) vs 'aiter' (decode)" in line for line in lines)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_load(policy):
    sc.failed_load(policy)


def test_abort_while_loading():
    sc.abort_while_loading()


def test_lease_expiry():
    sc.lease_expiry()
