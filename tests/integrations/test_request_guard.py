"""The adapters' entry for a request's kv_transfer_params (``integrations.request_guard``), without an engine.

Both adapters (ATOM's, and vLLM's, whose own tests need vLLM) hand a request's
``kv_transfer_params`` to the connector through it: whatever they hold, and
whatever the connector does with them, the request at most loses its KV
transfer, and the engine's scheduler never sees an exception (issue 38).
The connector side is fuzzed in ``tests/fuzz/test_fuzz_kv_transfer_params.py``."""

from __future__ import annotations

import logging

from atom_kv.integrations.request_guard import asks, matched_tokens


def test_only_a_mapping_with_the_flag_set_asks_for_it():
    assert asks({"do_remote_prefill": True}, "do_remote_prefill")
    for params in (None, {}, {"do_remote_prefill": False}, {"do_remote_decode": True}, [("do_remote_prefill", 1)],
                   "do_remote_prefill", 1, True):
        assert not asks(params, "do_remote_prefill"), params


def test_a_connector_exception_costs_the_request_its_transfer_not_the_engine(caplog):
    dropped = []

    def broken():
        raise KeyError("remote_block_ids")

    with caplog.at_level(logging.ERROR, logger="atom_kv.integrations.request_guard"):
        assert matched_tokens("vLLM", "req-7", broken, on_error=lambda: dropped.append("req-7")) == (0, False)
    assert dropped == ["req-7"]
    (record,) = caplog.records
    assert record.getMessage() == ("vLLM request req-7: the KV connector failed on its kv_transfer_params; serving it "
                                   "without a KV transfer")
    assert record.exc_info is not None  # a connector bug: its traceback is logged


def test_an_answer_passes_through_and_a_failing_cleanup_is_logged_too(caplog):
    assert matched_tokens("ATOM seq", 3, lambda: (32, True)) == (32, True)

    def cleanup():
        raise RuntimeError("also broken")

    assert matched_tokens("ATOM seq", 4, lambda: 1 / 0, on_error=cleanup) == (0, False)
    assert "ATOM seq request 4: could not drop the KV connector's state for it" in caplog.text
