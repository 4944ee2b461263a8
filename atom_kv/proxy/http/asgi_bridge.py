"""A minimal ASGI bridge: serves an :class:`~atom_kv.proxy.http.httpserver.Exchange` with an ASGI app.

The proxy's management routes (``/health``, ``/instances``, ``/metrics``,
``/v1/models``, and every 404/405 but the one below) are Quart's; the server
reads the whole request (bounded in size and time) before it calls the bridge,
so ``receive`` returns the body in one message and then waits for the answer
to complete (or the client to go: ``http.disconnect``). The answer is
collected and sent in one write; these routes answer small bodies.

Routes match the raw path exactly, as sent: the app is given the raw path,
never a percent-decoded one, and a path in any other form than a plain
origin-form one (``/a/b``: no ``%``, no empty, ``.`` or ``..`` segment, only
printable ASCII; so no ``//instances``, ``/%69nstances`` or
``http://host/instances``) is answered 404 here, before the app's router can
normalise it into a route.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from atom_kv.openai_errors import error_bytes
from atom_kv.proxy.http.httpserver import Exchange

__all__ = ["ASGIBridge", "plain_path"]

logger = logging.getLogger(__name__)

# (scope, receive, send): typed loosely, as Quart's own ASGI types are TypedDicts this module does not import
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]

_ASGI = {"version": "3.0", "spec_version": "2.3"}


def plain_path(raw_path: bytes) -> str | None:
    """``raw_path`` as the app's route path, or None when it is not a plain origin-form path
    (see the module doc): such a path matches no route."""
    if not raw_path.startswith(b"/") or b"%" in raw_path or not raw_path.isascii():
        return None
    if raw_path != b"/" and any(seg in (b"", b".", b"..") for seg in raw_path[1:].split(b"/")):
        return None
    path = raw_path.decode("ascii")
    return path if path.isprintable() else None


class ASGIBridge:
    """Owns nothing but the app it calls; one call per exchange."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, exchange: Exchange) -> None:
        if exchange.refusal is not None:
            status, message = exchange.refusal
            exchange.respond(status, [(b"content-type", b"application/json")], error_bytes(status, message),
                             close=True)
            return
        path = plain_path(exchange.raw_path)
        if path is None:
            shown = exchange.raw_path.decode("latin-1")
            exchange.respond(404, [(b"content-type", b"application/json")],
                             error_bytes(404, f"no route for {exchange.method} {shown} (routes match the raw path "
                                              "exactly: no percent-encoding, no empty or dot segments)"))
            return
        scope: dict[str, Any] = {
            "type": "http", "asgi": _ASGI, "http_version": exchange.http_version, "method": exchange.method,
            "scheme": "http", "path": path, "raw_path": exchange.raw_path,
            "query_string": exchange.query, "root_path": "", "headers": exchange.headers,
            "client": exchange.client, "server": exchange.server, "extensions": {},
        }
        sent_body = False

        async def receive() -> dict:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": exchange.body, "more_body": False}
            await exchange.wait_done()
            return {"type": "http.disconnect"}

        status = 500
        headers: list[tuple[bytes, bytes]] = []
        parts: list[bytes] = []

        async def send(message: dict) -> None:
            nonlocal status, headers
            kind = message["type"]
            if exchange.finished:
                return
            if kind == "http.response.start":
                status = message["status"]
                headers = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", ())]
            elif kind == "http.response.body":
                body = message.get("body", b"")
                if body:
                    parts.append(bytes(body))
                if not message.get("more_body", False):
                    if exchange.method == "HEAD":
                        exchange.respond(status, [h for h in headers if h[0] != b"content-length"], b"")
                    else:
                        exchange.respond(status, [h for h in headers if h[0] not in (b"content-length",
                                                                                  b"transfer-encoding")],
                                         b"".join(parts))

        await self.app(scope, receive, send)
