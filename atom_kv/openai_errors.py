"""OpenAI/vLLM-shaped error bodies: the one status -> type table and the one ``error_body``.

vLLM answers every error as ``{"error": {"message", "type", "param", "code"}}``
with ``code`` the HTTP status and ``type`` the name below. The proxy and the
reference engine both build their error answers here.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["ERROR_TYPES", "KV_TRANSFER_FAILURE_HEADER", "error_type", "error_body", "error_bytes", "sse_error_event"]

#: Response header a decode engine sets on an error caused by the prefill side
#: (its KV could not be read: handshake refused or failed, a read failed, the
#: producer no longer held the blocks). The value names the side: ``prefill``.
#: A proxy then charges the prefill instance, not the decode engine, and
#: retries with a fresh pair if the client has seen nothing yet.
KV_TRANSFER_FAILURE_HEADER = "X-KV-Transfer-Failure"

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

_encoder = msgspec.json.Encoder()


def error_type(status: int) -> str:
    """The ``type`` vLLM reports for ``status`` (``BadRequestError`` for unknown 4xx, else ``InternalServerError``)."""
    kind = ERROR_TYPES.get(status)
    if kind is not None:
        return kind
    return "BadRequestError" if 400 <= status < 500 else "InternalServerError"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` as vLLM returns it."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


def error_bytes(status: int, message: str, param: str | None = None) -> bytes:
    """:func:`error_body` as JSON bytes."""
    return _encoder.encode(error_body(status, message, param))


def sse_error_event(status: int, message: str) -> bytes:
    """A failure inside an event stream: one ``data: {"error": ...}`` event, then ``data: [DONE]``."""
    return b"data: " + error_bytes(status, message) + b"\n\ndata: [DONE]\n\n"
