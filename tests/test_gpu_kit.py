"""The offline GPU kit and ``scripts/gpu-check.sh``, run here without a GPU.

A kit is built for this machine's Python (without NIXL) from the package
index, then installed by ``gpu-check.sh`` with ``--no-index`` into a fresh
venv. The venv builds on a stand-in for a GPU machine's Python: a venv whose
site-packages hold links to just what such a machine has (torch, numpy,
aiohttp, uvloop, prometheus-client, msgpack, pytest, pytest-timeout,
hypothesis, and what they need), taken from this test environment, so
everything else must come from the kit. With a CPU-only torch every GPU step must be skipped with the reason.
Building the kit needs the index: in CI (``CI=true``) a failed download fails
the test; elsewhere it skips with the reason.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from atom_kv.testing.polling import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
CHECK = os.path.join(SCRIPTS, "gpu-check.sh")
HERE = f"{sys.version_info[0]}.{sys.version_info[1]}"
#: what the issue's air-gapped GPU machine already has
MACHINE_HAS = ["torch", "numpy", "aiohttp", "uvloop", "prometheus-client", "msgpack", "pytest", "pytest-timeout",
               "hypothesis"]

sys.path.insert(0, SCRIPTS)
from gpu_check_steps import steps  # noqa: E402

GPU_STEPS = [s.name for s in steps() if s.needs_gpu]
SETUP_STEPS = [s.name for s in steps() if not s.needs_gpu]


def _base_python() -> str:
    """The interpreter this venv was made from: without this venv's packages."""
    return getattr(sys, "_base_executable", sys.executable)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "GPU_CHECK", "GPU_KIT"))}
    return {**env, **extra}


def _build_kit(kit: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_kit.py"), "--python-version", HERE,
                           "--nixl", "none", "--kit-dir", kit, *extra],
                          capture_output=True, text=True, timeout=300, env=_clean_env())


def _index_needed(proc: subprocess.CompletedProcess) -> None:
    """Fail in CI, skip elsewhere, when the kit could not be downloaded."""
    line = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    if "pip download failed" in line[0] or "pip install failed" in line[0]:
        if os.environ.get("CI"):
            pytest.fail(f"building the GPU kit needs the package index, which CI has: {line[0]}")
        pytest.skip(f"no package index reachable to build the GPU kit: {line[0]}")


def _machine_python(root: str) -> str:
    """A Python whose site-packages hold links to MACHINE_HAS and their dependencies, as installed here."""
    from packaging.requirements import Requirement

    subprocess.run([_base_python(), "-m", "venv", "--without-pip", root], check=True, timeout=120)
    dest = os.path.join(root, "lib", f"python{HERE}", "site-packages")
    seen: set[str] = set()
    todo = list(MACHINE_HAS)
    while todo:
        dist = metadata.distribution(todo.pop())
        key = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if key in seen:
            continue
        seen.add(key)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        for top in {str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}:
            src, dst = os.path.join(str(dist.locate_file("")), top), os.path.join(dest, top)
            if os.path.exists(src) and not os.path.lexists(dst) and top != "__pycache__" and not top.endswith(".pth"):
                os.symlink(src, dst)
    return os.path.join(root, "bin", "python")


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("kit") / "gpu-kit")
    proc = _build_kit(path)
    _index_needed(proc)
    assert proc.returncode == 0, proc.stderr
    return path


def _fake_kit(path) -> str:
    """A kit with nothing to install, for the tests of gpu-check's own control flow."""
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({"python_version": HERE, "nixl": "none"}))
    (path / "requirements.txt").write_text("")
    return str(path)


def test_kit_states_its_size_and_holds_no_torch_numpy_or_nvidia(kit):
    manifest = json.load(open(os.path.join(kit, "manifest.json")))
    files = sorted(f for f in os.listdir(kit) if f.endswith(".whl"))
    assert manifest["python_version"] == HERE and manifest["nixl"] == "none"
    assert sorted(w["file"] for w in manifest["wheels"]) == files
    on_disk = sum(os.path.getsize(os.path.join(kit, f)) for f in os.listdir(kit))
    assert abs(manifest["total_bytes"] - on_disk) < 4096
    assert on_disk < 6 * 2**20, on_disk  # the variant without NIXL: about 3 MiB
    names = {re.split(r"-\d", f, maxsplit=1)[0].lower() for f in files}
    assert {"msgspec", "pyzmq", "quart", "httptools"} <= names
    assert not {n for n in names if n in ("torch", "numpy", "triton") or n.startswith("nvidia")}, names


