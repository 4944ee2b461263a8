"""The proxy's HTTP/1.1 server: one :class:`asyncio.Protocol` per client on httptools' C parser.

Why not hypercorn (which served the proxy before): it parses HTTP with h11 in
pure Python and runs every request through ASGI message dicts and extra
tasks; with its h11 parsing that was over a third of the proxy's CPU per
request (``python -m atom_kv.bench proxy``, py-spy). This server hands each
request to a handler as an :class:`Exchange`: the two completion routes are
served natively (:mod:`atom_kv.proxy.relay.fastpath`), every other route goes to the
Quart app through a minimal ASGI bridge (:mod:`atom_kv.proxy.http.asgi_bridge`).

:class:`HTTPServer` owns the listening server and its connections;
:class:`~atom_kv.proxy.http.connection.ServerConnection` owns one client's connection
(:class:`~atom_kv.proxy.http.exchange.Exchange` one request and its answer):

- keep-alive, and pipelined requests answered in order, one at a time (reading
  pauses while one waits); a malformed request (400, 431) is answered after
  the requests read before it, and ends the connection; the next one is not
  answered, and nothing more is read, while the client's socket buffer is above its high-water mark (a client
  that pipelines and never reads costs one buffer, not a growing heap); at most
  ``max_pipelined`` wait per connection (429 and the connection ends past it);
- a client that reads nothing for ``stall_timeout`` while an answer waits in
  its socket buffer is dropped: its request's task is cancelled (the exchange
  says ``stalled``, so the handler can release what it holds) and ``on_stall``
  counts it;
- a request head must arrive within ``header_timeout`` (from the connection's
  start or the previous answer: also the idle keep-alive limit) and stay under
  ``max_head_bytes`` in all and ``max_headers`` header lines, however it is
  split across reads, else the connection is closed (431 when too big);
- requests are routed on the raw path (never percent-decoded); an encoded
  slash (``%2F``, ``%5C``) in it is refused (400); the fallback (the ASGI
  bridge) answers 404 to any path that is not plain origin-form;
- a body must arrive within ``body_timeout`` (else 408) and stay within
  ``max_request_bytes`` (else 413, at once when ``Content-Length`` says so);
  all bodies held at once (read or being read, until their answer ends) stay
  within ``body_budget`` bytes, else 503; the budget counts the bytes that
  arrived, piece by piece, never what ``Content-Length`` announced (a head
  alone reserves nothing), and a body's pieces go into one buffer that grows
  with them (no second copy to join them);
  a chunked body's trailers count against the head's limits and are dropped
  (never headers of the request);
  ``Expect: 100-continue`` is answered;
- answers: fixed length (:meth:`Exchange.respond`), or streamed
  (:meth:`Exchange.start_stream` then :meth:`Exchange.write` per piece: one
  chunk, one write each; back-pressure reaches the piece's producer);
- a client that goes away cancels its request's task;
- graceful shutdown: stop accepting, close idle connections, give requests in
  flight ``timeout`` seconds, then drop what is left.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable

from atom_kv.proxy.http.connection import BODY_BUDGET, MAX_HEAD_BYTES, MAX_HEADERS, MAX_PIPELINED, ServerConnection
from atom_kv.proxy.http.exchange import DateHeader, Exchange, Handler, Producer

__all__ = ["HTTPServer", "Exchange", "Handler", "Producer"]

logger = logging.getLogger(__name__)


class HTTPServer:
    """Owns the listening socket's server and every client connection (see the module doc)."""

    def __init__(self, routes: dict[str, Handler], fallback: Handler, *, header_timeout: float, body_timeout: float,
                 max_request_bytes: int, max_head_bytes: int = MAX_HEAD_BYTES,
                 max_pipelined: int = MAX_PIPELINED, max_headers: int = MAX_HEADERS, stall_timeout: float = 60.0,
                 on_stall: Callable[[], None] | None = None, body_budget: int = BODY_BUDGET) -> None:
        self.loop = asyncio.get_running_loop()
        self.routes = routes
        self.fallback = fallback
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_request_bytes = max_request_bytes
        self.max_head_bytes = max_head_bytes
        self.max_pipelined = max_pipelined
        self.max_headers = max_headers
        self.stall_timeout = stall_timeout
        self.body_budget = body_budget
        self.body_in_flight = 0  # bytes of request bodies held now (see Exchange.budget_held)
        self.on_stall = on_stall
        self.connections: set[ServerConnection] = set()
        self.all_closed = asyncio.Event()
        self.shutting_down = False
        self.date = DateHeader()
        self._server: asyncio.AbstractServer | None = None

    async def start(self, sock: socket.socket, backlog: int) -> None:
        """Serve ``sock`` (bound and listening; the server owns it from now on)."""
        self._server = await self.loop.create_server(lambda: ServerConnection(self), sock=sock, backlog=backlog)

    async def shutdown(self, timeout: float) -> None:
        """Stop accepting, close idle connections, let requests in flight finish within
        ``timeout`` seconds, then drop whatever is left."""
        self.shutting_down = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.idle:
                conn.close()
            else:
                for ex in (conn.active, *conn.queue):
                    if ex is not None:
                        ex.keep_alive = False
        if self.connections:
            self.all_closed.clear()
            try:
                await asyncio.wait_for(self.all_closed.wait(), timeout)
            except asyncio.TimeoutError:
                logger.warning("shutdown: %d connection(s) still busy after %gs, dropping them",
                               len(self.connections), timeout)
        tasks = []
        for conn in list(self.connections):
            if conn.active is not None and conn.active.task is not None:
                tasks.append(conn.active.task)
            conn.close(abort=True)
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        if self._server is not None:
            self._server = None
