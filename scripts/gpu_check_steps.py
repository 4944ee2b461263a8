"""The steps of ``scripts/gpu-check.sh``: what each runs, its own timeout, and
the key figures read back from its log. Standard library only."""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

#: pytest-timeout's limit per gpu test
TEST_TIMEOUT_S = 120
#: a line a step prints to hand its result to gpu-check (the CUDA probe)
RESULT_PREFIX = "GPU_CHECK_RESULT "
#: the transfer bench's reads for nixl: 128 MiB in 64 KiB blocks (where the targets start) and 1 MiB blocks;
#: --explore: a missed target is a figure of the summary (met/MISSED), not a failed step
TRANSFER_ARGS = ["--device", "cuda", "--total-mb", "128", "--block-kb", "64,1024", "--repeat", "3", "--json",
                 "--explore"]
#: the device suite (gpu_ipc, staged tcp): submit, latency, bandwidth per pattern and queue depth, 20 iterations
DEVICE_ARGS = ["--device", "cuda", "--iterations", "20", "--json", "--explore"]
#: staged tcp moves its big read over loopback sockets: 256 MiB, two patterns, to fit its step
STAGED_ARGS = ["--big-mb", "256", "--pattern", "contiguous,subset", "--pattern-block-kb", "64,1024"]
#: the groups --only names, in the order the full check runs them (setup steps always run)
GROUPS = ("tests", "bench", "e2e")

PROBE = r"""
import json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
except Exception as exc:
    out["reason"] = f"torch does not import here ({type(exc).__name__}: {exc}); gpu-check uses the machine's own torch"
else:
    from atom_kv.transfer.memory import gpu_unavailable_reason
    from atom_kv.transfer.nixl.probe import nixl_unavailable_reason
    out["torch"] = torch.__version__
    out["build"] = "ROCm " + str(torch.version.hip) if getattr(torch.version, "hip", None) else (
        "CUDA " + str(torch.version.cuda) if torch.version.cuda else "CPU-only")
    major_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    reason = gpu_unavailable_reason()
    if reason is None and major_minor < (2, 3):
        reason = f"torch {torch.__version__} is older than 2.3, the oldest atom-kv supports"
    out["reason"] = reason
    if reason is None:
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    out["nixl_reason"] = nixl_unavailable_reason()
print("GPU_CHECK_RESULT " + json.dumps(out), flush=True)
"""

#: a venv over this Python's own packages (its torch); where ensurepip is missing (Debian's python3 without
#: python3-venv) one without pip, which then runs this Python's own pip. When this Python is itself a venv's,
#: --system-site-packages would reach only its base: a .pth names this venv's site-packages too.
MAKE_VENV = r"""
import os, site, subprocess, sys, sysconfig, venv
target = {venv!r}
try:
    venv.create(target, system_site_packages=True, with_pip=True)
except Exception as exc:
    print(f"venv with pip failed ({{exc}}); trying without pip, using this Python's own pip", flush=True)
    venv.create(target, system_site_packages=True, with_pip=False, clear=True)
    if subprocess.call([target + "/bin/python", "-m", "pip", "--version"]) != 0:
        sys.exit("this Python has neither ensurepip nor pip; install python3-venv or python3-pip")
if sys.prefix != sys.base_prefix:
    purelib = sysconfig.get_path("purelib", vars={{"base": target, "platbase": target}})
    with open(os.path.join(purelib, "_gpu_check_parent_site.pth"), "w") as f:
        f.writelines(p + "\n" for p in site.getsitepackages())
    print("this Python is a venv's: its site-packages are visible through a .pth", flush=True)
"""

#: the checkout runs in place: a .pth in the venv names it (no build backend needed; Python 3.12 venvs
#: come without setuptools), then a fresh interpreter outside the checkout must import it from there
CHECKOUT_PTH = r"""
import os, subprocess, sys, sysconfig
root = {root!r}
with open(os.path.join(sysconfig.get_paths()["purelib"], "atom_kv_checkout.pth"), "w") as f:
    f.write(root + "\n")
out = subprocess.run([sys.executable, "-c", "import atom_kv; print(atom_kv.__file__)"], cwd="/",
                     capture_output=True, text=True)
path = out.stdout.strip()
if out.returncode or not path.startswith(os.path.join(root, "atom_kv")):
    sys.exit(f"atom_kv imports from {{path or out.stderr.strip()}}, not from the checkout {{root}}")
print("atom_kv from", os.path.dirname(path))
"""

