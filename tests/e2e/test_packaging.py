"""`pip install atom-kv` (no extras) in a fresh virtualenv: no torch, and the proxy and the
connector work; what needs torch says, in one line, which extra to install. The wheel
is built the way it ships: pyproject.toml plus setup.py's build step, which adds
``atom_kv_atom.pth`` (ATOM's processes learn the ``atom_kv`` connector name from it), and
that file is in the wheel, lands in site-packages and costs a process without ATOM
nothing but one small import.

Builds a wheel of this checkout and installs it into a new virtualenv. Its dependencies
(the wheel's own Requires-Dist, followed transitively, extras left out) are copied there
first from the environment running the tests, file by file from each distribution's
RECORD, so pip installs the wheel with ``--no-index`` and must find every requirement
already met: no index, no network, no download, and a dependency the metadata forgets
still fails the imports below. Where a dependency is missing from this environment the
install falls back to pip's indexes. The whole module takes about 15 s on the 2-core CI box.
"""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import venv
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from atom_kv.integrations.atom.hook import PTH_NAME, pth_text
from atom_kv.testing.polling import wait_until
from atom_kv.testing.ports import free_port
from atom_kv.testing.processes import REPO_ROOT
from atom_kv.testing.web import http_json

EXTRA_HINT = "pip install 'atom-kv[reference]'"


