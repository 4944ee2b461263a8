"""Request parsing and response shapes of the OpenAI front end."""

import pytest

from atom_kv.reference.openai_protocol import chunk_body, completion_body, error_body, parse_request
from atom_kv.reference.request import RequestError
from atom_kv.reference.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _parse(body, chat=False):
    return parse_request(body, TOK, chat=chat, default_max_tokens=16)


def test_completion_prompt_forms():
    assert _parse({"prompt": "ab"}).prompt_ids == [TOK.BOS, 97, 98]
    assert _parse({"prompt": ["ab"]}).prompt_ids == [TOK.BOS, 97, 98]
    assert _parse({"prompt": [256, 5, 6]}).prompt_ids == [256, 5, 6]
    p = _parse({"prompt": "x", "max_tokens": 3, "stream": True, "temperature": 0.5, "seed": 7,
                "kv_transfer_params": {"do_remote_decode": True},
                "stream_options": {"include_usage": True}})
    assert (p.max_tokens, p.stream, p.temperature, p.seed, p.include_usage) == (3, True, 0.5, 7, True)
    assert p.kv_transfer_params == {"do_remote_decode": True}
    assert _parse({"prompt": "x"}).temperature == 0.0  # greedy by default


def test_chat_uses_template_and_max_completion_tokens():
    p = _parse({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "max_tokens": 9},
               chat=True)
    assert p.max_tokens == 5
    assert TOK.decode(p.prompt_ids) == TOK.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("body,param", [
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, 999]}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "kv_transfer_params": [1]}, "kv_transfer_params"),
])
def test_bad_fields_are_named(body, param):
    with pytest.raises(RequestError) as info:
        _parse(body)
    assert info.value.param == param and info.value.status == 400


def test_chat_requires_messages():
    with pytest.raises(RequestError) as info:
        _parse({"messages": []}, chat=True)
    assert info.value.param == "messages"


def test_response_shapes():
    err = error_body("boom", 503)
    assert err == {"error": {"message": "boom", "type": "ServiceUnavailableError", "param": None, "code": 503}}
    body = completion_body(rid="r", model="m", chat=False, text="hey", finish_reason="length", prompt_tokens=2,
                           completion_tokens=3, created=1, kv_transfer_params={"transfer_id": "t"})
    assert body["choices"][0]["text"] == "hey" and body["usage"]["total_tokens"] == 5
    assert body["kv_transfer_params"] == {"transfer_id": "t"}
    chat = completion_body(rid="r", model="m", chat=True, text="hey", finish_reason="length", prompt_tokens=2,
                           completion_tokens=3, created=1, kv_transfer_params=None)
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hey"}
    chunk = chunk_body(rid="r", model="m", chat=True, created=1, text="a", finish_reason=None, role=True)
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
