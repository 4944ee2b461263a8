"""Request parsing and response shapes of the OpenAI front end."""

import pytest

from atom_kv.openai_errors import error_body
from atom_kv.reference.openai_protocol import (
    chunk_body,
    completion_body,
    parse_request,
    parse_tokenize,
)
from atom_kv.reference.request import RequestError
from atom_kv.reference.sampling_params import MAX_SEED, UNSUPPORTED as REFUSED
from atom_kv.reference.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _parse(body, chat=False):
    return parse_request(body, TOK, chat=chat, default_max_tokens=16, served_model="atom-kv-tiny")


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
    err = error_body(503, "boom")
    assert err == {"error": {"message": "boom", "type": "ServiceUnavailableError", "param": None, "code": 503}}
    body = completion_body(rid="r", model="m", chat=False, text="hey", finish_reason="length", prompt_tokens=2,
                           completion_tokens=3, created=1, kv_transfer_params={"transfer_id": "t"})
    assert body["choices"][0]["text"] == "hey" and body["usage"]["total_tokens"] == 5
    assert body["kv_transfer_params"] == {"transfer_id": "t"}
    chat = completion_body(rid="r", model="m", chat=True, text="hey", finish_reason="length", prompt_tokens=2,
                           completion_tokens=3, created=1, kv_transfer_params=None)
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hey"}
    assert "kv_transfer_params" not in chat  # only answers that were part of a P/D exchange carry it
    assert error_body(405, "no")["error"]["type"] == "MethodNotAllowedError"
    chunk = chunk_body(rid="r", model="m", chat=True, created=1, text="a", finish_reason=None, role=True)
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": "a"}


def test_unknown_model_is_a_404_in_vllms_words_and_a_missing_model_is_the_served_one():
    with pytest.raises(RequestError) as info:
        _parse({"model": "gpt-4", "prompt": "x"})
    assert (info.value.status, info.value.param) == (404, "model")
    assert info.value.message == "The model `gpt-4` does not exist."
    assert _parse({"prompt": "x"}).prompt_ids == _parse({"model": "atom-kv-tiny", "prompt": "x"}).prompt_ids
    with pytest.raises(RequestError) as info:
        _parse({"model": 7, "prompt": "x"})
    assert (info.value.status, info.value.param) == (400, "model")


UNSUPPORTED = [
    ("logprobs", 1), ("logprobs", True), ("top_logprobs", 2), ("prompt_logprobs", 0), ("echo", True),
    ("logit_bias", {"65": 5}), ("best_of", 2), ("suffix", "end"), ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required"),
    ("presence_penalty", 0.5), ("frequency_penalty", -1), ("repetition_penalty", 1.2), ("top_p", 0.9),
    ("top_k", 5), ("min_p", 0.1), ("min_tokens", 3), ("include_stop_str_in_output", True),
]


@pytest.mark.parametrize("key,value", UNSUPPORTED, ids=[f"{k}={v!r}" for k, v in UNSUPPORTED])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_parameters_not_implemented_are_refused_by_name(key, value, chat):
    body = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    with pytest.raises(RequestError) as info:
        _parse({**body, key: value}, chat=chat)
    assert (info.value.status, info.value.param) == (400, key)
    assert f"`{key}`" in info.value.message and "not supported" in info.value.message


def test_every_refused_parameter_is_covered_above():
    assert {k for k, _, _ in REFUSED} == {k for k, _ in UNSUPPORTED}


def test_default_values_of_unimplemented_parameters_are_accepted():
    defaults = {"logprobs": None, "top_logprobs": 0, "echo": False, "logit_bias": {}, "best_of": 1, "suffix": "",
                "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "presence_penalty": 0,
                "frequency_penalty": 0.0, "repetition_penalty": 1.0, "top_p": 1, "top_k": -1, "min_p": 0.0,
                "min_tokens": 0, "include_stop_str_in_output": False, "prompt_logprobs": None}
    assert _parse({"prompt": "x", **defaults}).prompt_ids == _parse({"prompt": "x"}).prompt_ids
    assert _parse({"messages": [{"role": "user", "content": "x"}], "logprobs": False}, chat=True)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "stream": "false"}, "stream"),
    ({"prompt": "x", "stream": 1}, "stream"),
    ({"prompt": "x", "stream": True, "stream_options": "usage"}, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": ["ok", 3]}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [10, 999]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": 10}, "stop_token_ids"),
])
def test_wrong_types_are_refused_by_name(body, param):
    with pytest.raises(RequestError) as info:
        _parse(body)
    assert (info.value.status, info.value.param) == (400, param)


def test_stop_forms():
    assert _parse({"prompt": "x"}).stop == [] and _parse({"prompt": "x", "stop": None}).stop == []
    assert _parse({"prompt": "x", "stop": "\n"}).stop == ["\n"]
    p = _parse({"prompt": "x", "stop": ["a", "bc"], "stop_token_ids": [10, 33], "stream": False})
    assert (p.stop, p.stop_token_ids, p.stream) == (["a", "bc"], [10, 33], False)


