"""The P/D scenario tests, collected by both ``test_atom_contract.py`` (the fake
ATOM) and ``test_atom_real.py`` (ATOM itself), which import them after
choosing the ``atom`` package. Not a test module of its own."""

from __future__ import annotations

import pytest

from tests.integrations import atom_scenarios as sc

_NO_CMA = pytest.mark.skipif(bool(sc.cma_unavailable()), reason=sc.cma_unavailable() or "cma runs here")
_SAME_HOST = "tcp" if sc.cma_unavailable() else "cma"

__all__ = [
    "test_pd_exchange", "test_pd_exchange_mla_replicated_latent",
    "test_pd_exchange_block_of_two_physical_blocks_heterogeneous_tp", "test_pd_exchange_fp8_with_scales",
    "test_engines_with_different_kv_layouts_refuse_each_other_in_one_line", "test_failed_load",
    "test_abort_while_loading", "test_abort_while_queued_releases_the_prefill_at_once", "test_lease_expiry",
    "test_dp_ranks_on_both_sides", "test_prefill_in_pipeline_stages", "test_pipeline_set_ups_refused_in_one_line",
]


@pytest.mark.parametrize("p_tp,d_tp,backend", [(1, 1, "tcp"), (1, 2, "tcp"), (2, 1, "tcp"),
                                               pytest.param(2, 2, "cma", marks=_NO_CMA),
                                               pytest.param(1, 2, "cma", marks=_NO_CMA)])
def test_pd_exchange(p_tp, d_tp, backend):
    sc.exchange(p_tp, d_tp, backend)


def test_pd_exchange_mla_replicated_latent():
    sc.exchange(1, 2, "tcp", mla=True)


def test_pd_exchange_block_of_two_physical_blocks_heterogeneous_tp():
    sc.exchange(2, 1, _SAME_HOST, block_size=32)


def test_pd_exchange_fp8_with_scales():
    sc.exchange(1, 2, "tcp", fp8=True)


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


def test_abort_while_queued_releases_the_prefill_at_once():
    sc.aborted_while_queued()


def test_lease_expiry():
    sc.lease_expiry()


@pytest.mark.parametrize("p_dp,d_dp,p_tp,d_tp", [(2, 2, 1, 1), (2, 1, 1, 2), (1, 2, 2, 1)],
                         ids=["P-dp2-D-dp2", "P-dp2-D-dp1tp2", "P-dp1tp2-D-dp2"])
def test_dp_ranks_on_both_sides(p_dp, d_dp, p_tp, d_tp):
    sc.dp_exchange(p_dp, d_dp, p_tp, d_tp)


@pytest.mark.parametrize("p_tp,d_tp,backend,layout", [(1, 1, "tcp", {}), (2, 1, "tcp", {}), (1, 2, "tcp", {}),
                                                      (2, 2, "tcp", {"mla": True}),
                                                      pytest.param(2, 1, "cma", {}, marks=_NO_CMA)],
                         ids=["P-pp2tp1-D-tp1", "P-pp2tp2-D-tp1", "P-pp2tp1-D-tp2", "mla-P-pp2tp2-D-tp2",
                              "cma-P-pp2tp2-D-tp1"])
def test_prefill_in_pipeline_stages(p_tp, d_tp, backend, layout):
    sc.pp_exchange(p_tp, d_tp, backend, **layout)


def test_pipeline_set_ups_refused_in_one_line():
    lines = sc.pp_refusals()
    assert all("\n" not in line for line in lines)
    assert lines == [
        "kv-transfer-config: kv_role 'kv_consumer' with pipeline_parallel_size 2: atom-kv splits only a prefill "
        "engine (kv_producer) into pipeline stages; run the decode engine with pipeline_parallel_size 1",
        "pipeline stage: ATOM's KV caches name layers 2..4 (2 caches), not consecutive layers of the model's 4",
        "pipeline stage: ATOM's KV cache 'attn.0' is not named layer_<n>, so the model layers this stage holds "
        "are unknown",
        "pipeline stage: ATOM's KV caches name layers 3..4 (2 caches), not consecutive layers of the model's 4",
    ]
