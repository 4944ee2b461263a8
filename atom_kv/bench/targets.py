"""Every bench's targets: each printed with met or MISSED, and the exit status they give.

One helper for every suite (``python -m atom_kv.bench <suite>``): a suite
builds its :class:`Target` list from what it measured and calls
:func:`report`, which prints one line per target and a summary line, and
returns 1 when a target was missed, else 0. ``--explore`` (added to every
suite by :func:`add_arguments`) keeps the lines and returns 0: an
exploratory run, a loaded machine, a sweep of settings.

With ``--json`` the document stays alone on stdout: the lines go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Optional, TextIO

__all__ = ["EXPLORE_HELP", "Target", "Verdict", "add_arguments", "report", "summary_line"]

EXPLORE_HELP = ("an exploratory run: print every target with met or MISSED, but exit 0 when one is missed "
                "(without it a missed target is exit status 1)")


class Verdict(Enum):
    """What became of one target in one run."""

    MET = "met"
    MISSED = "MISSED"
    NOT_MEASURED = "not measured in this run"


@dataclass(frozen=True)
class Target:
    """One target of a run: who it is about (``name``), the claim with the figures measured (``text``,
    e.g. ``"TTFT p50 18.0 ms <= 2x plain (20.0 ms)"``) and whether it held (None: not measured)."""

    name: str
    text: str
    met: Optional[bool]

    @property
    def verdict(self) -> Verdict:
        if self.met is None:
            return Verdict.NOT_MEASURED
        return Verdict.MET if self.met else Verdict.MISSED

    def line(self) -> str:
        return f"target {self.name}: {self.text}: {self.verdict.value}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--explore``, on every suite's parser."""
    parser.add_argument("--explore", action="store_true", help=EXPLORE_HELP)


def summary_line(targets: list[Target], *, explore: bool, none_reason: str = "") -> str:
    """One line: how many targets were met and missed, and what that does to the exit status."""
    if not targets:
        return f"targets: none in this run{f' ({none_reason})' if none_reason else ''}"
    counts = {v: sum(1 for t in targets if t.verdict is v) for v in Verdict}
    parts = [f"{counts[Verdict.MET]} met", f"{counts[Verdict.MISSED]} MISSED"]
    if counts[Verdict.NOT_MEASURED]:
        parts.append(f"{counts[Verdict.NOT_MEASURED]} not measured")
    text = "targets: " + ", ".join(parts)
    if counts[Verdict.MISSED]:
        text += " (--explore: exit status 0 all the same)" if explore else " (exit status 1; --explore for 0)"
    return text


def report(targets: Iterable[Target], *, explore: bool, json_output: bool = False, lines: bool = True,
           none_reason: str = "", stream: Optional[TextIO] = None) -> int:
    """Print each target's line (unless ``lines`` is False: the suite printed them in its table) and the
    summary; returns 1 when one was missed and ``explore`` is off, else 0. With ``json_output`` everything
    goes to stderr, so stdout holds only the suite's JSON."""
    targets = list(targets)
    out = stream if stream is not None else (sys.stderr if json_output else sys.stdout)
    if lines:
        for target in targets:
            print(target.line(), file=out)
    print(summary_line(targets, explore=explore, none_reason=none_reason), file=out, flush=True)
    missed = any(t.verdict is Verdict.MISSED for t in targets)
    return 1 if missed and not explore else 0
