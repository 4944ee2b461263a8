"""The README's and docs/quickstart.md's shell blocks, run as a reader runs them, so the docs cannot drift
from the code.

Every ```` ```bash ```` block of those pages carries a mark on the line before it, and a block without
one fails this file (a new block must choose):

- ``<!-- docs-test: run -->``: run as one script (``set -e``) in the page's folder; it must exit 0, and
  with ``; expect: TEXT`` print TEXT;
- ``<!-- docs-test: start -->``: its commands are started one by one; one that is done within
  :data:`SETTLE_S` must have exited 0, the others are servers, kept running until the page is done;
- ``<!-- docs-test: wait; expect: TEXT -->``: run again every second until it exits 0 and prints TEXT,
  at most :data:`WAIT_S` seconds (a started server that exits meanwhile fails the page at once);
- ``<!-- docs-test: check -->``: for commands too long to run here (``make demo``, ``make test``, the
  benches): ``make`` lines are checked with ``make -n``, ``python -m atom_kv.bench ...`` lines are parsed by
  the bench's own parser (suite and every flag), any other ``python -m MODULE`` line runs with ``--help``;
  the interpreter must be ``.venv/bin/python``;
- ``<!-- docs-test: skip (why) -->``: not run; the reason is required.

Each page's blocks run in order in a fresh temporary folder laid out as a clean clone: a link to each
tracked top-level entry of the checkout and ``.venv`` pointing at the virtualenv running this test. HOME is
that folder too, so ``~/.atom-kv-token`` never touches the real home.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/quickstart.md")
MODES = ("run", "start", "wait", "check", "skip")
#: a started command done within this many seconds is a step (it must exit 0), else a server
SETTLE_S = 2.0
#: the longest a `wait` block is retried (the by-hand engines start in 10-30 s on two busy cores)
WAIT_S = 120.0
#: a `run` or `check` command's limit
RUN_S = 60.0
#: how long started servers get to stop on SIGTERM
STOP_S = 15.0

_MARK = re.compile(r"^<!-- docs-test: (?P<mode>[a-z]+)(?P<rest>.*?)\s*-->$")
_FENCE = re.compile(r"^```bash\s*$")


@dataclass
class Block:
    """One ```` ```bash ```` block of a page, with its mark."""

    page: str
    line: int  # 1-based line of the opening fence
    text: str
    mode: Optional[str]  # None: unmarked
    expect: str = ""
    why: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks_of(page: str, text: Optional[str] = None) -> list[Block]:
    """Every bash block of ``page`` (its text read from the checkout unless given), with its mark or None."""
    lines = (text if text is not None else (ROOT / page).read_text(encoding="utf-8")).splitlines()
    out = []
    i = 0
    while i < len(lines):
        if not _FENCE.match(lines[i]):
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        i += 1
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.match(before)
        block = Block(page, start + 1, "\n".join(body) + "\n", mark.group("mode") if mark else None)
        if mark:
            rest = mark.group("rest").strip()
            if block.mode == "skip":
                block.why = rest.strip("()").strip()
            elif rest.startswith("; expect: "):
                block.expect = rest[len("; expect: "):]
            elif rest:
                block.mode = f"unknown mark {before!r}"
        out.append(block)
    return out


def commands_of(script: str) -> list[str]:
    """A block's commands, one per entry: continuation lines and quotes spanning lines joined, comments and
    blank lines dropped."""
    out, pending = [], ""
    for line in script.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line + "\n"
        if line.endswith("\\"):
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        out.append(pending.strip())
        pending = ""
    assert not pending, f"an unterminated command: {pending!r}"
    return out


# ---------------------------------------------------------------------- every block chooses
@pytest.mark.parametrize("page", PAGES)
def test_every_bash_block_is_marked(page):
    found = blocks_of(page)
    assert found, f"{page} has no bash block: is the fence still ```bash?"
    bad = [f"{b.where}: {b.mode or 'no <!-- docs-test: ... --> mark on the line before the fence'}"
           for b in found if b.mode not in MODES]
    assert bad == [], f"mark each block with one of {', '.join(MODES)} (this file's docstring): {bad}"
    assert [b.where for b in found if b.mode == "skip" and not b.why] == [], "a skip says why"
    assert [b.where for b in found if b.mode == "wait" and not b.expect] == [], "a wait says what it waits for"


def test_an_unmarked_or_unknown_block_is_found():
    page = ("text\n\n```bash\necho unmarked\n```\n\n<!-- docs-test: run -->\n```bash\necho ok\n```\n"
            "<!-- docs-test: frobnicate -->\n```bash\necho what\n```\n<!-- docs-test: skip (needs a GPU) -->\n"
            "```bash\nnvidia-smi\n```\n")
    modes = [(b.line, b.mode, b.why) for b in blocks_of("x.md", page)]
    assert modes == [(3, None, ""), (8, "run", ""), (12, "frobnicate", ""), (16, "skip", "needs a GPU")]


def test_commands_join_continuations_and_quoted_newlines():
    script = ("# a comment\nA=1 tool --flag \\\n  --json '{\"a\": 1,\n  \"b\": 2}'\n\n"
              "(umask 077; echo x > f)   # trailing\n")
    assert commands_of(script) == ["A=1 tool --flag \\\n  --json '{\"a\": 1,\n  \"b\": 2}'",
                                   "(umask 077; echo x > f)   # trailing"]