def test_offline_install_then_every_gpu_step_skipped_without_cuda(kit, tmp_path):
    """The full flow with ``--only bench``: setup steps run, the bench steps skip for want of CUDA (one
    line), the other groups are not selected, and the check exits 0."""
    out = tmp_path / "out"
    python = _machine_python(str(tmp_path / "machine"))
    proc = subprocess.run([CHECK, str(out), "--kit", kit, "--only", "bench"], capture_output=True, text=True,
                          timeout=400, env=_clean_env(GPU_CHECK_PYTHON=python))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    no_cuda = [line for line in proc.stdout.splitlines() if "no CUDA" in line]
    assert len(no_cuda) == 1 and "every GPU step is skipped" in no_cuda[0], proc.stdout
    doc = json.loads((out / "summary.json").read_text())
    assert doc["result"] == "passed" and doc["cut_off_during"] is None
    status = {s["name"]: s for s in doc["steps"]}
    assert [s["name"] for s in doc["steps"]] == SETUP_STEPS + GPU_STEPS
    for name in SETUP_STEPS:
        assert status[name]["status"] == "passed", status[name]
    for name in GPU_STEPS:
        assert status[name]["status"] == "skipped", status[name]
        if name.startswith("bench-"):
            assert status[name]["reason"].startswith("no CUDA: no GPU visible to torch"), status[name]
        else:
            assert status[name]["reason"] == "not selected (--only bench)", status[name]
    assert status["preflight"]["figures"]["collected"] > 0  # the gpu tests import with only the kit installed
    # the stand-in Python is a venv's: its own site-packages (torch) reach the scratch venv through a .pth
    assert "visible through a .pth" in open(status["venv"]["log"]).read()
    install_log = open(status["install-kit"]["log"]).read()
    assert re.search(rf"Processing {re.escape(kit)}/msgspec-", install_log), install_log  # from the kit, no index
    text = (out / "summary.txt").read_text()
    assert "GPU steps skipped: no CUDA" in text and all(name in text for name in GPU_STEPS)


def test_the_full_check_runs_the_gpu_tests_then_the_bench_then_the_e2e_and_only_selects_groups():
    from gpu_check_steps import GROUPS, select

    plan = steps()
    groups = [s.group for s in plan if s.group != "setup"]
    assert groups == sorted(groups, key=GROUPS.index) and set(groups) == set(GROUPS)
    assert [s.name for s in plan if s.group == "tests"] == ["gpu-tests"]
    e2e = {s.name: s.command(_ctx()) for s in plan if s.group == "e2e"}
    tp = {name: (cmd[cmd.index("--tp-prefill") + 1], cmd[cmd.index("--tp-decode") + 1]) for name, cmd in e2e.items()}
    assert tp["e2e-tp2-1"] == ("2", "1") and tp["e2e-tp1-2"] == ("1", "2")
    for name in ("e2e-tp2-1", "e2e-tp1-2"):  # five requests each, and the per-block checksums across unequal TP
        assert "--kv-checksums" in e2e[name] and e2e[name][e2e[name].index("--repeats") + 1] == "5"
    assert select(plan, None) == {}
    left_out = select(plan, ["bench"])
    assert set(left_out) == {s.name for s in plan if s.group in ("tests", "e2e")}
    assert set(select(plan, ["tests", "e2e"])) == {s.name for s in plan if s.group == "bench"}


def _ctx():
    from gpu_check_steps import Context

    return Context(root=ROOT, kit="/kit", manifest={}, venv="/venv")


def test_only_refuses_an_unknown_group_in_one_line(tmp_path):
    proc = subprocess.run([CHECK, str(tmp_path / "out"), "--kit", _fake_kit(tmp_path / "kit"), "--only", "bench,gpu"],
                          capture_output=True, text=True, timeout=60, env=_clean_env())
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "allowed: tests, bench, e2e" in proc.stderr, proc.stderr


def test_a_kit_over_the_limit_is_refused_in_one_line(tmp_path):
    path = str(tmp_path / "kit")
    proc = _build_kit(path, "--max-mib", "0.5")
    _index_needed(proc)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "over the 0.5 MiB limit" in lines[0], proc.stderr
    assert not os.path.exists(os.path.join(path, "manifest.json"))


def test_missing_kit_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([CHECK, str(tmp_path / "out"), "--kit", str(tmp_path / "nowhere")], capture_output=True,
                          text=True, timeout=60, env=_clean_env())
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "no kit at" in proc.stderr and "make gpu-kit" in proc.stderr


