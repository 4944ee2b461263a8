"""What a request must carry before a route's handler runs: a ``Host`` this server answers to, and
(on routes that take a JSON body) ``Content-Type: application/json``.

Both stop a web page in the user's browser from using a proxy that listens on loopback:

- **DNS rebinding**: a page on ``evil.example`` re-points that name at 127.0.0.1 and then reads the
  proxy's answers as its own origin's. The browser still sends ``Host: evil.example``;
  :class:`HostGuard` answers such a request 421 (Misdirected Request: this server is not the one
  for that name) before any handler sees it. :meth:`AllowedHosts.for_server` gives the list: the
  operator's ``--allowed-hosts``, else (on loopback) the loopback names and the bound address, any
  port; beyond loopback, no check unless the operator names the hosts.
- **Cross-site form posts**: a page may POST ``text/plain`` to any address without the browser asking
  first (no CORS preflight); it may not send ``application/json``. :func:`json_body_problem`
  says why a body is not declared JSON, for a 415.

The server (:class:`~atom_kv.proxy.http.httpserver.HTTPServer`) dispatches to a :class:`HostGuard`,
which calls the route's handler; nothing here reads the request's bytes (the parser has done that).
"""

from __future__ import annotations

from typing import Callable, Iterable

from atom_kv._netaddr import is_loopback
from atom_kv.openai_errors import error_bytes
from atom_kv.proxy.http.exchange import JSON, Exchange, Handler

__all__ = ["AllowedHosts", "HostGuard", "allowed_host_problem", "json_body_problem", "LOOPBACK_NAMES"]

#: the names a loopback listener answers by default (with the bound address), any port
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ANY_HOST = "*"

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-._")
_IPV6_CHARS = frozenset("0123456789abcdef:.")


def _split(text: str) -> tuple[str, int | None] | None:
    """``name``, ``name:port``, ``[v6]``, ``[v6]:port`` or a bare IPv6 address -> (name lower-cased,
    without brackets or a trailing dot; port or None). None: not of that shape."""
    text = text.strip().lower()
    port_text: str | None = None
    if text.startswith("["):
        name, close, rest = text[1:].partition("]")
        if not close or not name or not set(name) <= _IPV6_CHARS:
            return None
        if rest:
            if not rest.startswith(":"):
                return None
            port_text = rest[1:]
    elif text.count(":") > 1:  # an IPv6 address without brackets: it has no port
        name = text
        if not set(name) <= _IPV6_CHARS:
            return None
    else:
        name, colon, port_text_or_empty = text.partition(":")
        port_text = port_text_or_empty if colon else None
        if name.endswith("."):
            name = name[:-1]  # "localhost." is the same name, fully qualified
        if not name or not set(name) <= _NAME_CHARS:
            return None
    if port_text is None:
        return name, None
    if not (port_text.isascii() and port_text.isdigit() and 0 < int(port_text) <= 65535):
        return None
    return name, int(port_text)


def allowed_host_problem(entry: str) -> str | None:
    """What is wrong with one ``--allowed-hosts`` entry (None: nothing)."""
    if entry.strip() == ANY_HOST:
        return None
    if _split(entry) is None:
        return ("is not a host name or address, optionally with :PORT (e.g. localhost, 10.0.0.5:10001, "
                "[::1], proxy.example.com); '*' allows any")
    return None


class AllowedHosts:
    """The ``Host`` header values one server answers: names (any port), ``name:port`` pairs, or any
    (``*``). A request without a ``Host`` passes: it names no host a browser was sent to."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.entries = tuple(e.strip() for e in entries)
        self.any = ANY_HOST in self.entries
        self._names: set[str] = set()
        self._pairs: set[tuple[str, int]] = set()
        for entry in self.entries:
            if entry == ANY_HOST:
                continue
            split = _split(entry)
            if split is None:
                raise ValueError(f"allowed host {entry!r} {allowed_host_problem(entry)}")
            name, port = split
            if port is None:
                self._names.add(name)
            else:
                self._pairs.add((name, port))

    @classmethod
    def for_server(cls, bind_host: str, given: Iterable[str] | None) -> "AllowedHosts | None":
        """The list a server bound to ``bind_host`` checks: ``given`` (the operator's), else on
        loopback the loopback names and ``bind_host``; None (no check) beyond loopback unless given."""
        if given is not None:
            return cls(given)
        if not is_loopback(bind_host):
            return None
        return cls(dict.fromkeys((*LOOPBACK_NAMES, bind_host.strip().strip("[]"))))

    def allows(self, host: str | None) -> bool:
        if self.any or host is None:
            return True
        split = _split(host)
        if split is None:
            return False
        return split[0] in self._names or split in self._pairs


class HostGuard:
    """Stands in front of one route's handler: a request whose ``Host`` is not allowed (or that has
    two) is answered here, 421 (400 for two), and the handler never runs. ``on_refused`` counts it."""

    def __init__(self, handler: Handler, hosts: AllowedHosts, on_refused: Callable[[], None] | None = None) -> None:
        self.handler = handler
        self.hosts = hosts
        self.on_refused = on_refused

    async def __call__(self, exchange: Exchange) -> None:
        hosts = [value for name, value in exchange.headers if name == b"host"]
        if len(hosts) > 1:
            self._refuse(exchange, 400, "the request has more than one Host header; send exactly one")
            return
        host = hosts[0].decode("latin-1") if hosts else None
        if host is not None and not self.hosts.allows(host):  # no Host header: allowed
            self._refuse(exchange, 421, f"this proxy does not answer to Host {host[:100]!r}; the operator "
                                        "lists the names it answers to in --allowed-hosts")
            return
        await self.handler(exchange)

    def _refuse(self, exchange: Exchange, status: int, message: str) -> None:
        if self.on_refused is not None:
            self.on_refused()
        # a request the server refused itself (its body unread) ends its connection, as its handler would
        exchange.respond(status, [(b"content-type", JSON)], error_bytes(status, message),
                         close=exchange.refusal is not None)


def json_body_problem(exchange: Exchange) -> str | None:
    """Why ``exchange`` does not declare a JSON body (None: it does): exactly one ``Content-Type``,
    ``application/json`` in any case, parameters such as ``charset`` allowed."""
    values = [value for name, value in exchange.headers if name == b"content-type"]
    if not values:
        return "the request has no Content-Type header; send Content-Type: application/json"
    if len(values) > 1:
        return "the request has more than one Content-Type header; send one: Content-Type: application/json"
    value = values[0].decode("latin-1")
    if value.partition(";")[0].strip().lower() == "application/json":
        return None
    return f"Content-Type {value[:100]!r} is not allowed here; send Content-Type: application/json"
