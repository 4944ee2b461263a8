"""What ``--png`` needs: matplotlib, from the optional ``bench`` extra (shared by the suites that draw)."""

from __future__ import annotations

from typing import Optional

from atom_kv.extras import MissingExtraError, require

__all__ = ["missing"]


def missing() -> Optional[str]:
    """Why ``--png`` cannot draw here (None: it can)."""
    try:
        require("matplotlib", extra="bench", feature="--png")
    except MissingExtraError as exc:
        return f"{exc} (or pip install matplotlib)"
    return None
