"""Proxy test fixtures: a real proxy (its own HTTP server on the test's event loop, port 0) and fake engines."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import AsyncIterator, Awaitable, Callable

import pytest

from atom_kv.proxy import ProxySettings, create_app
from atom_kv.proxy.app import STATE_KEY, ProxyState
from atom_kv.proxy.server import listen_socket, serve_app
from atom_kv.testing.fake_engine import FakeEngine
from tests.proxy.fake_engine import register

FAST = ProxySettings(
    host="127.0.0.1", port=0, discovery_port=0, heartbeat_timeout=10.0,
    connect_timeout=1.0, prefill_timeout=3.0, decode_timeout=3.0, models_timeout=2.0, retry_backoff_s=0.01,
    discovery_poll_s=0.1, circuit_cooldown_s=1.0, shutdown_timeout=1.0, probe_interval_s=0.2, probe_timeout=1.0,
    allow_open_registration=True,  # the fake engines' pings are unsigned (tests of signed pings set a token)
)


class RunningProxy:
    """A proxy app served (``atom_kv.proxy.server.serve_app``) on the current event loop, on an OS-assigned port."""

    def __init__(self, settings: ProxySettings) -> None:
        self._sock = listen_socket(settings.host, settings.port, settings.backlog)
        self.settings = replace(settings, port=self._sock.getsockname()[1])
        self.app = create_app(self.settings)
        self.state: ProxyState = self.app.extensions[STATE_KEY]
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    @property
    def registry(self):
        return self.state.registry

    @property
    def metrics(self):
        return self.state.metrics

    @property
    def discovery_endpoint(self) -> str:
        assert self.state.discovery is not None and self.state.discovery.port
        return f"tcp://127.0.0.1:{self.state.discovery.port}"

    def count(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels or None) or 0.0

    async def start(self, timeout: float = 5.0) -> "RunningProxy":
        self._task = asyncio.create_task(serve_app(self.app, self.settings, self._stop, self._sock))
        started = asyncio.create_task(self.state.started.wait())
        done, _ = await asyncio.wait({self._task, started}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self._task in done:
            started.cancel()
            self._task.result()  # raises the start-up error
        if started not in done:
            started.cancel()
            raise TimeoutError("proxy did not start")
        return self

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.wait_for(self._task, 10)


@pytest.fixture
async def make_proxy() -> AsyncIterator[Callable[..., Awaitable[RunningProxy]]]:
    started: list[RunningProxy] = []

    async def _make(**overrides) -> RunningProxy:
        proxy = await RunningProxy(replace(FAST, **overrides)).start()
        started.append(proxy)
        return proxy

    yield _make
    for proxy in started:
        await proxy.stop()


@pytest.fixture
async def make_engine() -> AsyncIterator[Callable[..., Awaitable[FakeEngine]]]:
    engines: list[FakeEngine] = []

    async def _make(role: str, **kwargs) -> FakeEngine:
        engine = await FakeEngine(role, **kwargs).start()
        engines.append(engine)
        return engine

    yield _make
    for engine in engines:
        await engine.close()


@pytest.fixture
async def pd_pair(make_proxy, make_engine):
    """A started proxy with one fake prefill and one fake decode engine registered by ping.

    Call it with overrides: ``proxy, p, d = await pd_pair(proxy=dict(...), p=dict(...), d=dict(...))``."""

    async def _make(proxy: dict | None = None, p: dict | None = None, d: dict | None = None):
        running = await make_proxy(**(proxy or {}))
        prefill = await make_engine("P", **(p or {}))
        decode = await make_engine("D", **(d or {}))
        await register(running, prefill, decode)
        return running, prefill, decode

    return _make