# ---------------------------------------------------------------------- the page's folder
def _tracked_top_level() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True)
        names = {line.split("/", 1)[0] for line in out.stdout.splitlines() if line}
    except (OSError, subprocess.SubprocessError):  # not a git checkout: what a clean clone would hold
        names = {n for n in os.listdir(ROOT) if not n.startswith((".venv", ".git", ".pytest", ".hypothesis"))}
    return sorted(n for n in names if (ROOT / n).exists())


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A fresh folder laid out as a clean clone after ``make venv``."""
    for name in _tracked_top_level():
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    return tmp_path


def _env(clone: Path) -> dict[str, str]:
    env = dict(os.environ, HOME=str(clone))
    env.pop("VIRTUAL_ENV", None)
    return env


class Servers:
    """The processes a `start` block left running, each in its own session, stopped once."""

    def __init__(self, clone: Path) -> None:
        self.clone = clone
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, command: str) -> None:
        log = self.clone / f"started-{len(self.procs)}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(["bash", "-c", command], cwd=self.clone, env=_env(self.clone), stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(SETTLE_S)
        except subprocess.TimeoutExpired:
            self.procs.append((command, proc, log))
            return
        assert rc == 0, f"`{command}` exited {rc}:\n{log.read_text(errors='replace')[-3000:]}"

    def check_alive(self) -> None:
        for command, proc, log in self.procs:
            assert proc.poll() is None, (f"`{command}` exited {proc.returncode}:\n"
                                         f"{log.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        for _, proc, _ in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self.procs = []


@pytest.fixture
def servers(clone: Path) -> Iterator[Servers]:
    s = Servers(clone)
    try:
        yield s
    finally:
        s.stop()


def _run_script(script: str, clone: Path, timeout: float = RUN_S) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", "set -e\n" + script], cwd=clone, env=_env(clone), capture_output=True,
                          text=True, timeout=timeout)


def _ports_taken(text: str) -> list[int]:
    """The fixed ports a `start` block names that something on this host already holds."""
    taken = []
    for port in sorted({int(p) for p in re.findall(r"port\"?[\s:=]+(\d{3,5})\b", text)}):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no holder
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                taken.append(port)
    return taken


# ---------------------------------------------------------------------- check: the long commands exist
def _check_command(command: str, clone: Path) -> None:
    from atom_kv.bench.__main__ import parse_args

    words = shlex.split(command, comments=True)
    if words[0] == "make":
        out = subprocess.run(["make", "-n", *words[1:]], cwd=clone, env=_env(clone), capture_output=True,
                             text=True, timeout=RUN_S)
        assert out.returncode == 0, f"`make -n {' '.join(words[1:])}` failed: {out.stderr[-2000:]}"
        return
    assert words[0] == ".venv/bin/python", (f"`{command}`: write .venv/bin/python (a system python lacks the "
                                            "dependencies)")
    assert (clone / words[0]).exists(), f"{words[0]} is not in a clone after make venv"
    assert words[1] == "-m", f"`{command}`: only `-m MODULE` lines can be checked"
    module, args = words[2], words[3:]
    if module == "atom_kv.bench":
        try:
            parse_args(args)
        except SystemExit as exc:
            pytest.fail(f"`{command}`: the bench refuses its arguments (exit {exc.code})")
        return
    out = subprocess.run([str(clone / words[0]), "-m", module, *args, "--help"], cwd=clone, env=_env(clone),
                         capture_output=True, text=True, timeout=RUN_S)
    assert out.returncode == 0, f"`{command} --help` failed: {out.stderr[-2000:]}"


@pytest.mark.parametrize("block", [b for page in PAGES for b in blocks_of(page) if b.mode == "check"],
                         ids=lambda b: b.where)
def test_check_blocks_name_commands_that_exist(block: Block, clone: Path):
    assert shutil.which("make") or "make " not in block.text, "make is not installed: the docs' commands need it"
    commands = commands_of(block.text)
    assert commands, f"{block.where}: a check block without a command"
    for command in commands:
        _check_command(command, clone)


# ---------------------------------------------------------------------- run, start, wait: the page as a reader does it
def _sessions() -> list[str]:
    return [page for page in PAGES if any(b.mode in ("run", "start", "wait") for b in blocks_of(page))]


@pytest.mark.parametrize("page", _sessions())
def test_page_runs_in_a_fresh_folder(page: str, clone: Path, servers: Servers):
    missing = [tool for tool in ("curl", "openssl") if shutil.which(tool) is None]
    assert not missing, f"{' and '.join(missing)} not installed: the page's commands need them"
    for block in blocks_of(page):
        if block.mode == "start":
            taken = _ports_taken(block.text)
            if taken:
                pytest.skip(f"{block.where} uses ports {taken}, which something on this host holds")
            for command in commands_of(block.text):
                servers.start(command)
        elif block.mode == "wait":
            deadline = time.monotonic() + WAIT_S
            while True:
                servers.check_alive()
                out = _run_script(block.text, clone)
                if out.returncode == 0 and block.expect in out.stdout:
                    break
                assert time.monotonic() < deadline, (f"{block.where}: no {block.expect!r} in {WAIT_S:g} s; last "
                                                     f"answer {out.stdout[-500:]!r} {out.stderr[-500:]!r}")
                time.sleep(1.0)
        elif block.mode == "run":
            servers.check_alive()
            out = _run_script(block.text, clone)
            assert out.returncode == 0, f"{block.where} exited {out.returncode}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
            assert block.expect in out.stdout, f"{block.where}: no {block.expect!r} in {out.stdout[-2000:]!r}"
            assert "Traceback" not in out.stderr, out.stderr[-3000:]
    servers.check_alive()  # nothing the page started died along the way
