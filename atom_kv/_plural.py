"""A count with its noun, singular or plural: ``counted(1, "rank")`` is "1 rank", ``counted(2, "rank")`` "2 ranks"."""

from __future__ import annotations

__all__ = ["counted"]


def counted(n: int, noun: str, plural: str = "") -> str:
    """``n`` and ``noun``, with ``plural`` (default ``noun + "s"``) unless ``n`` is 1."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"
