"""Helpers around the fake engines (atom_kv.testing.fake_engine) for the proxy tests."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from atom_kv.testing.fake_engine import FakeEngine, FakePinger, Received, send_pings

__all__ = ["FakeEngine", "FakePinger", "Received", "send_pings", "register", "post", "get"]


async def register(proxy, *engines: FakeEngine, fmt: str = "atom", token: str | None = None,
                   timeout: float = 3.0) -> None:
    """Register ``engines`` with ``proxy`` through real ZeroMQ pings and wait (on registry
    change notifications) until each is live: registered and probed up."""
    if fmt == "atom":
        pings = [e.register_ping(token=token) for e in engines]
    else:
        pings = [e.moriio_ping() for e in engines]
    await asyncio.to_thread(send_pings, proxy.discovery_endpoint, pings)
    wanted = {(e.role, e.base_url) for e in engines}

    def _all_live(registry) -> bool:
        live = {(i.role, i.base_url) for role in ("P", "D") for i in registry.live(role)}
        return wanted <= live

    ok = await proxy.registry.wait_for(_all_live, timeout)
    assert ok, f"engines {sorted(wanted)} did not become live within {timeout}s: {proxy.registry.snapshot()}"


async def post(url: str, body: Any = None, *, data: bytes | None = None, path: str = "/v1/completions",
               headers: dict | None = None) -> tuple[int, str, bytes]:
    if data is not None:  # raw bytes, sent as the JSON they claim to be (unless the test names its own type)
        headers = {"Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body if data is None else None, data=data, headers=headers) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.read()


async def get(url: str, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + path) as r:
            raw = await r.read()
            return r.status, json.loads(raw) if raw else None
