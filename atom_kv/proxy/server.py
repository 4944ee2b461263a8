"""Serving a proxy app with hypercorn (programmatically), with graceful shutdown.

The HTTP socket is bound by :func:`listen_socket` before serving starts (so
"address in use" is one clear line, and port 0 gives a port we can read
back) and handed to hypercorn by file descriptor.

Slow clients are bounded twice: hypercorn closes a connection whose request
head has not fully arrived within ``header_timeout`` (its keep-alive timer
runs from the connection's start, or the previous response, until a complete
head arrives; so it is also the idle keep-alive limit), and the fast path
answers 408 to a body that takes longer than ``body_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

from hypercorn.asyncio import serve
from hypercorn.config import Config
from quart import Quart

from atom_kv.proxy.settings import ProxySettings

logger = logging.getLogger(__name__)


def listen_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A bound, listening TCP socket (port 0: the OS picks; read it back with ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def hypercorn_config(settings: ProxySettings, sock: socket.socket | None = None) -> Config:
    """hypercorn's config; with ``sock`` it serves that socket (and owns it from then on)."""
    config = Config()
    config.bind = [f"fd://{sock.detach()}"] if sock is not None else [f"{settings.host}:{settings.port}"]
    config.backlog = settings.backlog
    config.debug = False
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = settings.shutdown_timeout
    config.keep_alive_timeout = settings.header_timeout
    config.use_reloader = False
    return config


async def serve_app(app: Quart, settings: ProxySettings, stop: asyncio.Event,
                    sock: socket.socket | None = None) -> None:
    """Serve until ``stop`` is set; the app's lifespan starts and stops its state."""
    await serve(app, hypercorn_config(settings, sock), shutdown_trigger=stop.wait, mode="asgi")


async def serve_until_signalled(app: Quart, settings: ProxySettings, sock: socket.socket | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await serve_app(app, settings, stop, sock)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
