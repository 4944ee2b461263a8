"""Blocking HTTP helpers for harnesses: JSON calls and Prometheus scrapes."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Optional

__all__ = ["http_json", "scrape_metrics"]


def http_json(method: str, url: str, body: Optional[dict] = None, timeout: float = 30.0,
              headers: Optional[dict[str, str]] = None) -> tuple[int, Any]:
    """A small blocking HTTP JSON call; returns ``(status, parsed body or text)``."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def scrape_metrics(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Prometheus text -> ``{"name{labels}": value}``, plus ``name`` summed over label sets."""
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        out[key] = v
        name = key.split("{", 1)[0]
        if "{" in key:
            sums[name] = sums.get(name, 0.0) + v
    for name, v in sums.items():
        out.setdefault(name, v)
    return out
