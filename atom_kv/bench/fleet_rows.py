"""The rows of a ``bench fleet`` report: which sizes were measured, and a row's KV event figures
(shared by the suite and its charts)."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["kv_row", "measured"]


def measured(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the sizes that were measured (a failed size's row has only ``n`` and ``error``)."""
    return [r for r in rows if "error" not in r]


def kv_row(row: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A measured row's KV event figures (None: not run, or it failed: then ``row["kv"]["error"]`` says why)."""
    kv = row.get("kv")
    return kv if kv and "error" not in kv else None
