"""Parsing OpenAI-style request bodies and building response bodies (no I/O)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from atom_kv.reference.request import RequestError
from atom_kv.reference.sampling_params import is_int, parse_sampling, shown
from atom_kv.reference.tokenizer import ByteTokenizer

__all__ = ["GenerateParams", "TokenizeParams", "parse_request", "parse_prompt", "parse_tokenize",
           "completion_body", "chunk_body"]


@dataclass
class GenerateParams:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: Optional[int]
    stream: bool
    include_usage: bool
    kv_transfer_params: Optional[dict]
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class TokenizeParams:
    prompt_ids: list[int]


def _bool_field(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"`{key}` must be true or false, got {shown(value)}", param=key)
    return value


def _check_unicode(text: str, param: str) -> None:
    """Text that is not valid Unicode (a lone surrogate, which a JSON ``\\uXXXX`` escape can
    spell and UTF-8 cannot encode) is a 400 naming ``param``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"`{param}` is not valid Unicode text: it has a lone surrogate "
                           f"(U+{ord(text[exc.start]):04X}) at character {exc.start}", param=param) from None


def _encoded(tokenizer: ByteTokenizer, text: str, param: str, *, add_bos: bool) -> list[int]:
    _check_unicode(text, param)
    return tokenizer.encode(text, add_bos=add_bos)


def _model(body: dict, served_model: Optional[str]) -> None:
    """vLLM's rule: a missing model means the served one; any other name is a 404."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise RequestError(f"`model` must be a string, got {shown(model)}", param="model")
    if served_model is not None and model != served_model:
        raise RequestError(f"The model `{model}` does not exist.", status=404, param="model")


def parse_prompt(body: dict, tokenizer: ByteTokenizer, *, chat: bool, add_bos: bool = True) -> list[int]:
    """The prompt's token ids from ``messages`` (chat) or ``prompt`` (completions)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("`messages` must be a non-empty list of {role, content} objects", param="messages")
        return _encoded(tokenizer, tokenizer.apply_chat_template(messages), "messages", add_bos=add_bos)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _encoded(tokenizer, prompt, "prompt", add_bos=add_bos)
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        if any(not 0 <= t < tokenizer.VOCAB_SIZE for t in prompt):
            raise RequestError(f"`prompt` token ids must be in 0..{tokenizer.VOCAB_SIZE - 1}", param="prompt")
        return list(prompt)
    raise RequestError("`prompt` must be a string, a list with one string, or a list of token ids",
                       param="prompt")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"`stop` must be a non-empty string or a list of non-empty strings, got {shown(stop)}",
                           param="stop")
    for s in stop:
        _check_unicode(s, "stop")  # the stop checker matches their UTF-8 bytes
    return stop


def _stop_token_ids(body: dict, vocab_size: int) -> list[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(is_int(t) and 0 <= t < vocab_size for t in ids):
        raise RequestError(f"`stop_token_ids` must be a list of token ids in 0..{vocab_size - 1}, got {shown(ids)}",
                           param="stop_token_ids")
    return ids


def parse_request(body: Any, tokenizer: ByteTokenizer, *, chat: bool, default_max_tokens: int,
                  served_model: Optional[str] = None) -> GenerateParams:
    """Validate a completions/chat body; raise :class:`RequestError` naming the bad field.

    An unknown ``model`` is a 404; the sampling fields are checked by
    :func:`~atom_kv.reference.sampling_params.parse_sampling` (a parameter this
    engine does not implement is a 400 naming it; its neutral value is accepted)."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    _model(body, served_model)
    prompt_ids = parse_prompt(body, tokenizer, chat=chat)
    sampling = parse_sampling(body, chat=chat, default_max_tokens=default_max_tokens)
    kv_params = body.get("kv_transfer_params")
    if kv_params is not None and not isinstance(kv_params, dict):
        raise RequestError("`kv_transfer_params` must be an object", param="kv_transfer_params")
    stream = _bool_field(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is None:
        stream_options = {}
    if not isinstance(stream_options, dict):
        raise RequestError(f"`stream_options` must be an object, got {shown(stream_options)}", param="stream_options")
    include_usage = _bool_field(stream_options, "include_usage")
    return GenerateParams(
        prompt_ids=prompt_ids,
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        seed=sampling.seed,
        stream=stream,
        include_usage=include_usage,
        kv_transfer_params=kv_params,
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body, tokenizer.VOCAB_SIZE),
    )


def parse_tokenize(body: Any, tokenizer: ByteTokenizer, *, served_model: Optional[str] = None) -> TokenizeParams:
    """vLLM's ``/tokenize`` body: ``model`` plus ``prompt`` or ``messages``; the tokens are
    exactly those ``/v1/completions`` or ``/v1/chat/completions`` would run."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    _model(body, served_model)
    if ("prompt" in body) == ("messages" in body):
        raise RequestError("send either `prompt` or `messages`", param="prompt")
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise RequestError(f"`add_special_tokens` must be true or false, got {shown(add_special)}",
                           param="add_special_tokens")
    return TokenizeParams(parse_prompt(body, tokenizer, chat="messages" in body, add_bos=add_special))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens``: prompt tokens this engine found
    in its own prefix cache (tokens read from a producer are not counted)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(*, rid: str, model: str, chat: bool, text: str, finish_reason: Optional[str],
                    prompt_tokens: int, completion_tokens: int, created: int,
                    kv_transfer_params: Optional[dict], stop_reason: Union[str, int, None] = None,
                    cached_tokens: int = 0) -> dict[str, Any]:
    """A whole answer; ``kv_transfer_params`` appears only when the request was one leg of a
    P/D exchange that produced them (a prefill answer), as in vLLM's P/D answers."""
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def chunk_body(*, rid: str, model: str, chat: bool, created: int, text: Optional[str],
               finish_reason: Optional[str], role: bool = False,
               stop_reason: Union[str, int, None] = None) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                                  "stop_reason": stop_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice]}


def now_s() -> int:
    return int(time.time())
