"""Checks on addresses and ports that the config, the port plan and the
connector share (no atom_kv imports: the config module validates with them)."""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback", "is_unspecified", "parse_port_range"]

_MAX_PORT = 65535


def is_unspecified(host: str) -> bool:
    """True for an address that means "every interface" (``0.0.0.0``, ``::``, ``*``, empty)."""
    text = host.strip().strip("[]")
    if text in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(text).is_unspecified
    except ValueError:
        return False  # a host name: peers resolve it


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (all of 127.0.0.0/8, ``::1``); names are not."""
    text = host.strip().strip("[]")
    if text == "localhost":
        return True
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def parse_port_range(text: str, key: str) -> tuple[int, int]:
    """``"40000-40099"`` -> ``(40000, 40099)``; one port ``"40000"`` -> ``(40000, 40000)``.
    Raises :class:`ValueError` with a one-line message naming ``key``."""
    parts = text.strip().split("-")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        lo, hi = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ValueError(f"`{key}` must be a port range like \"40000-40099\", got {text!r}") from None
    if not 1 <= lo <= hi <= _MAX_PORT:
        raise ValueError(f"`{key}` must be a port range FIRST-LAST with 1 <= FIRST <= LAST <= {_MAX_PORT}, "
                         f"got {text!r}")
    return lo, hi
