"""The lock check ``make test`` runs first (scripts/check_lock.py), and the lock itself."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check_lock():
    spec = importlib.util.spec_from_file_location("check_lock", os.path.join(ROOT, "scripts", "check_lock.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lock_parses_and_pins_the_cpu_torch() -> None:
    pins = _check_lock().read_lock(os.path.join(ROOT, "requirements-lock.txt"))
    assert pins["torch"].endswith("+cpu"), pins["torch"]
    assert not [name for name in pins if name.startswith(("nvidia-", "cuda-"))]
    for direct in ("msgspec", "pyzmq", "httptools", "quart", "aiohttp", "numpy", "pytest", "nixl-cu12"):
        assert direct in pins, direct


def test_differences_name_each_mismatch() -> None:
    check = _check_lock()
    lock = {"msgspec": "0.23.0", "pyzmq": "27.3.0", "torch": "2.13.0+cpu"}
    have = {"msgspec": "0.19.0", "torch": "2.13.0+cpu", "extra-thing": "1.0", "pip": "23.2.1"}
    assert check.differences(lock, have) == [
        "extra-thing==1.0 is installed but not in the lock",
        "msgspec: the lock says 0.23.0, 0.19.0 is installed",
        "pyzmq==27.3.0 is in the lock but not installed",
    ]
    assert check.differences(lock, dict(lock)) == []


def test_a_line_that_is_not_a_pin_is_refused(tmp_path) -> None:
    bad = tmp_path / "lock.txt"
    bad.write_text("msgspec>=0.18\n")
    with pytest.raises(SystemExit, match="not a name==version line"):
        _check_lock().read_lock(str(bad))
