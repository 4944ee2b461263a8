"""``scripts/gpu-check.sh OUTDIR``: check a GPU machine offline, in minutes.

Creates a scratch venv on top of this Python's own packages (its torch),
installs the kit (``make gpu-kit``) with ``--no-index``, runs the checkout in
place, then the whole ``gpu`` test set, the GPU bench, and the reference
engines end to end (TP 2 -> 1 and 1 -> 2 with the per-block KV checksums,
then 1 -> 1, five requests each), each step in its own process group with
its own timeout, all inside one budget (``--budget-s``, 450 s by default:
done inside 8 minutes). ``--only tests,bench,e2e`` runs just those groups
after the setup steps (a short device slot: ``--only bench``). Writes ``OUTDIR/summary.txt``,
``OUTDIR/summary.json`` (rewritten after every step, so a hard kill still
leaves the step it was on, marked ``running``) and each step's log in
``OUTDIR/logs/``. SIGTERM or SIGINT ends the current step, records it as
``cut-off`` and the rest as not reached.

Without CUDA (no GPU, a CPU-only torch, no torch): one line saying why,
every GPU step skipped with that reason, exit 0. Exit 1 when a step failed
or was cut off by its timeout, 2 for a missing or mismatched kit, 128 + the
signal's number when cut off by a signal.

Processes a step leaves behind, also those in sessions of their own (the
test clusters' engines), are ended after it: gpu-check is their subreaper.

Test hooks (standard library only, named as fakes): ``GPU_CHECK_FAKE_SLOW_STEP=NAME``
replaces that step's command with a sleep that also leaves a detached child;
``GPU_CHECK_TIMEOUTS=name=s,...`` overrides timeouts.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from gpu_check_steps import GROUPS, RESULT_PREFIX, Context, Step, select, steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BUDGET_S = 450.0  # plus at most 20 s to end a step cut off at the deadline: inside 8 minutes
KILL_GRACE_S = 5.0
PR_SET_CHILD_SUBREAPER = 36
#: the stand-in for a hanging step: sleeps, after starting a child in a session of its own
FAKE_SLOW_STEP = ("import subprocess, sys, time\n"
                  "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
                  "start_new_session=True)\n"
                  "print(f'fake slow step: sleeping; detached child {child.pid}', flush=True)\n"
                  "time.sleep(600)\n")
#: pip settings of this shell that would let the offline install reach anything but the kit
PIP_ENV_DROP = ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_REQUIREMENT")


class CutOff(Exception):
    """SIGTERM or SIGINT arrived while a step ran."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_cut_off(signum: int, _frame: Any) -> None:
    raise CutOff(signum)


class Summary:
    """The per-step records and their two renderings, rewritten after every change."""

    def __init__(self, out: str, ctx: Context, budget_s: float) -> None:
        self.out, self.ctx, self.budget_s = out, ctx, budget_s
        self.steps: list[dict[str, Any]] = []
        self.started = time.time()
        self.note = ""
        self.cut_off_during: Optional[str] = None
        self.step_started = time.monotonic()

    def record(self, **row: Any) -> dict[str, Any]:
        self.steps = [s for s in self.steps if s["name"] != row["name"]] + [row]
        self.write()
        return row

    def result(self) -> str:
        """``cut-off``, ``failed`` (a step failed or ran past its timeout), ``running`` or ``passed``."""
        states = {s["status"] for s in self.steps}
        if self.cut_off_during:
            return "cut-off"
        if states & {"failed", "cut-off"}:
            return "failed"
        return "running" if "running" in states else "passed"

    def doc(self) -> dict[str, Any]:
        m = self.ctx.manifest
        return {
            "result": self.result(), "kit_source_commit": m.get("source_commit"),
            "checkout": ROOT, "kit": self.ctx.kit, "kit_python": m.get("python_version"), "kit_nixl": m.get("nixl"),
            "python": sys.version.split()[0], "budget_s": self.budget_s,
            "seconds": round(time.time() - self.started, 1), "note": self.note,
            "cut_off_during": self.cut_off_during, "probe": self.ctx.probe, "steps": self.steps,
        }

    def write(self) -> None:
        doc = self.doc()
        _atomic_write(os.path.join(self.out, "summary.json"), json.dumps(doc, indent=2) + "\n")
        lines = [f"gpu-check: {doc['result']}, {doc['seconds']:.0f} s of a {self.budget_s:.0f} s budget; kit {self.ctx.kit} "
                 f"(Python {doc['kit_python']}, NIXL {doc['kit_nixl']}); Python {doc['python']}"]
        if self.ctx.probe.get("torch"):
            lines.append(f"torch {self.ctx.probe['torch']} ({self.ctx.probe.get('build')}), GPUs: "
                         f"{', '.join(self.ctx.probe.get('devices') or []) or 'none'}")
        if self.note:
            lines.append(self.note)
        for s in self.steps:
            line = f"{s['name']:<24} {s['status']:<8} {s['seconds']:6.1f} s"
            if s.get("reason"):
                line += f"  {s['reason']}"
            lines.append(line)
            lines += [f"{'':<26}{text}" for text in _figure_lines(s.get("figures") or {})]
        _atomic_write(os.path.join(self.out, "summary.txt"), "\n".join(lines) + "\n")


