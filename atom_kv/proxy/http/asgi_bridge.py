"""A minimal ASGI bridge: serves an :class:`~atom_kv.proxy.http.httpserver.Exchange` with an ASGI app.

The proxy's management routes (``/health``, ``/instances``, ``/metrics``,
``/v1/models``, and every 404/405) are Quart's; the server reads the whole
request (bounded in size and time) before it calls the bridge, so ``receive``
returns the body in one message and then waits for the answer to complete
(or the client to go: ``http.disconnect``). The answer is collected and sent
in one write; these routes answer small bodies.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from atom_kv.openai_errors import error_bytes
from atom_kv.proxy.http.httpserver import Exchange

__all__ = ["ASGIBridge"]

logger = logging.getLogger(__name__)

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]

_ASGI = {"version": "3.0", "spec_version": "2.3"}


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
        scope: dict[str, Any] = {
            "type": "http", "asgi": _ASGI, "http_version": exchange.http_version, "method": exchange.method,
            "scheme": "http", "path": exchange.path, "raw_path": exchange.raw_path,
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
