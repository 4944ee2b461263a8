"""Transient read failures, from the test-only fault injector (atom_kv/transfer/fault_injector.py)."""

from __future__ import annotations

import pytest

from atom_kv.transfer.fault_injector import READ_FAIL_ENV, with_injected_faults


def test_the_hook_is_off_unless_its_variable_says_a_fraction(monkeypatch):
    class Backend:
        name = "tcp"

    backend = Backend()
    assert with_injected_faults(backend, {}) is backend  # type: ignore[arg-type]
    assert with_injected_faults(backend, {READ_FAIL_ENV: "0"}) is backend  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=READ_FAIL_ENV):
        with_injected_faults(backend, {READ_FAIL_ENV: "often"})  # type: ignore[arg-type]