def _target_text(row: dict[str, Any]) -> str:
    if not row.get("target"):
        return ""
    if row.get("held") is False:
        return f"; target {row['target']} (not held here)"
    return f"; target {row['target']}: {'met' if row.get('meets_target') else 'MISSED'}"


def _case_line(row: dict[str, Any]) -> str:
    case = row["case"]
    if case == "submit":
        text = f"submit, {row.get('ranges')} ranges: p50 {row.get('submit_p50_us', 0):.1f} us of host time"
    elif case == "latency":
        text = (f"latency {row.get('total_kb')} KiB {row.get('pattern')}: p50 {row.get('p50_us', 0):.1f} us (submit "
                f"{row.get('submit_p50_us', 0):.1f} + completion {row.get('completion_p50_us', 0):.1f}), p99 "
                f"{row.get('p99_us', 0):.1f} us")
    else:
        text = (f"{row.get('pattern')} {row.get('block_kb')} KiB blocks, {row.get('total_mb')} MiB"
                + (f" x qd {row['queue_depth']}" if "queue_depth" in row else "")
                + f": {row.get('gbps', 0):.2f} GB/s = {row.get('ratio', 0):.2f} x {row.get('base')} "
                  f"{row.get('base_gbps', 0):.2f} GB/s (same run)")
    text += _target_text(row)
    if row.get("error"):
        text += f"; error: {row['error']}"
    return text


def _figure_lines(figures: dict[str, Any]) -> list[str]:
    out = []
    for row in figures.get("rows", []):
        if "case" in row:
            out.append(_case_line(row))
        elif "block_kb" in row:
            text = f"{row['block_kb']:>5} KiB: {row.get('gbps', 0):.2f} GB/s"
            if row.get("base"):
                text += (f" = {row.get('ratio', 0):.2f} x {row['base']} {row.get('base_gbps', 0):.2f} GB/s "
                         "(same run)")
            if row.get("target"):
                text += f"; target {row['target']}: {'met' if row.get('meets_target') else 'MISSED'}"
            if row.get("error"):
                text += f"; error: {row['error']}"
            out.append(text)
        elif "prompt_bytes" in row:
            out.append(f"{row['prompt_bytes']:>5} B prompt: TTFT P/D {row.get('pd_ttft_ms', 0):.0f} ms, colocated "
                       f"{row.get('colocated_ttft_ms', 0):.0f} ms; P/D text == colocated: "
                       f"{row.get('pd_equals_colocated')}")
    sums = figures.get("kv_checksums")
    if sums:
        out.append(f"TP {figures.get('tp')}: KV loaded == KV lent, per block, layer, k/v and head: "
                   f"{sums.get('compared')} compared, {sums.get('differ')} differ, {sums.get('missing')} not lent: "
                   f"{'met' if sums.get('equal') else 'MISSED'}")
    counts = {k: v for k, v in figures.items() if isinstance(v, int) and not isinstance(v, bool) and k != "repeats"}
    if counts:
        out.append(", ".join(f"{v} {k}" for k, v in counts.items()))
    return out


