"""Byte-level tokenizer: one token per UTF-8 byte plus a few special tokens."""

from __future__ import annotations

import codecs
from typing import Iterable

__all__ = ["ByteTokenizer", "IncrementalDetokenizer"]


class ByteTokenizer:
    """Maps text to UTF-8 byte ids (0..255) and back; owns the special ids."""

    BOS = 256
    EOS = 257
    PAD = 258
    VOCAB_SIZE = 260  # 256 bytes + BOS, EOS, PAD, one spare

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        """A simple deterministic chat template over ``{"role", "content"}`` messages."""
        parts = []
        for message in messages:
            role = str(message.get("role", "user"))
            content = message.get("content", "")
            if isinstance(content, list):  # OpenAI content parts
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"<|{role}|>\n{content}\n")
        parts.append("<|assistant|>\n")
        return "".join(parts)


class IncrementalDetokenizer:
    """Turns a stream of byte ids into text pieces without splitting UTF-8 characters."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if not 0 <= token_id < 256:
            return ""
        return self._decoder.decode(bytes([token_id]))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
