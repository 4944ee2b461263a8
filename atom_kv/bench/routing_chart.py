"""``bench routing --png PATH``: hit rate and TTFT per policy, one group of bars per cache fraction.

matplotlib is optional (the ``bench`` extra) and imported only here, only when a chart is asked for;
:func:`missing` says, before any engine starts, what to install when it is absent.
"""

from __future__ import annotations

from typing import Any

from atom_kv.bench.png import missing

__all__ = ["draw", "missing"]




def draw(doc: dict[str, Any], path: str) -> None:
    """Write ``doc``'s (the bench's JSON document) chart to ``path``: hit rate (with the oracle marked) and
    TTFT p50/p99 for every policy that ran, per cache fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = doc["cases"]
    fig, axes = plt.subplots(2, len(cases), figsize=(5 * len(cases), 7), squeeze=False)
    for col, case in enumerate(cases):
        ran = [r for r in case["policies"].values() if r["status"] == "ok"]
        names = [r["policy"] for r in ran]
        x = range(len(ran))
        hit_ax, ttft_ax = axes[0][col], axes[1][col]
        hit_ax.bar(x, [r["hit_rate"] for r in ran], color="tab:blue")
        if ran:
            hit_ax.axhline(ran[0]["oracle_hit_rate"], color="tab:red", linestyle="--", label="oracle")
            hit_ax.legend()
        hit_ax.set_title(f"cache fraction {case['cache_fraction']}: hit rate")
        hit_ax.set_ylim(0, 1)
        width = 0.4
        ttft_ax.bar([i - width / 2 for i in x], [r["ttft_ms"]["p50"] for r in ran], width, label="p50")
        ttft_ax.bar([i + width / 2 for i in x], [r["ttft_ms"]["p99"] for r in ran], width, label="p99")
        ttft_ax.set_title("TTFT (ms)")
        ttft_ax.legend()
        for ax in (hit_ax, ttft_ax):
            ax.set_xticks(list(x))
            ax.set_xticklabels(names, rotation=20)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
