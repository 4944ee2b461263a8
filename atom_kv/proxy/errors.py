"""OpenAI/vLLM-shaped error bodies and the exception the relay raises to produce them."""

from __future__ import annotations

from typing import Any

import msgspec

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

_encoder = msgspec.json.Encoder()


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` as vLLM returns it."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "InternalServerError"),
            "param": param,
            "code": status,
        }
    }


def error_bytes(status: int, message: str, param: str | None = None) -> bytes:
    return _encoder.encode(error_body(status, message, param))


def sse_error_event(status: int, message: str) -> bytes:
    """A mid-stream failure: one ``data: {"error": ...}`` event, then ``data: [DONE]``."""
    return b"data: " + error_bytes(status, message) + b"\n\ndata: [DONE]\n\n"


class ProxyError(Exception):
    """A failure the client should see as ``status`` with a vLLM-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return error_bytes(self.status, self.message, self.param)


class UpstreamResponseError(Exception):
    """An upstream answered with an error status; carries its body to pass through."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"upstream status {status}")
        self.status = status
        self.body = body
        self.content_type = content_type
