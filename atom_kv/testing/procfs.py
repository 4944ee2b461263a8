"""Reading other processes' state from Linux ``/proc`` (benches and tests only)."""

from __future__ import annotations

import os
from typing import Iterator, NamedTuple, Optional

__all__ = ["ProcStat", "process_stats", "process_stat", "rss_bytes"]


class ProcStat(NamedTuple):
    """The ``/proc/<pid>/stat`` fields a harness needs."""

    pid: int
    state: str
    ppid: int
    pgrp: int
    cpu_s: float  # user + system CPU seconds so far


def _parse(pid: int, text: str) -> ProcStat:
    fields = text.rsplit(")", 1)[1].split()  # after the (name): state, ppid, pgrp, ..., utime [11], stime [12]
    return ProcStat(pid, fields[0], int(fields[1]), int(fields[2]),
                    (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))


def process_stat(pid: int) -> Optional[ProcStat]:
    """``pid``'s stat, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return _parse(pid, f.read())
    except (OSError, IndexError, ValueError):
        return None


def process_stats() -> Iterator[ProcStat]:
    """Every live process's stat (processes that vanish while being read are skipped)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if entry.isdigit():
            stat = process_stat(int(entry))
            if stat is not None:
                yield stat


def rss_bytes(pid: Optional[int] = None) -> int:
    """Resident memory of ``pid`` (this process by default), in bytes."""
    with open(f"/proc/{pid if pid is not None else 'self'}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/<pid>/status")