@pytest.fixture(scope="module")
def plain_install(tmp_path_factory):
    """A virtualenv holding a non-editable install of this checkout without extras."""
    root = tmp_path_factory.mktemp("plain-install")
    src = root / "src"
    os.makedirs(src)
    # build from a copy: an in-tree build would leave build/ and *.egg-info in the checkout
    shutil.copytree(os.path.join(REPO_ROOT, "atom_kv"), src / "atom_kv",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md"):  # everything the release build reads
        shutil.copy(os.path.join(REPO_ROOT, name), src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"), str(src)],
                   check=True, timeout=300, cwd=root)
    (wheel,) = (root / "dist").glob("atom_kv-*.whl")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # pip below runs from this interpreter, into it
    python = str(env_dir / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    all_found = _copy_dependencies(_wheel_requirements(wheel), Path(purelib))
    offline = ["--no-index"] if all_found else []
    subprocess.run([*pip, "--python", python, "install", *offline, "--no-compile", str(wheel)], check=True,
                   timeout=600, cwd=root)
    return python, str(root), str(wheel)


def _wheel_requirements(wheel: Path) -> list[str]:
    """The Requires-Dist lines of the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(zf.read(name).decode()).get_all("Requires-Dist") or []


def _copy_dependencies(requires: list[str], purelib: Path) -> bool:
    """Copy the distributions ``requires`` needs (transitively, no extras, markers evaluated here) from
    this environment into ``purelib``; False when one of them is not installed here."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(line, frozenset()) for line in requires]  # (requirement, the extras asked of its owner)
    all_found = True
    while todo:
        line, owner_extras = todo.pop()
        req = Requirement(line)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in {"", *owner_extras}):
            continue
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            all_found = False
            continue
        base = Path(dist.locate_file("")).resolve()
        for f in dist.files or ():
            src = Path(dist.locate_file(f)).resolve()
            if base not in src.parents or not src.is_file():
                continue  # console scripts outside site-packages; files RECORD lists but the install lacks
            dst = purelib / src.relative_to(base)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        todo.extend((r, frozenset(req.extras)) for r in dist.requires or ())
    return all_found


def _run(plain_install, *args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    python, cwd, _ = plain_install
    # only the installed copy is importable
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ATOM_KV_ATOM_HOOK")}, **(env or {})}
    return subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_plain_install_has_no_torch_and_imports_the_installed_copy(plain_install):
    proc = _run(plain_install, "-c", "import importlib.util, atom_kv; "
                                     "print(importlib.util.find_spec('torch') is None, atom_kv.__file__)")
    assert proc.returncode == 0, proc.stderr
    no_torch, location = proc.stdout.split()
    assert no_torch == "True"
    assert location.startswith(os.path.join(plain_install[1], "venv")), location


def test_the_wheel_ships_the_atom_pth_at_its_root(plain_install):
    with zipfile.ZipFile(plain_install[2]) as zf:
        names = zf.namelist()
        assert PTH_NAME in names, f"{PTH_NAME} is not at the wheel's root: {sorted(n for n in names if '/' not in n)}"
        assert zf.read(PTH_NAME).decode() == pth_text()
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        assert any(line.split(",")[0] == PTH_NAME for line in zf.read(record).decode().splitlines())


def test_installed_pth_arms_the_atom_hook_at_start_up_and_nothing_else(plain_install):
    """Every Python start in the environment runs the .pth: it puts the watcher for ATOM's factory in
    place and imports neither ATOM nor torch nor the connector; `hook-status` finds it where pip put it."""
    probe = ("import sys, sysconfig, os; "
             "print(os.path.isfile(os.path.join(sysconfig.get_paths()['purelib'], %r)), "
             "any(type(f).__name__ == 'FactoryWatcher' for f in sys.meta_path), "
             "sorted(m for m in sys.modules if m.split('.')[0] in ('atom', 'torch', 'zmq', 'numpy')))" % PTH_NAME)
    proc = _run(plain_install, "-c", probe)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == "True True []", proc.stdout
    off = _run(plain_install, "-c", probe, env={"ATOM_KV_ATOM_HOOK": "0"})
    assert off.returncode == 0 and off.stdout.strip() == "True False []", off.stdout + off.stderr
    status = _run(plain_install, "-m", "atom_kv.integrations.atom", "hook-status")
    assert status.returncode == 0 and status.stdout.strip().endswith(": installed"), status.stdout + status.stderr


def test_connector_and_tcp_backend_import_without_torch(plain_install):
    proc = _run(plain_install, "-c", "import atom_kv.connector, atom_kv.transfer.tcp, atom_kv.engine_hooks")
    assert proc.returncode == 0, proc.stderr


def test_proxy_runs_without_torch(plain_install):
    proc = _run(plain_install, "-m", "atom_kv.proxy", "--help")
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr
    python, cwd, _ = plain_install
    port = free_port()  # the proxy cannot report a port it picked itself
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proxy = subprocess.Popen([python, "-m", "atom_kv.proxy", "--host", "127.0.0.1", "--port", str(port),
                              "--discovery-host", "127.0.0.1", "--discovery-port", str(free_port())],
                             cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def answered():
            assert proxy.poll() is None, proxy.communicate(timeout=5)[0]
            return http_json("GET", f"http://127.0.0.1:{port}/health", timeout=2)

        status, body = wait_until(answered, 30, what="the proxy's /health")
        assert status == 503 and body["prefill"] == 0 and body["decode"] == 0  # up, no engines yet
    finally:
        proxy.send_signal(signal.SIGTERM)
        try:
            out = proxy.communicate(timeout=15)[0]
        except subprocess.TimeoutExpired:
            proxy.kill()
            out = proxy.communicate()[0]
    assert proxy.returncode == 0, out


@pytest.mark.parametrize("args", [
    ["-m", "atom_kv.reference", "--port", "0"],
    ["-m", "atom_kv.demo"],
], ids=["engine", "demo"])
def test_what_needs_torch_says_which_extra_in_one_line(plain_install, args):
    proc = _run(plain_install, *args)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and EXTRA_HINT in lines[0], proc.stderr


def test_proxy_tracing_without_the_otel_extra_says_which_extra_in_one_line(plain_install):
    proc = _run(plain_install, "-m", "atom_kv.proxy", "--port", "0", "--no-discovery", "--prefill",
                "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'atom-kv[otel]'" in lines[0], proc.stderr


def test_importing_the_reference_engine_without_torch_names_the_extra(plain_install):
    proc = _run(plain_install, "-c", "import atom_kv.reference")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].endswith(EXTRA_HINT), proc.stderr
    assert "MissingExtraError" in proc.stderr  # an ImportError subclass: `except ImportError` still works


def test_the_product_never_imports_the_test_scaffolding():
    """Only the harness users (tests, benches) may import atom_kv.testing."""
    package = os.path.join(REPO_ROOT, "atom_kv")
    offenders = []
    for dirpath, _, files in os.walk(package):
        rel = os.path.relpath(dirpath, package).split(os.sep)[0]
        if rel in ("testing", "bench"):
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    if "atom_kv.testing" in f.read():
                        offenders.append(os.path.relpath(path, REPO_ROOT))
    assert offenders == []


def _imports_into(source: str, module: str, roots: tuple[str, ...]) -> list[str]:
    """The modules under ``roots`` that ``source`` (module ``module``, a package's is ``pkg.__init__``) imports."""
    package = module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            base = ".".join(p for p in (base, node.module or "") if p)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found += [n for n in names if any(n == r or n.startswith(r + ".") for r in roots)]
    return found


def test_the_wheel_holds_no_bench_or_testing_and_what_it_holds_runs_without_them(plain_install, tmp_path):
    """The benches and the test scaffolding stay in the checkout: the wheel has no file of theirs, no module in
    it imports one, and the proxy's, the reference engine's and the demo's entry modules import from the installed
    copy alone (torch lent from this interpreter's site-packages, less any atom_kv there)."""
    excluded = ("atom_kv.bench", "atom_kv.testing")
    with zipfile.ZipFile(plain_install[2]) as zf:
        names = zf.namelist()
        assert "atom_kv/demo/__main__.py" in names and "atom_kv/launch/cluster.py" in names, names
        shipped = [n for n in names if n.startswith(("atom_kv/bench/", "atom_kv/testing/"))]
        assert shipped == []
        offenders = {n: found for n in names if n.endswith(".py")
                     if (found := _imports_into(zf.read(n).decode(), n[:-3].replace("/", "."), excluded))}
    assert offenders == {}
    pytest.importorskip("torch", reason="the reference engine's import needs torch in this interpreter to lend")
    lent = tmp_path / "lent-site-packages"
    lent.mkdir()
    for site_dir in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in os.listdir(site_dir):
            if not entry.startswith(("atom_kv", "__editable__")) and not entry.endswith(".pth") \
                    and not (lent / entry).exists():
                os.symlink(os.path.join(site_dir, entry), lent / entry)
    probe = ("import importlib.util, sys, atom_kv.proxy.__main__, atom_kv.reference.__main__, atom_kv.demo.__main__; "
             "print([m.__file__ for n, m in sorted(sys.modules.items()) if n.split('.')[0] == 'atom_kv' "
             "and getattr(m, '__file__', None) and not m.__file__.startswith(sys.prefix)], "
             "[n for n in %r if importlib.util.find_spec(n) is not None])" % (excluded,))
    proc = _run(plain_install, "-c", probe, timeout=120, env={"PYTHONPATH": str(lent)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[] []", proc.stdout
