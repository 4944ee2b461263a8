"""Fake HTTP engines for the proxy tests (the server code lives in atom_kv.proxy.testing
so the bench can reuse it); plus a helper to register them with a proxy."""

from __future__ import annotations

import asyncio

from atom_kv.proxy.testing import FakeEngine, FakePinger, Received, send_pings

__all__ = ["FakeEngine", "FakePinger", "Received", "send_pings", "register"]


async def register(proxy, *engines: FakeEngine, fmt: str = "atom", timeout: float = 3.0) -> None:
    """Register ``engines`` with ``proxy`` through real ZeroMQ pings and wait until they are live."""
    pings = [e.register_ping() if fmt == "atom" else e.moriio_ping() for e in engines]
    await asyncio.to_thread(send_pings, proxy.discovery_endpoint, pings)
    wanted = {e.base_url for e in engines}

    def _all_live(registry) -> bool:
        live = {i.base_url for role in ("P", "D") for i in registry.live(role)}
        return wanted <= live

    ok = await asyncio.to_thread(proxy.registry.wait_for, _all_live, timeout)
    assert ok, f"engines {sorted(wanted)} did not register within {timeout}s"