#: the modules the gpu tests and the bench start (proxy, engines, bench suites): a missing wheel shows here
PREFLIGHT_IMPORTS = ("atom_kv.proxy.server", "atom_kv.proxy.__main__", "atom_kv.reference.server",
                     "atom_kv.reference.__main__", "atom_kv.bench.transfer", "atom_kv.bench.e2e", "msgspec", "zmq")


@dataclass
class Step:
    """One step: its command, its own timeout, whether it needs a GPU, how to read its log,
    and its group (``setup``, or one that ``--only`` names: :data:`GROUPS`)."""

    name: str
    timeout_s: float
    needs_gpu: bool
    command: Callable[["Context"], list[str]]
    figures: Callable[[str], dict[str, Any]] = lambda log: {}
    #: a reason to skip it (given the probe's result), or None
    skip_if: Callable[["Context"], Optional[str]] = lambda ctx: None
    group: str = "setup"


@dataclass
class Context:
    """What the steps share: the checkout, the kit, the scratch venv, the probe's result."""

    root: str
    kit: str
    manifest: dict[str, Any]
    venv: str
    base_python: str = sys.executable
    probe: dict[str, Any] = field(default_factory=dict)

    @property
    def python(self) -> str:
        return os.path.join(self.venv, "bin", "python")


def gpu_test_files(root: str) -> list[str]:
    """Test files that hold ``gpu``-marked tests (a mark on a test, a module or a parameter)."""
    found = []
    for top, dirs, files in os.walk(os.path.join(root, "tests")):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for f in sorted(files):
            if f.startswith("test_") and f.endswith(".py"):
                path = os.path.join(top, f)
                with open(path, encoding="utf-8") as fh:
                    if "mark.gpu" in fh.read():
                        found.append(os.path.relpath(path, root))
    return found


def pytest_counts(log: str) -> dict[str, Any]:
    """pytest's closing counts (``3 passed, 2 skipped in 4.1s``; ``64/147 tests collected (83 deselected)``)."""
    words = r"passed|failed|skipped|errors?|xfailed|deselected"
    tail = [line for line in log.splitlines() if re.search(rf"\d+ ({words})|\d+ tests? collected", line)]
    if not tail:
        return {}
    found = re.findall(rf"(\d+) ({words})", tail[-1])
    counts = {word if word.endswith("ed") else "errors": int(n) for n, word in found}
    collected = re.search(r"(\d+)(?:/\d+)? tests? collected", tail[-1])
    if collected:
        counts["collected"] = int(collected.group(1))
    return counts


def json_lines(log: str) -> list[dict[str, Any]]:
    rows = []
    for line in log.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


#: what the summary keeps of a transfer bench row
TRANSFER_KEYS = ("case", "pattern", "block_kb", "total_kb", "total_mb", "queue_depth", "ranges", "gbps", "verified",
                 "target", "meets_target", "held", "base", "base_gbps", "ratio", "ceiling_events_gbps",
                 "submit_p50_us", "completion_p50_us", "p50_us", "p99_us", "error")


def transfer_figures(log: str) -> dict[str, Any]:
    """Per row: GB/s or µs, the base measured in the same run, the ratio, the target and whether it was met."""
    rows = []
    for r in json_lines(log):
        if "block_kb" not in r and "case" not in r:
            continue
        rows.append({k: r[k] for k in TRANSFER_KEYS if k in r})
    return {"rows": rows} if rows else {}


def e2e_figures(log: str) -> dict[str, Any]:
    start = log.find("{\n")
    if start < 0:
        return {}
    try:
        doc = json.loads(log[start:log.rfind("}") + 1])
    except ValueError:
        return {}
    keys = ("prompt_bytes", "pd_ttft_ms", "colocated_ttft_ms", "pd_equals_colocated", "kv_mib", "kv_gb_per_s")
    out = {"equal_tp": doc.get("tp_prefill") == doc.get("tp_decode"), "tp": f"{doc.get('tp_prefill')}->"
           f"{doc.get('tp_decode')}", "repeats": doc.get("repeats"), "pd_equals_colocated": doc.get("pd_equals_colocated"),
           "rows": [{k: r[k] for k in keys if k in r} for r in doc.get("results", [])]}
    if "kv_checksums" in doc:
        out["kv_checksums"] = doc["kv_checksums"]
    return out