def _atomic_write(path: str, text: str) -> None:
    tmp = path + ".partial"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's process group, SIGKILL after a grace period."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _become_subreaper() -> None:
    """Orphans of the steps become our children, so that nothing a step started outlives it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            out.append(pid)
            todo.append(pid)
    return out


def _end_leftovers() -> int:
    """SIGTERM, then SIGKILL after a grace period, to every process still below this one; how many there were."""
    left = _descendants(os.getpid())
    found = len(left)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + KILL_GRACE_S
        while left and time.monotonic() < deadline:
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:  # reap the orphans handed to us
                    pass
            except ChildProcessError:
                pass
            left = _descendants(os.getpid())
            if left:
                time.sleep(0.1)
        if not left:
            break
    return found


def _tail(path: str, lines: int = 3) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(text[-lines:])[:400]


def _env_for(step: Step) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if step.name == "install-kit":
        env = {k: v for k, v in env.items() if k not in PIP_ENV_DROP}
        env["PIP_CONFIG_FILE"] = os.devnull  # nothing but the kit: no mirrors, wheel folders or constraints
    return env


def run_step(step: Step, ctx: Context, logs: str, index: int, timeout_s: float, summary: Summary) -> dict[str, Any]:
    log_path = os.path.join(logs, f"{index:02d}-{step.name}.log")
    cmd = step.command(ctx)
    fake = os.environ.get("GPU_CHECK_FAKE_SLOW_STEP") == step.name
    if fake:  # a stand-in for a step that hangs, for gpu-check's own tests
        cmd = [sys.executable, "-c", FAKE_SLOW_STEP]
    start = summary.step_started = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ctx.root, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_env_for(step), start_new_session=True)
        try:
            summary.record(name=step.name, status="running", seconds=0.0, reason="", figures={}, log=log_path,
                           pid=proc.pid)
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            return dict(name=step.name, status="cut-off", seconds=round(time.monotonic() - start, 1),
                        reason=f"ran past its {timeout_s:.0f} s timeout", figures={}, log=log_path)
        except CutOff:
            _stop_group(proc)
            raise
        finally:
            if proc.poll() is None:
                _stop_group(proc)
            leftovers = _end_leftovers()
            if leftovers:
                log.write(f"gpu-check: ended {leftovers} process(es) the step left behind\n")
    with open(log_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    row = dict(name=step.name, status="passed" if rc == 0 else "failed", seconds=round(time.monotonic() - start, 1),
               reason="" if rc == 0 else f"exit {rc}: {_tail(log_path)}", figures=step.figures(text), log=log_path)
    if step.name == "probe" and rc == 0:
        ctx.probe.update(next((json.loads(line[len(RESULT_PREFIX):]) for line in text.splitlines()
                               if line.startswith(RESULT_PREFIX)), {}))
    return row


def load_kit(kit: str) -> tuple[Optional[dict[str, Any]], str]:
    """(manifest, "") or (None, the one-line reason the kit cannot be used here)."""
    path = os.path.join(kit, "manifest.json")
    if not os.path.isfile(path):
        return None, (f"no kit at {kit} (no manifest.json): build it where an index is reachable with "
                      f"`make gpu-kit PYTHON_VERSION={sys.version_info[0]}.{sys.version_info[1]}`, copy the folder "
                      "here, and name it with --kit or GPU_KIT")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    for wheel in manifest.get("wheels", []):  # a copy cut short shows here, not as a failed install
        path = os.path.join(kit, wheel["file"])
        size = os.path.getsize(path) if os.path.isfile(path) else -1
        if size != wheel["bytes"]:
            state = "missing" if size < 0 else f"{size} bytes, not {wheel['bytes']}"
            return None, f"the kit at {kit} is incomplete: {wheel['file']} is {state}; copy the kit again"
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if manifest.get("python_version") != here:
        return None, (f"the kit at {kit} is for Python {manifest.get('python_version')}, this is Python {here}: "
                      f"rebuild it with `make gpu-kit PYTHON_VERSION={here}` or run with GPU_CHECK_PYTHON=python"
                      f"{manifest.get('python_version')}")
    return manifest, ""


def _timeouts() -> dict[str, float]:
    text = os.environ.get("GPU_CHECK_TIMEOUTS", "")
    return {k.strip(): float(v) for k, _, v in (p.partition("=") for p in text.split(",") if p.strip())}


def check(args: argparse.Namespace) -> int:
    kit = os.path.abspath(args.kit)
    manifest, why = load_kit(kit)
    if manifest is None:
        print(f"gpu-check: {why}", file=sys.stderr)
        return 2
    out = os.path.abspath(args.outdir)
    logs = os.path.join(out, "logs")
    os.makedirs(logs, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="atom-kv-gpu-check-")
    ctx = Context(root=ROOT, kit=kit, manifest=manifest, venv=os.path.join(scratch, "venv"))
    summary = Summary(out, ctx, args.budget_s)
    deadline = time.monotonic() + args.budget_s
    overrides = _timeouts()
    plan = steps()
    not_selected = select(plan, args.only)
    failed = ""
    no_gpu: Optional[str] = None
    _become_subreaper()
    signal.signal(signal.SIGTERM, _raise_cut_off)
    signal.signal(signal.SIGINT, _raise_cut_off)
    current = plan[0]
    try:
        for i, step in enumerate(plan, 1):
            current = step
            reason = (not_selected.get(step.name) or (f"not run: {failed} failed" if failed else
                      no_gpu if step.needs_gpu and no_gpu else step.skip_if(ctx) if step.needs_gpu else None))
            left = deadline - time.monotonic()
            if not reason and left < 1:
                reason = f"not run: the {args.budget_s:.0f} s budget was spent"
            if reason:
                summary.record(name=step.name, status="skipped", seconds=0.0, reason=reason, figures={})
                continue
            print(f"gpu-check [{i}/{len(plan)}] {step.name} ...", flush=True)
            row = summary.record(**run_step(step, ctx, logs, i, min(overrides.get(step.name, step.timeout_s), left),
                                            summary))
            print(f"gpu-check [{i}/{len(plan)}] {step.name}: {row['status']} ({row['seconds']:.1f} s)"
                  + (f": {row['reason']}" if row["reason"] else ""), flush=True)
            if row["status"] != "passed" and not step.needs_gpu:
                failed = step.name
            if step.name == "probe" and row["status"] == "passed" and ctx.probe.get("reason"):
                no_gpu = f"no CUDA: {ctx.probe['reason']}"
                summary.note = f"GPU steps skipped: {no_gpu}"
                print(f"gpu-check: {no_gpu}; every GPU step is skipped (summary: {out}/summary.txt)", flush=True)
    except CutOff as exc:
        summary.cut_off_during = current.name
        summary.note = f"cut off by {exc} during step {current.name}"
        row = next((s for s in summary.steps if s["name"] == current.name), {})
        summary.record(name=current.name, status="cut-off", seconds=round(time.monotonic() - summary.step_started, 1),
                       reason=f"gpu-check got {exc}", figures={}, log=row.get("log", ""), pid=row.get("pid"))
        for step in plan[plan.index(current) + 1:]:
            summary.record(name=step.name, status="skipped", seconds=0.0,
                           reason=f"not reached: cut off during {current.name}", figures={})
        print(f"gpu-check: cut off by {exc} during step {current.name} (summary: {out}/summary.txt)",
              file=sys.stderr, flush=True)
        return 128 + exc.signum
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        summary.write()
        if not args.keep_venv:
            shutil.rmtree(scratch, ignore_errors=True)
    bad = [s["name"] for s in summary.steps if s["status"] in ("failed", "cut-off")]
    print(f"gpu-check: {'all steps passed or skipped' if not bad else 'not passed: ' + ', '.join(bad)} "
          f"({summary.doc()['seconds']:.0f} s); summary in {out}/summary.txt", flush=True)
    return 1 if bad else 0


class _OneLineParser(argparse.ArgumentParser):
    """Refuses a bad argument in one line (``PROG: error: WHAT (see PROG --help)``), exit status 2."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: Optional[list[str]] = None) -> int:
    p = _OneLineParser(prog="scripts/gpu-check.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", help="where summary.txt, summary.json and the step logs go")
    p.add_argument("--kit", default=os.environ.get("GPU_KIT") or os.path.join(ROOT, "gpu-kit"),
                   help="the kit folder (default: GPU_KIT, else gpu-kit/ in the checkout)")
    p.add_argument("--budget-s", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET_S") or DEFAULT_BUDGET_S),
                   help="all steps together end within this many seconds")
    p.add_argument("--keep-venv", action="store_true", help="keep the scratch venv (its path is in the logs)")
    p.add_argument("--only", type=_groups, default=None, metavar="STEPS",
                   help=f"run only these groups of steps after the setup, comma-separated: {', '.join(GROUPS)} "
                        "(the full check runs all three, in this order)")
    return check(p.parse_args(argv))


def _groups(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in GROUPS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--only {text!r}: allowed: {', '.join(GROUPS)} (comma-separated)")
    return names


if __name__ == "__main__":
    sys.exit(main())
