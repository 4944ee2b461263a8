"""Decoding what arrives on the data-path sockets.

:func:`decode` is :func:`atom_kv.wire.decode` that also reports msgpack
nested too deeply for the decoder (a few KiB of ``0x91`` bytes) as a
:class:`~atom_kv.wire.WireError`, so every bad frame takes the same counted,
rate-limited path instead of escaping as a ``RecursionError``.
"""

from __future__ import annotations

from typing import Any, TypeVar

from atom_kv import wire

__all__ = ["decode"]

T = TypeVar("T")


def decode(data: Any, type_: type[T]) -> T:
    """Decode ``data`` as ``type_``; raise :class:`~atom_kv.wire.WireError` (only that)."""
    try:
        return wire.decode(data, type_)
    except RecursionError:
        name = getattr(type_, "__name__", str(type_))
        raise wire.WireError(f"bad {name} message ({len(data)} bytes): nested too deeply") from None
