"""``atom_kv.testing``'s old names for the launcher (the tests and benches import them) give the very objects of
``atom_kv.launch``, where the code lives now: it ships in the wheel for the demo, ``atom_kv.testing`` does not."""

from __future__ import annotations

import importlib

import pytest

MODULES = ("cluster", "processes", "polling", "ports", "web", "token_files")


@pytest.mark.parametrize("name", MODULES)
def test_old_path_gives_the_launch_modules_objects(name):
    old, new = importlib.import_module(f"atom_kv.testing.{name}"), importlib.import_module(f"atom_kv.launch.{name}")
    assert new.__all__ and sorted(old.__all__) == sorted(new.__all__)
    assert [n for n in new.__all__ if getattr(old, n) is not getattr(new, n)] == []
