"""The ``Server-Timing`` header: how an engine tells its caller where a request's time went.

Engines put the spans they measured for one request (seconds, from their own
monotonic clock) into the answer's head as ``Server-Timing: queue;dur=1.20,
compute;dur=3.40`` (milliseconds, the header's standard unit); the proxy reads
them back to build its per-request breakdown. Durations, never timestamps: the
two sides may run on different hosts.
"""

from __future__ import annotations

__all__ = ["HEADER", "format_server_timing", "parse_server_timing"]

HEADER = "Server-Timing"
_MAX_ENTRIES = 16
_MAX_NAME = 32
_MAX_MS = 86_400_000.0  # one day: anything longer is nonsense


def format_server_timing(spans: dict[str, float]) -> str:
    """``{"queue": 0.0012}`` (seconds) -> ``"queue;dur=1.200"``; negative spans are clamped to 0."""
    return ", ".join(f"{name};dur={max(0.0, s) * 1e3:.3f}" for name, s in spans.items())


def parse_server_timing(value: str) -> dict[str, float]:
    """The spans of a ``Server-Timing`` value in seconds; entries that do not parse, repeat a
    name or fall outside the bounds (16 entries, 32-character names, one day) are skipped."""
    spans: dict[str, float] = {}
    for entry in value.split(",")[:_MAX_ENTRIES]:
        name, _, params = entry.strip().partition(";")
        if not name or len(name) > _MAX_NAME or not name.replace("_", "").isalnum() or name in spans:
            continue
        for param in params.split(";"):
            key, _, raw = param.strip().partition("=")
            if key.strip() != "dur":
                continue
            try:
                ms = float(raw.strip().strip('"'))
            except ValueError:
                break
            if 0.0 <= ms <= _MAX_MS:
                spans[name] = ms / 1e3
            break
    return spans
