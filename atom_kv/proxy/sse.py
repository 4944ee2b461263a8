"""Streaming helpers: patch ``usage.prompt_tokens`` in an SSE stream's usage chunk."""

from __future__ import annotations

import msgspec

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def patch_usage(obj: object, prompt_tokens: int) -> bool:
    """Set ``usage.prompt_tokens`` (and keep ``total_tokens`` consistent); True if changed."""
    if not isinstance(obj, dict):
        return False
    usage = obj.get("usage")
    if not isinstance(usage, dict) or usage.get("prompt_tokens") == prompt_tokens:
        return False
    old = usage.get("prompt_tokens")
    usage["prompt_tokens"] = prompt_tokens
    total = usage.get("total_tokens")
    if isinstance(total, int) and isinstance(old, int):
        usage["total_tokens"] = total - old + prompt_tokens
    return True


class UsageRewriter:
    """Line-buffers an SSE byte stream and rewrites ``data:`` events that carry usage."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            self._pending = data
            return b""
        self._pending = data[cut + 1 :]
        return self._rewrite(data[: cut + 1])

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return self._rewrite(rest) if rest else b""

    def _rewrite(self, block: bytes) -> bytes:
        if b'"usage"' not in block:
            return block
        lines = block.split(b"\n")
        for i, line in enumerate(lines):
            if line.startswith(b"data: {") and b'"usage"' in line:
                try:
                    obj = _decoder.decode(line[6:].rstrip(b"\r"))
                except msgspec.DecodeError:
                    continue
                if patch_usage(obj, self.prompt_tokens):
                    lines[i] = b"data: " + _encoder.encode(obj)
        return b"\n".join(lines)
