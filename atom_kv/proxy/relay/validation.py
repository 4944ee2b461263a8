"""What the proxy checks before it spends a prefill: ``max_tokens`` and the context length.

A request the decode engine would refuse (``max_tokens: -1``, a prompt that
overflows the model) must be refused here, or its prefill holds KV blocks
that nobody will read. Messages follow vLLM's wording and error shape.
"""

from __future__ import annotations

from typing import Any

from atom_kv.proxy.relay.errors import ProxyError

__all__ = ["requested_max_tokens", "context_length_error", "could_overflow"]

_LIMIT_FIELDS = ("max_completion_tokens", "max_tokens")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def requested_max_tokens(body: dict[str, Any]) -> int | None:
    """The completion length the client asked for (``max_completion_tokens`` wins over
    ``max_tokens``; null or absent: None). Raises a 400 naming the field when a
    value is not an integer >= 1."""
    found: int | None = None
    for key in _LIMIT_FIELDS:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProxyError(400, f"{key} must be an integer >= 1, got {_shown(value)}", param=key)
        if value < 1:
            raise ProxyError(400, f"{key} must be at least 1, got {value}", param=key)
        if found is None:
            found = value
    return found


def context_length_error(max_model_len: int, prompt_tokens: int, max_tokens: int | None) -> ProxyError | None:
    """vLLM's 400 when the prompt plus the completion cannot fit in ``max_model_len``, else None."""
    if max_tokens is None:
        if prompt_tokens < max_model_len:
            return None
        return ProxyError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages.",
            param="messages",
        )
    total = prompt_tokens + max_tokens
    if total <= max_model_len:
        return None
    return ProxyError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, you requested {total} tokens "
        f"({prompt_tokens} in the messages, {max_tokens} in the completion). Please reduce the length of the "
        "messages or completion.",
        param="max_tokens",
    )


def could_overflow(text_chars: int, max_tokens: int | None, max_model_len: int) -> bool:
    """Whether a text prompt is long enough that it is worth tokenizing to check it
    (about 4 characters per token; anything past half the context is checked)."""
    return text_chars // 4 + (max_tokens or 0) > max_model_len // 2