def test_tokenize_gives_the_tokens_generation_would_run():
    assert parse_tokenize({"model": "atom-kv-tiny", "prompt": "ab"}, TOK, served_model="atom-kv-tiny").prompt_ids \
        == _parse({"prompt": "ab"}).prompt_ids
    messages = [{"role": "user", "content": "hi"}]
    assert parse_tokenize({"messages": messages}, TOK).prompt_ids == _parse({"messages": messages}, chat=True).prompt_ids
    assert parse_tokenize({"prompt": "ab", "add_special_tokens": False}, TOK).prompt_ids == [97, 98]
    for body, status, param in (({"model": "other", "prompt": "x"}, 404, "model"),
                                ({"prompt": "x", "messages": messages}, 400, "prompt"),
                                ({}, 400, "prompt"),
                                ({"prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens")):
        with pytest.raises(RequestError) as info:
            parse_tokenize(body, TOK, served_model="atom-kv-tiny")
        assert (info.value.status, info.value.param) == (status, param)


def test_a_prefills_first_token_text_is_what_a_stream_shows_for_it_alone():
    from atom_kv.reference.first_token import with_first_token_text

    assert with_first_token_text({"first_token_ids": [72], "transfer_id": "t"})["first_token_text"] == "H"
    assert with_first_token_text({"first_token_ids": [0xE2]})["first_token_text"] == ""  # a 3-byte character's first
    assert with_first_token_text({"transfer_id": "t"}) == {"transfer_id": "t"}
    assert with_first_token_text(None) is None


NAN, INF = float("nan"), float("inf")
#: values every sampling field refuses (issue 38, F1): before, a NaN or tiny temperature reached the
#: sampler and stopped the engine
OUT_OF_RANGE = [
    ("temperature", 1e-310), ("temperature", 0.005), ("temperature", NAN), ("temperature", INF),
    ("temperature", -INF), ("temperature", 100.5), ("temperature", -0.5),
    ("seed", MAX_SEED + 1), ("seed", -1), ("seed", NAN),
    ("max_tokens", NAN), ("max_tokens", INF), ("max_tokens", 2.0), ("n", NAN),
    ("top_p", NAN), ("top_p", 0), ("top_p", INF), ("top_k", NAN), ("min_p", NAN),
    ("presence_penalty", NAN), ("frequency_penalty", INF), ("repetition_penalty", NAN),
]


@pytest.mark.parametrize("key,value", OUT_OF_RANGE, ids=[f"{k}={v!r}" for k, v in OUT_OF_RANGE])
def test_sampling_values_out_of_range_or_not_finite_are_refused_by_name(key, value):
    with pytest.raises(RequestError) as info:
        _parse({"prompt": "x", key: value})
    assert (info.value.status, info.value.param) == (400, key)
    assert f"`{key}`" in info.value.message


def test_temperature_is_zero_or_in_its_stated_range():
    for t in (0, 0.0, -0.0, 0.01, 1, 2.5, 100):
        assert _parse({"prompt": "x", "temperature": t}).temperature == float(t)
    with pytest.raises(RequestError, match=r"`temperature` must be 0 \(greedy\) or a number in 0.01..100, got 1e-310"):
        _parse({"prompt": "x", "temperature": 1e-310})
    assert _parse({"prompt": "x", "seed": MAX_SEED}).seed == MAX_SEED


@pytest.mark.parametrize("body,param,chat", [
    ({"prompt": "a\ud800b"}, "prompt", False),
    ({"prompt": ["\udfff"]}, "prompt", False),
    ({"prompt": "x", "stop": ["ok", "\ud800"]}, "stop", False),
    ({"messages": [{"role": "user", "content": "\ud83d"}]}, "messages", True),
    ({"messages": [{"role": "\udc00", "content": "hi"}]}, "messages", True),
])
def test_text_that_is_not_valid_unicode_is_refused_by_name(body, param, chat):
    """A lone surrogate (JSON can spell one, UTF-8 cannot encode it) was a 500 from the tokenizer (F10)."""
    with pytest.raises(RequestError) as info:
        _parse(body, chat=chat)
    assert (info.value.status, info.value.param) == (400, param)
    assert "lone surrogate" in info.value.message
    with pytest.raises(RequestError) as info:
        parse_tokenize({"prompt": "\ud800"}, TOK)
    assert info.value.param == "prompt"


def test_an_error_never_echoes_a_huge_value_whole():
    with pytest.raises(RequestError) as info:
        _parse({"prompt": "x", "seed": 10**4000})
    assert len(info.value.message) < 200 and "digits" in info.value.message
    with pytest.raises(RequestError) as info:
        _parse({"prompt": "x", "stop": ["a" * 100_000, 3]})
    assert len(info.value.message) < 300
