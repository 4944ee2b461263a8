"""The exceptions the relay raises to produce error answers (bodies from :mod:`atom_kv.openai_errors`)."""

from __future__ import annotations

from atom_kv.openai_errors import error_bytes


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
