"""The chaos soak's report: requests counted per fault kind, recovery after each fault, and the invariants.

A request counts under every fault kind whose window (from the fault's start to one second after it was
cleared) it overlaps, and under ``none`` when it overlaps none; ``all`` counts each request once. A
request ``refused`` or ``dropped`` (see :mod:`atom_kv.bench.chaos_client`) is acceptable only when it
overlaps a kill of the very proxy it was sent to; otherwise it counts as ``unclean``.

Recovery after a fault: from the moment it was cleared (the restarted process serving and registered, the
signal, link or rule undone) to the end of the first request that began after that and succeeded (to the
same proxy, for a proxy's kill).
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

from atom_kv.bench.chaos_client import Outcome, Request
from atom_kv.bench.chaos_faults import Fault
from atom_kv.bench.chaos_fleet import Incarnation

__all__ = ["count_requests", "recoveries", "rss_report", "tracebacks"]

GRACE_S = 1.0
COUNTS = ("requests", "ok", "cut", "clean_errors", "refused", "dropped", "wrong", "unclean", "late")
_KEY = {Outcome.OK: "ok", Outcome.CUT: "cut", Outcome.CLEAN_ERROR: "clean_errors", Outcome.REFUSED: "refused",
        Outcome.DROPPED: "dropped", Outcome.WRONG: "wrong", Outcome.UNCLEAN: "unclean"}


def _window(fault: Fault, end: float) -> tuple[float, float]:
    return fault.started, (fault.cleared if fault.cleared is not None else end) + GRACE_S


def _overlaps(req: Request, fault: Fault, end: float) -> bool:
    lo, hi = _window(fault, end)
    return req.started <= hi and (req.ended or end) >= lo


def count_requests(requests: list[Request], faults: list[Fault], proxy_urls: dict[str, str],
                   end: float) -> dict[str, dict[str, int]]:
    """``{kind: {count: n}}`` for every fault kind seen, ``none`` and ``all`` (the counts: :data:`COUNTS`)."""
    table: dict[str, dict[str, int]] = {}
    for req in requests:
        during = [f for f in faults if _overlaps(req, f, end)]
        key = _KEY.get(req.outcome, "unclean") if req.outcome is not None else "late"
        if key in ("refused", "dropped") and not any(
                f.kind == "proxy_kill" and proxy_urls.get(f.target) == req.proxy for f in during):
            key = "unclean"
        for kind in {f.kind for f in during} or {"none"}:
            _add(table, kind, key, req.late)
        _add(table, "all", key, req.late)
    return table


def _add(table: dict[str, dict[str, int]], kind: str, key: str, late: bool) -> None:
    row = table.setdefault(kind, dict.fromkeys(COUNTS, 0))
    row["requests"] += 1
    if key != "late":
        row[key] += 1
    if late or key == "late":
        row["late"] += 1


def recoveries(requests: list[Request], faults: list[Fault], proxy_urls: dict[str, str]) -> list[dict[str, Any]]:
    """Each fault: kind, target, what it did, when (seconds from the first fault), how long until it was
    cleared, and the recovery after it (None: no request succeeded after it)."""
    oks = sorted((r for r in requests if r.outcome is Outcome.OK), key=lambda r: r.started)
    t0 = min((f.started for f in faults), default=0.0)
    out = []
    for f in faults:
        recovery: Optional[float] = None
        if f.cleared is not None:
            for r in oks:
                if r.started >= f.cleared and (f.kind != "proxy_kill" or r.proxy == proxy_urls.get(f.target)):
                    recovery = r.ended - f.cleared
                    break
        out.append({"kind": f.kind, "target": f.target, "how": f.how, "at_s": round(f.started - t0, 2),
                    "cleared_after_s": None if f.cleared is None else round(f.cleared - f.started, 2),
                    "recovery_s": None if recovery is None else round(recovery, 2), "failed": f.failed})
    return out


def recovery_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind: how many faults, the recovery's median and maximum, and faults with no recovery seen."""
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted({r["kind"] for r in rows}):
        seen = [r["recovery_s"] for r in rows if r["kind"] == kind and r["recovery_s"] is not None]
        n = sum(1 for r in rows if r["kind"] == kind)
        out[kind] = {"faults": n, "recovery_p50_s": round(statistics.median(seen), 2) if seen else None,
                     "recovery_max_s": round(max(seen), 2) if seen else None, "not_recovered": n - len(seen)}
    return out


def rss_report(history: list[Incarnation], warmup_s: float, min_span_s: float, slack_mib: float,
               slack_ratio: float) -> dict[str, dict[str, Any]]:
    """Each process start that ran at least ``min_span_s`` past its warm-up: its RSS (MiB) just after the
    warm-up and at the end (medians of three samples), and whether it stayed within the slack."""
    out = {}
    for inc in history:
        after = [b for t, b in inc.rss if t >= inc.started + warmup_s]
        times = [t for t, _ in inc.rss if t >= inc.started + warmup_s]
        if len(after) < 6 or times[-1] - times[0] < min_span_s:
            continue
        warm = statistics.median(after[:3]) / 2**20
        last = statistics.median(after[-3:]) / 2**20
        flat = last <= warm * (1 + slack_ratio) + slack_mib
        out[inc.name] = {"warm_mib": round(warm, 1), "end_mib": round(last, 1),
                         "growth_mib": round(last - warm, 1), "flat": flat}
    return out


def tracebacks(logs: dict[str, str]) -> dict[str, str]:
    """The logs holding a traceback, each with the lines around its first one."""
    out = {}
    for name, text in logs.items():
        at = text.find("Traceback")
        if at >= 0:
            out[name] = text[max(0, at - 600):at + 1500]
    return out
