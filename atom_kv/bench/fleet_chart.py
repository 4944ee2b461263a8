"""``bench fleet --png DIR``: one chart per figure against N (the number of engines), log-scaled N.

matplotlib is optional (the ``bench`` extra) and imported only here, only when a chart is asked for;
:func:`missing` says, before any process starts, what to install when it is absent.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from atom_kv.bench.fleet_rows import kv_row, measured
from atom_kv.bench.png import missing

__all__ = ["FIGURES", "draw", "missing"]

Series = tuple[str, Callable[[dict[str, Any]], Optional[float]]]


def _kv(key: str, scale: float) -> Callable[[dict[str, Any]], Optional[float]]:
    """A series of the KV run's ``key`` (times ``scale``): None for a size without a KV run."""
    def value(row: dict[str, Any]) -> Optional[float]:
        kv = kv_row(row)
        return None if kv is None else kv[key] * scale
    return value

#: file name -> (title, y label, its series: label and value of one size's row)
FIGURES: dict[str, tuple[str, str, list[Series]]] = {
    "fleet_cpu_per_request": ("proxy CPU per request", "ms of CPU",
                              [("CPU per request", lambda r: r["cpu_ms_per_request"])]),
    "fleet_added_latency": ("latency the proxy adds", "ms", [("p50", lambda r: r["added_p50_ms"]),
                                                            ("p99", lambda r: r["added_p99_ms"])]),
    "fleet_rss": ("proxy RSS", "MiB", [("after the requests", lambda r: r["rss_bytes"] / 2**20),
                                       ("KV run (index held)", _kv("rss_bytes", 1 / 2**20))]),
    "fleet_idle_cpu": ("pings, probes and load readings, no requests", "% of one core",
                       [("plain", lambda r: 100 * r["idle_cpu_core_share"]),
                        ("with KV events", _kv("cpu_core_share", 100))]),
    "fleet_new_engine": ("a new engine's first ping to its first request", "s",
                         [("prefill", lambda r: r["new_engine"]["prefill_s"]),
                          ("decode", lambda r: r["new_engine"]["decode_s"])]),
    "fleet_kv_index": ("KV index memory", "MiB", [("RSS over the plain run", _kv("index_bytes", 1 / 2**20))]),
}




def draw(doc: dict[str, Any], directory: str, *, dpi: int = 80) -> list[str]:
    """Write one PNG per :data:`FIGURES` entry (the series that have values) and ``fleet.png`` with all of
    them, into ``directory``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    rows = measured(doc["sizes"])  # a failed size has no figures
    paths = []
    grid, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax_all, (name, (title, unit, series)) in zip(axes.flat, FIGURES.items()):
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for target in (ax, ax_all):
            for label, value in series:
                points = [(r["n"], value(r)) for r in rows]
                points = [(n, v) for n, v in points if v is not None]
                if points:
                    target.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
            target.set_xscale("log")
            target.set_xlabel("engines (N)")
            target.set_ylabel(unit)
            target.set_title(title, fontsize=10)
            target.set_ylim(bottom=0)
            target.grid(True, alpha=0.3)
            if len(series) > 1:
                target.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(directory, name + ".png")
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        paths.append(path)
    grid.tight_layout()
    path = os.path.join(directory, "fleet.png")
    grid.savefig(path, dpi=dpi)
    plt.close(grid)
    paths.append(path)
    return paths
