"""Serving a proxy app with hypercorn (programmatically), with graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal

from hypercorn.asyncio import serve
from hypercorn.config import Config
from quart import Quart

from atom_kv.proxy.settings import ProxySettings

logger = logging.getLogger(__name__)


def hypercorn_config(settings: ProxySettings) -> Config:
    config = Config()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.backlog = settings.backlog
    config.debug = False
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = settings.shutdown_timeout
    config.keep_alive_timeout = settings.keep_alive_timeout
    config.use_reloader = False
    return config


async def serve_app(app: Quart, settings: ProxySettings, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set; the app's lifespan starts and stops its state."""
    await serve(app, hypercorn_config(settings), shutdown_trigger=stop.wait, mode="asgi")


async def serve_until_signalled(app: Quart, settings: ProxySettings) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await serve_app(app, settings, stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
