"""First-token forwarding: which pairs and requests forward, the first events, and a decode leg failing after them."""

import asyncio
import json

import pytest

from atom_kv.proxy.relay.errors import ProxyError
from atom_kv.proxy.relay.first_token import (
    FirstTokenStream, first_token_events, forwardable, forwardable_request, promised_first_events,
)
from atom_kv.wire import KV_FEATURE_FIRST_TOKEN

FEATURES = frozenset({KV_FEATURE_FIRST_TOKEN})
KV = {"first_token_ids": [72], "transfer_id": "t"}
ANSWER = {"id": "cmpl-1", "created": 5, "model": "m", "object": "text_completion",
          "choices": [{"index": 0, "text": "H", "finish_reason": "length"}]}


def test_forwards_only_streamed_requests_to_a_decode_engine_that_continues():
    assert forwardable({"stream": True}, FEATURES, KV)
    assert not forwardable({"stream": False}, FEATURES, KV)
    assert not forwardable({"stream": True}, frozenset(), KV)  # another connector: sequential as before
    assert not forwardable({"stream": True}, FEATURES, {"transfer_id": "t"})  # a prefill that did not say


@pytest.mark.parametrize("extra", [{"stop": ["x"]}, {"stop": "x"}, {"n": 2}, {"logprobs": 1}, {"echo": True}])
def test_requests_whose_first_text_is_not_final_stay_sequential(extra):
    assert not forwardable({"stream": True, **extra}, FEATURES, KV)


def _events(raw: bytes) -> list[dict]:
    return [json.loads(e[6:]) for e in raw.split(b"\n\n") if e]


def test_first_events_for_completions_and_chat():
    (event,) = _events(first_token_events(ANSWER, chat=False))
    assert event["id"] == "cmpl-1" and event["object"] == "text_completion"
    assert event["choices"] == [{"index": 0, "text": "H", "logprobs": None, "finish_reason": None}]
    chat = {**ANSWER, "choices": [{"index": 0, "message": {"role": "assistant", "content": "H"},
                                   "finish_reason": "length"}]}
    role, content = _events(first_token_events(chat, chat=True))
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert content["choices"][0]["delta"] == {"content": "H"} and content["object"] == "chat.completion.chunk"


@pytest.mark.parametrize("answer", [
    None, {}, {"choices": []},
    {**ANSWER, "choices": [{"index": 0, "text": "H", "finish_reason": "stop"}]},  # the token ended it
    {**ANSWER, "choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
    # a byte of a longer UTF-8 character: a stream would show nothing yet, not U+FFFD
    {**ANSWER, "choices": [{"index": 0, "text": "\ufffd", "finish_reason": "length"}]},
])
def test_no_first_event_from_an_unusable_answer(answer):
    assert first_token_events(answer, chat=False) is None


def test_the_prefills_own_first_token_text_wins_over_its_answer():
    kv = {**KV, "first_token_text": "H"}
    broken = {**ANSWER, "choices": [{"index": 0, "text": "\ufffd", "finish_reason": "length"}]}
    (event,) = _events(first_token_events(broken, chat=False, prefill_kv=kv))
    assert event["choices"][0]["text"] == "H"
    assert first_token_events(ANSWER, chat=False, prefill_kv={**KV, "first_token_text": ""}) is None


def test_a_promised_first_token_always_yields_what_the_decode_leaves_out():
    """Concurrent dispatch told the decode engine up front to leave the first token out."""
    assert forwardable_request({"stream": True}, FEATURES) and not forwardable_request({"stream": True}, frozenset())
    (event,) = _events(promised_first_events(ANSWER, False, {**KV, "first_token_text": "H"}))
    assert event["choices"][0]["text"] == "H"
    # a byte of a longer character shows nothing yet: nothing for completions, the role for chat
    assert promised_first_events(ANSWER, False, {**KV, "first_token_text": ""}) == b""
    chat = {**ANSWER, "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                                   "finish_reason": "stop"}]}
    (role,) = _events(promised_first_events(chat, True, {**KV, "first_token_text": ""}))
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    stopped = {**ANSWER, "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}
    assert promised_first_events(stopped, False, KV) == b""  # the decode engine ends the stream
    assert promised_first_events({"choices": []}, False, KV) is None


class _Sink:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.ended = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def end(self, data: bytes = b"") -> None:
        self.writes.append(data)
        self.ended = True

    def flush_head(self) -> None:
        pass

    def set_producer(self, producer: object) -> None:
        pass


def test_a_decode_leg_failing_after_the_first_token_ends_the_stream_with_an_error():
    async def failing():
        await asyncio.sleep(0)
        raise ProxyError(502, "decode instance http://d unreachable")

    async def main():
        sink = _Sink()
        await FirstTokenStream(b"data: first\n\n", failing(), "r").pipe(sink)
        return sink

    sink = asyncio.run(main())
    assert sink.writes[0] == b"data: first\n\n" and sink.ended
    error = json.loads(sink.writes[1].split(b"\n\n")[0][6:])
    assert error["error"]["message"] == "decode instance http://d unreachable"
    assert sink.writes[1].endswith(b"data: [DONE]\n\n")


def test_closing_before_the_decode_leg_answers_cancels_it():
    async def main():
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def slow():
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        stream = FirstTokenStream(b"data: first\n\n", slow(), "r")
        piping = asyncio.ensure_future(stream.pipe(_Sink()))
        await asyncio.wait_for(started.wait(), 5)
        stream.aclose()
        await asyncio.wait_for(cancelled.wait(), 5)
        await asyncio.wait_for(piping, 5)  # returns quietly: the client is gone

    asyncio.run(main())

