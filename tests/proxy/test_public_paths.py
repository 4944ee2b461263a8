"""The proxy's import paths that the docs, the README, the scripts and the packaging name keep working
(``python -m atom_kv.proxy``, the ``atom-kv-proxy`` entry point, the modules the docs point readers at),
and each gives the names users take from it."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PUBLIC = {
    "atom_kv.proxy": ("create_app", "ProxySettings", "POLICIES", "StaticEngine", "parse_engine_spec"),
    "atom_kv.proxy.__main__": ("main",),  # pyproject's atom-kv-proxy = "atom_kv.proxy.__main__:main"
    "atom_kv.proxy.server": ("listen_socket", "serve_app", "serve_until_signalled"),
    "atom_kv.proxy.spans": ("RequestSpans", "SPANS"),
    "atom_kv.proxy.upstream": ("UpstreamPool", "UpstreamResponse", "UpstreamError", "UpstreamTimeout",
                               "UpstreamConnectTimeout", "UpstreamConnectionError", "UpstreamTooLarge",
                               "AnswerLimits", "BodyConsumer"),
    "atom_kv.proxy.breaker": ("CircuitBreaker", "OutcomeWindow", "RequestOutcomes"),
}
# where the old paths' names live now: the old path gives the very same objects
MOVED = {
    "atom_kv.proxy.spans": "atom_kv.proxy.observability.spans",
    "atom_kv.proxy.upstream": "atom_kv.proxy.http.upstream",
    "atom_kv.proxy.breaker": "atom_kv.proxy.fleet.breaker",
}


@pytest.mark.parametrize("path", sorted(PUBLIC))
def test_public_path_imports_with_its_names(path):
    module = importlib.import_module(path)
    missing = [name for name in PUBLIC[path] if not hasattr(module, name)]
    assert missing == [], f"{path} lacks {missing}"
    exported = getattr(module, "__all__", None)
    if exported is not None and path != "atom_kv.proxy.__main__":
        assert set(PUBLIC[path]) <= set(exported), f"{path}.__all__ lacks {set(PUBLIC[path]) - set(exported)}"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_gives_the_moved_objects(old):
    before, now = importlib.import_module(old), importlib.import_module(MOVED[old])
    for name in PUBLIC[old]:
        assert getattr(before, name) is getattr(now, name), f"{old}.{name} is not {MOVED[old]}.{name}"


def test_preflight_imports_are_public_paths():
    """scripts/gpu_check_steps.py imports these before a GPU run: they must stay in the list above."""
    from scripts.gpu_check_steps import PREFLIGHT_IMPORTS

    proxy_paths = [p for p in PREFLIGHT_IMPORTS if p.startswith("atom_kv.proxy")]
    assert proxy_paths and set(proxy_paths) <= set(PUBLIC)


def test_python_dash_m_atom_kv_proxy_runs():
    out = subprocess.run([sys.executable, "-m", "atom_kv.proxy", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--prefill" in out.stdout and "--decode" in out.stdout