def test_a_kit_copied_short_is_one_line_and_exit_2(kit, tmp_path):
    short = tmp_path / "kit"
    shutil.copytree(kit, short)
    wheel = next(p for p in sorted(short.iterdir()) if p.name.startswith("msgspec-"))
    wheel.write_bytes(wheel.read_bytes()[:1000])
    proc = subprocess.run([CHECK, str(tmp_path / "out"), "--kit", str(short)], capture_output=True, text=True,
                          timeout=60, env=_clean_env())
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and f"{wheel.name} is 1000 bytes, not" in proc.stderr, proc.stderr


def test_a_step_past_its_timeout_is_cut_off_and_named(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([CHECK, str(out), "--kit", _fake_kit(tmp_path / "kit")], capture_output=True, text=True,
                          timeout=120, env=_clean_env(GPU_CHECK_FAKE_SLOW_STEP="venv", GPU_CHECK_TIMEOUTS="venv=2"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads((out / "summary.json").read_text())
    status = {s["name"]: s for s in doc["steps"]}
    assert doc["result"] == "failed" and doc["cut_off_during"] is None
    assert status["venv"]["status"] == "cut-off"
    assert status["venv"]["reason"] == "ran past its 2 s timeout"
    assert status["install-kit"]["reason"] == "not run: venv failed"
    assert status["gpu-tests"]["status"] == "skipped" and status["gpu-tests"]["reason"] == "not run: venv failed"


def test_sigterm_mid_step_names_the_step_in_the_summary(tmp_path):
    out = tmp_path / "out"
    with open(tmp_path / "stdout", "w") as stdout:
        proc = subprocess.Popen([CHECK, str(out), "--kit", _fake_kit(tmp_path / "kit")], stdout=stdout,
                                stderr=subprocess.STDOUT, env=_clean_env(GPU_CHECK_FAKE_SLOW_STEP="install-kit"))
    try:
        log = out / "logs" / "02-install-kit.log"
        # its output, not the command line the log starts with
        started = wait_until(lambda: re.search(r"detached child (\d+)", log.read_text()), 120,
                             what="the fake install-kit step")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 128 + signal.SIGTERM, (tmp_path / "stdout").read_text()
    doc = json.loads((out / "summary.json").read_text())
    assert doc["cut_off_during"] == "install-kit" and doc["result"] == "cut-off"
    status = {s["name"]: s for s in doc["steps"]}
    assert status["venv"]["status"] == "passed"
    assert status["install-kit"]["status"] == "cut-off" and "SIGTERM" in status["install-kit"]["reason"]
    assert status["probe"]["reason"] == "not reached: cut off during install-kit"
    assert "cut off by SIGTERM during step install-kit" in (out / "summary.txt").read_text()
    detached = int(started.group(1))
    for pid in (status["install-kit"]["pid"], detached):  # the step ended, with what it left in another session
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "ended 1 process(es) the step left behind" in log.read_text()


def test_summary_reads_the_targets_and_bases_the_bench_prints():
    from gpu_check import _figure_lines
    from gpu_check_steps import transfer_figures

    from atom_kv.transfer.nixl.probe import nixl_unavailable_reason

    if nixl_unavailable_reason():  # `make test` installs NIXL: its host-memory rows carry a target
        pytest.skip(nixl_unavailable_reason())
    out = subprocess.run([sys.executable, "-m", "atom_kv.bench", "transfer", "--backend", "nixl", "--total-mb", "4",
                          "--block-kb", "64", "--repeat", "1", "--json", "--explore"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    (row,) = transfer_figures(out.stdout)["rows"]
    assert row["block_kb"] == 64 and row["base"] == "raw NIXL" and row["base_gbps"] > 0
    assert row["ratio"] == pytest.approx(row["gbps"] / row["base_gbps"], rel=0.01)
    (line,) = _figure_lines({"rows": [row]})
    assert f"x raw NIXL {row['base_gbps']:.2f} GB/s (same run)" in line
    assert line.endswith("met" if row["meets_target"] else "MISSED")


def test_e2e_bench_device_cuda_without_a_gpu_is_one_line_and_exit_2():
    from atom_kv.transfer.memory import gpu_unavailable_reason

    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is visible here")
    out = subprocess.run([sys.executable, "-m", "atom_kv.bench", "e2e", "--device", "cuda"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "e2e bench: --device cuda: no GPU visible" in out.stderr
