"""``"kv_connector": "atom_kv"`` resolves in every ATOM process, ATOM unchanged.

ATOM spawns its engine core, which spawns its model runners, each a fresh
interpreter. The proof runs exactly that chain (``multiprocessing`` spawn
context, like ATOM's ``get_mp_context()``) in a throwaway virtualenv whose
site-packages holds our ``atom_kv_atom.pth`` and nothing registers atom-kv
by hand: the engine-core process builds the scheduler-side connector through
ATOM's factory, the model-runner process the worker side. With the hook
switched off the same chain fails, so the ``.pth`` is what does it. That the
wheel ships the ``.pth`` is checked where the wheel is built and installed
(``tests/e2e/test_packaging.py``).

ATOM here is ``$ATOM_SRC`` when set, else the fake ATOM (``fake_atom``); AITER's
process groups come from a stub (tp rank 0 of 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from atom_kv.integrations.atom.hook import PTH_NAME, pth_text
from tests.integrations.atom_env import FAKE_ATOM

ROOT = Path(__file__).resolve().parents[2]

CHAIN = r'''
import json, multiprocessing as mp, os, sys
from types import SimpleNamespace


def config():
    return SimpleNamespace(kv_transfer_config={"kv_connector": "atom_kv", "kv_role": "kv_producer"},
                           kv_cache_block_size=16, tensor_parallel_size=1, model="tiny",
                           parallel_config=SimpleNamespace(data_parallel_rank=0, data_parallel_size=1))


def build(role):
    from atom.kv_transfer.disaggregation.factory import KVConnectorFactory
    try:
        KVConnectorFactory.canonical_name("atom_kv")
        conn = KVConnectorFactory.create_connector(config(), role=role)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    name = type(conn).__name__
    getattr(conn, "close", lambda: None)()
    return name


def model_runner(q):
    q.put(("model runner", os.getpid(), build("worker")))


def engine_core(q):
    q.put(("engine core", os.getpid(), build("scheduler")))
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=model_runner, args=(q,))
    p.start()
    p.join(60)


if __name__ == "__main__":
    assert not any(m == "atom" or m.startswith("atom.") for m in sys.modules), "ATOM imported at start-up"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=engine_core, args=(q,))
    p.start()
    got = [q.get(timeout=60) for _ in range(2)]
    p.join(60)
    print(json.dumps({"main": os.getpid(), "hook_loaded": "atom_kv.integrations.atom.hook" in sys.modules,
                      "children": got}))
'''

AITER_STUB = '''"""STUB of aiter.dist.parallel_state: one TP rank, one DP rank."""
from types import SimpleNamespace
def get_tp_group():
    return SimpleNamespace(rank_in_group=0, world_size=1)
def get_dp_group():
    return SimpleNamespace(rank_in_group=0, world_size=1)
'''


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A virtualenv whose site-packages has our .pth, and paths to atom-kv, its dependencies and ATOM."""
    base = tmp_path_factory.mktemp("hookenv")
    venv.create(base / "venv", with_pip=False, symlinks=True)
    python = base / "venv" / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    stub = base / "stub"
    (stub / "aiter" / "dist").mkdir(parents=True)
    (stub / "aiter" / "__init__.py").write_text("")
    (stub / "aiter" / "dist" / "__init__.py").write_text("")
    (stub / "aiter" / "dist" / "parallel_state.py").write_text(AITER_STUB)
    atom_src = os.environ.get("ATOM_SRC") or str(FAKE_ATOM)
    # sorted before atom_kv_atom.pth, as a real install has atom_kv in site-packages already
    (site / "00_paths.pth").write_text("\n".join([str(ROOT), sysconfig.get_paths()["purelib"], atom_src,
                                                  str(stub)]) + "\n")
    (base / "chain.py").write_text(CHAIN)
    return python, site, base / "chain.py"


def _run_chain(python: Path, script: Path, **env: str) -> dict:
    out = subprocess.run([str(python), str(script)], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "ATOM_HOST_IP": "127.0.0.1", **env}, cwd=script.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_pth_registers_atom_kv_in_spawned_engine_and_runner_processes(env):
    python, site, script = env
    (site / PTH_NAME).write_text(pth_text())
    try:
        got = _run_chain(python, script)
        assert got["hook_loaded"]
        by_role = {role: (pid, result) for role, pid, result in got["children"]}
        assert by_role["engine core"][1] == "AtomKVScheduler"
        assert by_role["model runner"][1] == "AtomKVWorker"
        assert len({got["main"], by_role["engine core"][0], by_role["model runner"][0]}) == 3
        # switched off, ATOM does not know the name: the .pth is what registers it
        off = _run_chain(python, script, ATOM_KV_ATOM_HOOK="0")
        assert all("unknown" in result.lower() for _, _, result in off["children"]), off
    finally:
        (site / PTH_NAME).unlink()


def test_install_hook_command_writes_the_same_pth(tmp_path):
    run = [sys.executable, "-m", "atom_kv.integrations.atom"]
    out = subprocess.run(run + ["install-hook", "--site", str(tmp_path)], capture_output=True, text=True, check=True)
    assert (tmp_path / PTH_NAME).read_text() == pth_text() and "installed" in out.stdout
    status = subprocess.run(run + ["hook-status", "--site", str(tmp_path)], capture_output=True, text=True, check=True)
    assert status.stdout.strip().endswith(": installed")
    subprocess.run(run + ["remove-hook", "--site", str(tmp_path)], check=True, capture_output=True)
    assert not (tmp_path / PTH_NAME).exists()
    bad = subprocess.run(run + ["install-hook", "--site", str(tmp_path / "nope")], capture_output=True, text=True)
    assert bad.returncode == 2 and "is not a directory" in bad.stderr
