"""The exceptions the relay raises to produce error answers (bodies from :mod:`atom_kv.openai_errors`),
and :class:`EngineFailures`, which words an engine's failure for the client.

An engine's failure is told to the client in the proxy's words (which engine role failed and how,
with the request id); the engine's address and its own error text are the operator's: they go to
the log, and to the instance's ``last_error`` in ``/instances``. ``--expose-upstream-errors`` puts
them back into the client's message, for debugging."""

from __future__ import annotations

import time

from atom_kv.openai_errors import error_bytes
from atom_kv.proxy.fleet.registry import ROLE_NAMES, Instance, LastError

__all__ = ["EngineFailures", "ProxyError", "UpstreamResponseError", "engine_text"]

#: an engine's own error text is cut to this many bytes before it is logged or exposed
ENGINE_TEXT_BYTES = 300
#: the operator's account of one failure is cut to this many characters where the registry keeps it
_LAST_ERROR_CHARS = 600


class ProxyError(Exception):
    """A failure the client should see as ``status`` with a vLLM-shaped body: ``message``.
    ``detail`` is the operator's account (engine address, engine text) when it differs;
    ``str(err)`` and :attr:`logged` give it, so logs carry what the client is not told.
    ``retry_after``: seconds for a ``Retry-After`` header (admission control's 429s)."""

    def __init__(self, status: int, message: str, param: str | None = None, *, detail: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(detail or message)
        self.retry_after = retry_after
        self.status = status
        self.message = message
        self.param = param
        self.detail = detail

    @property
    def logged(self) -> str:
        """What the log says about this failure (the detail when there is one)."""
        return self.detail or self.message

    def body(self) -> bytes:
        return error_bytes(self.status, self.message, self.param)


class UpstreamResponseError(Exception):
    """An upstream answered with a client error (4xx); carries its body to pass through."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"upstream status {status}")
        self.status = status
        self.body = body
        self.content_type = content_type


def engine_text(body: bytes) -> str:
    """The first :data:`ENGINE_TEXT_BYTES` bytes of an engine's answer, as text for the log."""
    return body[:ENGINE_TEXT_BYTES].decode("utf-8", "replace")


class EngineFailures:
    """Words one proxy's client errors for engine failures. Owns one choice: ``expose``
    (``--expose-upstream-errors``: the client's message is the operator's account, engine
    address and text included, as before the flag existed); without it the client learns only
    which engine role failed and how, and the request id to find the rest in the log."""

    def __init__(self, expose: bool = False) -> None:
        self.expose = expose

    def error(self, status: int, inst: Instance, what: str, detail: str, request_id: str,
              prefix: str = "") -> ProxyError:
        """The error for ``inst``'s failure: ``prefix`` and ``what`` (our words, e.g. "answered 500")
        for the client, ``detail`` (the engine's address and text) for the log and ``/instances``."""
        inst.last_error = LastError(detail[:_LAST_ERROR_CHARS], time.time())
        if self.expose:
            return ProxyError(status, detail, detail=detail)
        return ProxyError(status, f"{prefix}the {ROLE_NAMES[inst.role]} engine {what} (request {request_id}; "
                                  "details in the proxy's log)", detail=detail)