def preflight_script(files: list[str]) -> str:
    return ("import importlib, sys\n"
            f"for name in {list(PREFLIGHT_IMPORTS)!r}:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ImportError as exc:\n"
            "        sys.exit(f'preflight: {name} does not import: {exc} (not in the kit, nor on this machine)')\n"
            "import pytest\n"
            f"sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', '-m', 'gpu', '--timeout', "
            f"'{TEST_TIMEOUT_S}', *{files!r}]))\n")


def parallel_args(ctx: Context) -> list[str]:
    """pytest-xdist's flags where the machine has it (one worker per test file, at most 6): the gpu tests
    start engines and take minutes one after another; without xdist they run in turn."""
    import subprocess

    if subprocess.call([ctx.python, "-c", "import xdist"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL) != 0:
        return []
    return ["-n", str(max(1, min(6, (os.cpu_count() or 2) // 2))), "--dist", "loadfile"]


def no_nixl(ctx: Context) -> Optional[str]:
    """Skipped for a kit without NIXL; with NIXL in the kit, the bench runs (and fails if NIXL does not load)."""
    if ctx.manifest.get("nixl", "none") == "none":
        return "the kit was built without NIXL (NIXL=none)"
    return None


def e2e(tp_prefill: int, tp_decode: int, repeats: int, sizes: str) -> Callable[["Context"], list[str]]:
    """The reference engines on the GPU: P/D against colocated, TTFT (median of the repeats' mean) and the same
    text, and the KV the decode engine loaded compared block by block with what the prefill lent."""
    return lambda ctx: [ctx.python, "-m", "atom_kv.bench", "e2e", "--device", "cuda", "--tp-prefill", str(tp_prefill),
                        "--tp-decode", str(tp_decode), "--sizes", sizes, "--repeats", str(repeats), "--max-tokens", "32",
                        "--kv-checksums", "--json"]


def select(plan: list[Step], only: Optional[list[str]]) -> dict[str, str]:
    """Step name -> why it is skipped, for the steps ``--only`` leaves out (setup steps always run)."""
    if not only:
        return {}
    return {s.name: f"not selected (--only {','.join(only)})" for s in plan if s.group != "setup" and s.group not in only}


def steps() -> list[Step]:
    def bench(*extra: str) -> Callable[[Context], list[str]]:
        return lambda ctx: [ctx.python, "-m", "atom_kv.bench", "transfer", *extra, *TRANSFER_ARGS]

    def device(*extra: str) -> Callable[[Context], list[str]]:
        return lambda ctx: [ctx.python, "-m", "atom_kv.bench", "transfer", *extra, *DEVICE_ARGS]

    return [
        Step("venv", 60, False, lambda ctx: [ctx.base_python, "-c", MAKE_VENV.format(venv=ctx.venv)]),
        Step("install-kit", 150, False, lambda ctx: [
            ctx.python, "-m", "pip", "install", "--no-index", "--find-links", ctx.kit, "--no-cache-dir",
            "--disable-pip-version-check", "-r", os.path.join(ctx.kit, "requirements.txt")]),
        Step("install-checkout", 30, False, lambda ctx: [ctx.python, "-c", CHECKOUT_PTH.format(root=ctx.root)]),
        Step("preflight", 90, False, lambda ctx: [ctx.python, "-c", preflight_script(gpu_test_files(ctx.root))],
             figures=pytest_counts),
        Step("probe", 60, False, lambda ctx: [ctx.python, "-c", PROBE]),
        # the whole gpu test set first, then the bench, then the engines end to end
        Step("gpu-tests", 300, True, lambda ctx: [
            ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--tb=short", "-m", "gpu",
            "--timeout", str(TEST_TIMEOUT_S), *parallel_args(ctx), *gpu_test_files(ctx.root)],
             figures=pytest_counts, group="tests"),
        Step("bench-gpu-ipc", 120, True, device("--backend", "gpu_ipc"), figures=transfer_figures, group="bench"),
        Step("bench-tcp-staged", 120, True, device("--backend", "tcp", *STAGED_ARGS), figures=transfer_figures,
             group="bench"),
        Step("bench-nixl-vram", 60, True, bench("--backend", "nixl"), figures=transfer_figures,
             skip_if=no_nixl, group="bench"),
        Step("e2e-tp2-1", 150, True, e2e(2, 1, 5, "512,4096"), figures=e2e_figures, group="e2e"),
        Step("e2e-tp1-2", 120, True, e2e(1, 2, 5, "512,4096"), figures=e2e_figures, group="e2e"),
        Step("e2e-tp1-1", 120, True, e2e(1, 1, 5, "512,2048"), figures=e2e_figures, group="e2e"),
    ]
