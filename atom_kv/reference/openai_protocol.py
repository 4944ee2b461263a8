"""Parsing OpenAI-style request bodies and building response bodies (no I/O)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from atom_kv.reference.request import RequestError
from atom_kv.reference.tokenizer import ByteTokenizer

__all__ = ["GenerateParams", "parse_request", "error_body", "completion_body", "chunk_body"]

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
                502: "BadGatewayError", 503: "ServiceUnavailableError"}


def error_body(message: str, status: int, param: Optional[str] = None) -> dict[str, Any]:
    """vLLM's error shape."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "InternalServerError"),
                      "param": param, "code": status}}


@dataclass
class GenerateParams:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: Optional[int]
    stream: bool
    include_usage: bool
    kv_transfer_params: Optional[dict]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(body: dict, key: str, default: Optional[int], minimum: int) -> Optional[int]:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RequestError(f"`{key}` must be an integer >= {minimum}, got {value!r}", param=key)
    return value


def parse_request(body: Any, tokenizer: ByteTokenizer, *, chat: bool, default_max_tokens: int) -> GenerateParams:
    """Validate a completions/chat body; raise :class:`RequestError` naming the bad field."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("`messages` must be a non-empty list of {role, content} objects", param="messages")
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            if any(not 0 <= t < tokenizer.VOCAB_SIZE for t in prompt):
                raise RequestError(f"`prompt` token ids must be in 0..{tokenizer.VOCAB_SIZE - 1}", param="prompt")
            prompt_ids = list(prompt)
        else:
            raise RequestError("`prompt` must be a string, a list with one string, or a list of token ids",
                               param="prompt")
    max_tokens = _int_field(body, "max_completion_tokens", None, 1) if chat else None
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", default_max_tokens, 1) or default_max_tokens
    n = _int_field(body, "n", 1, 1)
    if n != 1:
        raise RequestError("only `n` = 1 is supported", param="n")
    temperature = body.get("temperature", 0.0)
    if temperature is None:
        temperature = 0.0
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise RequestError(f"`temperature` must be a number >= 0, got {temperature!r}", param="temperature")
    seed = _int_field(body, "seed", None, 0)
    kv_params = body.get("kv_transfer_params")
    if kv_params is not None and not isinstance(kv_params, dict):
        raise RequestError("`kv_transfer_params` must be an object", param="kv_transfer_params")
    stream_options = body.get("stream_options") or {}
    return GenerateParams(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=float(temperature),
        seed=seed,
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(stream_options, dict) and stream_options.get("include_usage")),
        kv_transfer_params=kv_params,
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(*, rid: str, model: str, chat: bool, text: str, finish_reason: Optional[str],
                    prompt_tokens: int, completion_tokens: int, created: int,
                    kv_transfer_params: Optional[dict]) -> dict[str, Any]:
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens),
    }
    body["kv_transfer_params"] = kv_transfer_params
    return body


def chunk_body(*, rid: str, model: str, chat: bool, created: int, text: Optional[str],
               finish_reason: Optional[str], role: bool = False) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice]}


def now_s() -> int:
    return int(time.time())
