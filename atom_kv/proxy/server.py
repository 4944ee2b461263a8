"""Serving a proxy app: its lifespan around :class:`~atom_kv.proxy.http.httpserver.HTTPServer`, graceful shutdown.

The HTTP socket is bound by :func:`listen_socket` before serving starts (so
"address in use" is one clear line, and port 0 gives a port we can read
back) and handed to the server, which listens with ``backlog``.

The app's own start (Quart's ``before_serving``: the proxy's state) runs
before the first connection is accepted, and its stop (``after_serving``)
after the last connection is closed. The two completion routes are served by
the state's :class:`~atom_kv.proxy.relay.fastpath.CompletionsHandler`, every other
route by the Quart app through :class:`~atom_kv.proxy.http.asgi_bridge.ASGIBridge`;
each behind a :class:`~atom_kv.proxy.http.guard.HostGuard` (``--allowed-hosts``: on
loopback by default, so a DNS-rebinding page cannot use the proxy).

Slow clients are bounded twice: a connection whose request head has not fully
arrived within ``header_timeout`` (from the connection's start, or the
previous answer; so it is also the idle keep-alive limit) is closed, and a
body that takes longer than ``body_timeout`` is answered 408.
"""

from __future__ import annotations

import asyncio
import signal
import socket

from quart import Quart

from atom_kv.proxy.app import STATE_KEY, ProxyState
from atom_kv.proxy.http.asgi_bridge import ASGIBridge
from atom_kv.proxy.http.exchange import Handler
from atom_kv.proxy.http.guard import AllowedHosts, HostGuard
from atom_kv.proxy.http.httpserver import HTTPServer
from atom_kv.proxy.settings import ProxySettings

__all__ = ["listen_socket", "serve_app", "serve_until_signalled"]


def listen_socket(host: str, port: int, backlog: int, *, reuse_port: bool = False) -> socket.socket:
    """A bound, listening TCP socket (port 0: the OS picks; read it back with ``getsockname``).

    ``reuse_port`` sets ``SO_REUSEPORT``: several processes (of the same user) that
    all set it share one port, and the kernel spreads new connections among them;
    a process that does not set it still gets "address already in use"."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_app(app: Quart, settings: ProxySettings, stop: asyncio.Event,
                    sock: socket.socket | None = None) -> None:
    """Serve until ``stop`` is set; the app's lifespan starts and stops its state.
    A start-up failure (e.g. the discovery port is taken) is raised as it is."""
    if sock is None:
        sock = listen_socket(settings.host, settings.port, settings.backlog, reuse_port=settings.reuse_port)
    state: ProxyState = app.extensions[STATE_KEY]
    try:
        await app.startup()
    except BaseException:
        sock.close()
        raise
    try:
        routes, fallback = _guarded(state, state.completions.routes(), ASGIBridge(app))
        server = HTTPServer(routes, fallback, header_timeout=settings.header_timeout,
                            body_timeout=settings.body_timeout, max_request_bytes=settings.max_request_bytes,
                            stall_timeout=settings.stall_timeout, on_stall=state.metrics.client_stalls.inc,
                            body_budget=settings.max_inflight_body_bytes)
        try:
            await server.start(sock, settings.backlog)
        except BaseException:
            sock.close()
            raise
        try:
            await stop.wait()
        finally:
            await server.shutdown(settings.shutdown_timeout)
    finally:
        await app.shutdown()


def _guarded(state: ProxyState, routes: dict[str, Handler],
             fallback: Handler) -> tuple[dict[str, Handler], Handler]:
    """Every route behind the ``Host`` check (``--allowed-hosts``; on loopback by default), when it applies."""
    hosts = AllowedHosts.for_server(state.settings.host, state.settings.allowed_hosts)
    if hosts is None:
        return routes, fallback
    counted = state.metrics.refused_requests.labels("host").inc
    return {path: HostGuard(h, hosts, counted) for path, h in routes.items()}, HostGuard(fallback, hosts, counted)


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
