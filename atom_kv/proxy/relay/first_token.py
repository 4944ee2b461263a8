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

With concurrent dispatch the decode leg leaves before the prefill answers, so
the choice is made on the request alone (:func:`forwardable_request`) and the
decode leg is told up front; the prefill's answer then always yields the
first events (:func:`promised_first_events`), from ``first_token_text``: what
a stream shows for that token alone, which is exactly what the decode engine
leaves out (a prefill whose token ended the answer yields just the chat role).

A prefill's answer is checked before any of it is used (:func:`bounded_first_token`):
``first_token_ids`` must be a list of 1 to :data:`~atom_kv.wire.MAX_FIRST_TOKENS`
token ids, each an int in ``0 <= id < MAX_TOKEN_ID`` (engines do not report their
vocabulary size; every engine's token ids are int32), and the first token's text at
most ``--max-first-token-text-bytes``. Anything else is dropped from the params, so
neither the decode leg nor the client sees it, and the request takes the sequential
path (the decode engine computes its first token itself).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Awaitable

import msgspec

from atom_kv.openai_errors import sse_error_event
from atom_kv.proxy.relay.errors import ProxyError, UpstreamResponseError
from atom_kv.proxy.relay.stream import ResponseStream, StreamSink
from atom_kv.wire import KV_FEATURE_FIRST_TOKEN, MAX_FIRST_TOKENS

if TYPE_CHECKING:
    from atom_kv.proxy.routing.pick import Charge

__all__ = ["first_token_events", "forwardable", "forwardable_request", "promised_first_events", "FirstTokenStream",
           "bounded_first_token", "MAX_TOKEN_ID"]

#: token ids are below this (int32 in every engine; none reports its vocabulary size to the proxy)
MAX_TOKEN_ID = 2**31
DEFAULT_MAX_TEXT_BYTES = 1024

logger = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()


def _text_fits(text: object, max_bytes: int) -> bool:
    """A string of at most ``max_bytes`` UTF-8 bytes (the length in characters is checked first)."""
    return isinstance(text, str) and len(text) <= max_bytes and len(text.encode("utf-8", "surrogatepass")) <= max_bytes


def _token_ids_fit(ids: object) -> bool:
    return (isinstance(ids, list) and 1 <= len(ids) <= MAX_FIRST_TOKENS
            and all(type(t) is int and 0 <= t < MAX_TOKEN_ID for t in ids))


def bounded_first_token(prefill_kv: dict[str, Any], max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES) -> bool:
    """Check a prefill's ``first_token_ids`` and ``first_token_text`` (see the module doc); drop both
    from ``prefill_kv`` when either is out of bounds. True when nothing had to be dropped."""
    ids = prefill_kv.get("first_token_ids")
    text = prefill_kv.get("first_token_text")
    if (ids is None or _token_ids_fit(ids)) and (text is None or _text_fits(text, max_text_bytes)):
        return True
    prefill_kv.pop("first_token_ids", None)
    prefill_kv.pop("first_token_text", None)
    return False


def forwardable_request(body: dict[str, Any], decode_features: frozenset[str]) -> bool:
    """True when this request's first token may go to the client from the prefill's answer, for a
    decode engine with these features: a stream whose first text is final on its own."""
    if KV_FEATURE_FIRST_TOKEN not in decode_features or body.get("stream") is not True:
        return False
    if body.get("stop") or body.get("echo") or body.get("logprobs") or body.get("top_logprobs"):
        return False
    return body.get("n") in (None, 1)


def forwardable(body: dict[str, Any], decode_features: frozenset[str], prefill_kv: dict[str, Any]) -> bool:
    """True when the prefill's first token may go to the client before the decode leg answers."""
    ids = prefill_kv.get("first_token_ids")
    return isinstance(ids, list) and len(ids) == 1 and forwardable_request(body, decode_features)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def _choice(answer: Any) -> dict[str, Any] | None:
    if not isinstance(answer, dict):
        return None
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    return choices[0]


def _answer_text(choice: dict[str, Any], chat: bool) -> Any:
    if chat:
        message = choice.get("message")
        return message.get("content") if isinstance(message, dict) else None
    return choice.get("text")


def _events(answer: dict[str, Any], text: str, chat: bool) -> bytes:
    """The role chunk (chat) and, when ``text`` is not empty, one chunk with it."""
    base = {"id": answer.get("id"), "created": answer.get("created"), "model": answer.get("model")}
    if chat:
        obj = {**base, "object": "chat.completion.chunk"}
        out = _event({**obj, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]})
        if text:
            out += _event({**obj, "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None,
                                               "finish_reason": None}]})
        return out
    if not text:
        return b""
    return _event({**base, "object": "text_completion",
                   "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]})


def first_token_events(answer: Any, chat: bool, prefill_kv: dict[str, Any] | None = None,
                       max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES) -> bytes | None:
    """The client's first SSE event(s) from the prefill's (non-streamed) answer: the role chunk and
    the first content chunk for chat, the first text chunk for completions. None when the answer
    does not hold exactly one unfinished-by-stop choice with text that stands on its own (the
    prefill's ``first_token_text`` when it gives one; else the answer's, where a U+FFFD says the
    token is a piece of a longer UTF-8 character, which a stream holds back)."""
    choice = _choice(answer)
    if choice is None or choice.get("finish_reason") not in (None, "length"):
        return None  # the prefill's token ended the answer (a stop token): the decode engine says so
    text = (prefill_kv or {}).get("first_token_text")
    if not isinstance(text, str):
        text = _answer_text(choice, chat)
        if isinstance(text, str) and "\ufffd" in text:
            return None
    if not isinstance(text, str) or not text or not _text_fits(text, max_text_bytes):
        return None
    return _events(answer, text, chat)


def promised_first_events(answer: Any, chat: bool, prefill_kv: dict[str, Any],
                          max_text_bytes: int = DEFAULT_MAX_TEXT_BYTES) -> bytes | None:
    """The first events of a stream whose decode leg was told up front to leave the first token
    out: the role chunk (chat) and the token's text as a stream shows it alone (possibly nothing:
    a byte of a longer character, or a stop token, whose end the decode engine reports). None
    when the answer does not hold one choice, or its text is over ``max_text_bytes``."""
    choice = _choice(answer)
    if choice is None:
        return None
    text = prefill_kv.get("first_token_text")
    if not isinstance(text, str):
        text = _answer_text(choice, chat) if choice.get("finish_reason") in (None, "length") else ""
    if not isinstance(text, str) or not _text_fits(text, max_text_bytes):
        return None
    return _events(answer, text, chat)


def _error_event(exc: BaseException) -> bytes:
    err = getattr(exc, "error", exc)  # a retryable failure carries its ProxyError
    if isinstance(err, ProxyError):
        return sse_error_event(err.status, err.message)
    if isinstance(err, UpstreamResponseError):
        return sse_error_event(err.status, err.body[:300].decode("utf-8", "replace"))
    return sse_error_event(502, f"decode leg failed: {type(err).__name__}")


class FirstTokenStream:
    """Owns the client's answer from the first event on: writes it, then pipes the decode leg's
    stream once ``open_decode`` (already running, as the task this stream owns) has it.
    ``open_decode`` owns the decode leg's failures (it abandons the prefill before it raises);
    this stream turns them into an error event. ``aclose()`` before the decode leg answered
    cancels it. ``holds``: the decode leg's charge, held by that task until the decode stream
    takes it over (released when the task ends otherwise, even if it is cancelled before it ran)."""

    def __init__(self, first: bytes, open_decode: Awaitable[ResponseStream], request_id: str,
                 holds: Charge | None = None) -> None:
        self._first = first
        self._opening = asyncio.ensure_future(open_decode)
        if holds is not None:
            holds.release_when_done(self._opening)
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
