"""First-token forwarding: the client gets the prefill's token while the decode leg is still on its way.

A prefill engine of ours answers with the token it sampled
(``kv_transfer_params.first_token_ids``); a decode engine that announces the
``first_token`` feature (its ``/health`` ``kv_features``) continues from it.
For such a pair, and a streamed request whose first token's text is final on
its own (no stop strings, ``n`` = 1, no logprobs, no echo), the proxy writes
the first event from the prefill's answer at once and tells the decode leg
(``first_token_sent``) to leave that token out of its stream. Any other pair
or request keeps the sequential behaviour: nothing changes for engines that
run another connector.

Once the first event is out the answer's status is 200: a decode leg that
fails afterwards ends the stream with an error event (the pair is not
re-planned), and the prefill is abandoned as usual.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable

import msgspec

from atom_kv.openai_errors import sse_error_event
from atom_kv.proxy.errors import ProxyError, UpstreamResponseError
from atom_kv.proxy.stream import ResponseStream, StreamSink
from atom_kv.wire import KV_FEATURE_FIRST_TOKEN

__all__ = ["first_token_events", "forwardable", "FirstTokenStream"]

logger = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()


def forwardable(body: dict[str, Any], decode_features: frozenset[str], prefill_kv: dict[str, Any]) -> bool:
    """True when the prefill's first token may go to the client before the decode leg answers."""
    if KV_FEATURE_FIRST_TOKEN not in decode_features or body.get("stream") is not True:
        return False
    ids = prefill_kv.get("first_token_ids")
    if not isinstance(ids, list) or len(ids) != 1:
        return False
    if body.get("stop") or body.get("echo") or body.get("logprobs") or body.get("top_logprobs"):
        return False
    return body.get("n") in (None, 1)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def first_token_events(answer: Any, chat: bool) -> bytes | None:
    """The client's first SSE event(s) from the prefill's (non-streamed) answer: the role chunk and
    the first content chunk for chat, the first text chunk for completions. None when the answer
    does not hold exactly one unfinished-by-stop choice with text that stands on its own (a
    U+FFFD says the token is a piece of a longer UTF-8 character, which a stream holds back)."""
    if not isinstance(answer, dict):
        return None
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    if choice.get("finish_reason") not in (None, "length"):
        return None  # the prefill's token ended the answer (a stop token): the decode engine says so
    base = {"id": answer.get("id"), "created": answer.get("created"), "model": answer.get("model")}
    if chat:
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else None
        if not isinstance(text, str) or not text or "\ufffd" in text:
            return None
        obj = {**base, "object": "chat.completion.chunk"}
        return (_event({**obj, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
                + _event({**obj, "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None,
                                              "finish_reason": None}]}))
    text = choice.get("text")
    if not isinstance(text, str) or not text or "\ufffd" in text:
        return None
    return _event({**base, "object": "text_completion",
                   "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]})


def _error_event(exc: BaseException) -> bytes:
    err = getattr(exc, "error", exc)  # a retryable failure carries its ProxyError
    if isinstance(err, ProxyError):
        return sse_error_event(err.status, err.message)
    if isinstance(err, UpstreamResponseError):
        return sse_error_event(err.status, err.body[:300].decode("utf-8", "replace"))
    return sse_error_event(502, f"decode leg failed: {type(err).__name__}")


class FirstTokenStream:
    """Owns the client's answer from the first event on: writes it, then pipes the decode leg's
    stream once ``open_decode`` (already running) has it. ``open_decode`` owns the decode leg's
    failures (it abandons the prefill and credits the decode pick before it raises); this
    stream turns them into an error event. ``aclose()`` before the decode leg answered cancels it."""

    def __init__(self, first: bytes, open_decode: Awaitable[ResponseStream], request_id: str) -> None:
        self._first = first
        self._opening = asyncio.ensure_future(open_decode)
        self._request_id = request_id
        self._inner: ResponseStream | None = None
        self._closed = False

    async def pipe(self, sink: StreamSink) -> None:
        sink.write(self._first)
        try:
            inner = await self._opening
        except asyncio.CancelledError:
            if self._closed:
                return
            raise
        except Exception as exc:
            logger.warning("[%s] decode leg failed after the first token was sent: %s", self._request_id, exc)
            sink.end(_error_event(exc))
            return
        self._inner = inner
        await inner.pipe(sink)

    def aclose(self, release: bool = False) -> None:
        """Abandon the answer; ``release``: the client stalled, the decode stream's own release
        applies (a decode leg still opening is cancelled, which abandons the prefill)."""
        self._closed = True
        if self._inner is not None:
            self._inner.aclose(release)
        elif not self._opening.done():
            self._opening.cancel()
        elif not self._opening.cancelled() and self._opening.exception() is None:
            self._opening.result().aclose(release)  # opened, but never piped
