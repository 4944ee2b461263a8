"""Proxy test fixtures: a real proxy (hypercorn, own loop in a thread) and fake engines."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import replace
from typing import AsyncIterator, Callable

import pytest

from atom_kv.proxy import ProxySettings, create_app
from atom_kv.proxy.app import STATE_KEY, ProxyState
from atom_kv.proxy.server import serve_app
from tests.conftest import free_port
from tests.proxy.fake_engine import FakeEngine

FAST = ProxySettings(
    host="127.0.0.1", port=0, discovery_host="127.0.0.1", discovery_port=0, heartbeat_timeout=10.0,
    connect_timeout=1.0, prefill_timeout=3.0, decode_timeout=3.0, models_timeout=2.0, retry_backoff_s=0.01,
    discovery_poll_s=0.1, circuit_cooldown_s=1.0, shutdown_timeout=1.0,
)


class RunningProxy:
    """A proxy app served by hypercorn on its own event loop in a named thread."""

    def __init__(self, settings: ProxySettings) -> None:
        self.settings = replace(settings, port=settings.port or free_port())
        self.app = create_app(self.settings)
        self.state: ProxyState = self.app.extensions[STATE_KEY]
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="test-proxy", daemon=True)
        self._error: BaseException | None = None

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
        return f"tcp://127.0.0.1:{self.state.discovery.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        try:
            self._loop.run_until_complete(serve_app(self.app, self.settings, self._stop))
        except BaseException as exc:  # surfaced by start()/stop()
            self._error = exc
        finally:
            self._loop.close()

    def start(self, timeout: float = 5.0) -> "RunningProxy":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._error is not None:
                raise self._error
            try:
                with socket.create_connection(("127.0.0.1", self.settings.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        raise TimeoutError("proxy did not start listening")

    def stop(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)
        assert not self._thread.is_alive(), "proxy thread did not stop"


@pytest.fixture
def make_proxy() -> Callable[..., RunningProxy]:
    started: list[RunningProxy] = []

    def _make(**overrides) -> RunningProxy:
        proxy = RunningProxy(replace(FAST, **overrides)).start()
        started.append(proxy)
        return proxy

    yield _make
    for proxy in started:
        proxy.stop()


@pytest.fixture
async def make_engine() -> AsyncIterator[Callable[..., "asyncio.Future[FakeEngine]"]]:
    engines: list[FakeEngine] = []

    async def _make(role: str, **kwargs) -> FakeEngine:
        engine = await FakeEngine(role, **kwargs).start()
        engines.append(engine)
        return engine

    yield _make
    for engine in engines:
        await engine.close()
