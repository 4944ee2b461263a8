"""Fuzzing the reference engine's request parser as a real process (issue 38).

Completions, chat and ``/tokenize`` bodies with random values in every field
the engine reads (NaN, infinities, subnormals, huge and negative integers,
lone surrogates, wrong types, deep nesting), random bytes, and valid bodies
cut or spliced at random (hypothesis), against ``python -m atom_kv.reference``.
Asserted throughout: no answer is a 5xx (a request the engine cannot parse is
the client's mistake, a 400 naming it), every error answers in the OpenAI
shape, the engine keeps serving; at the end its log has no traceback and no
ERROR line. Bounded in time: a hundred-odd examples each, a few seconds."""

from __future__ import annotations

import json
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom_kv.testing.cluster import Cluster, EngineSpec

FUZZ = settings(max_examples=120, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    c = Cluster([EngineSpec("colocated", num_blocks=64, extra_args=["--num-layers", "1", "--max-model-len", "256"])],
                with_proxy=False, log_dir=str(tmp_path_factory.mktemp("fuzz-engine")))
    c.start()
    try:
        yield c
    finally:
        c.close()


def _exchange(port: int, path: str, body: bytes, headers: tuple[tuple[str, str], ...] = ()) -> tuple[int, bytes]:
    head = [f"POST {path} HTTP/1.1", "Host: fuzz", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in headers)]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall("\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + body)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    answer = b"".join(chunks)
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split(b" ")[1]), rest.partition(b"\r\n\r\n")[2]


def _check(port: int, path: str, body: bytes, headers: tuple[tuple[str, str], ...] = ()) -> None:
    status, answer = _exchange(port, path, body, headers)
    assert status < 500, (path, body[:300], status, answer[:300])
    if status >= 400:
        error = json.loads(answer)["error"]
        assert error["message"] and error["code"] == status, answer[:300]


_surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
_text = st.text(max_size=24) | st.text(st.characters() | _surrogates, max_size=6)
_numbers = (st.integers(-(2**70), 2**70) | st.sampled_from([0, 1, -1, 2**63, 2**64, 10**30, 4, 255, 259, 260])
            | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e-310, 5e-324, 0.005, 1e308]))
_json = st.recursive(st.none() | st.booleans() | _numbers | _text,
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
                     max_leaves=10)
_small = st.integers(-2, 6)
#: every field the engine reads, with the values to try in it
FIELDS = {
    "prompt": _text | st.lists(st.integers(-3, 300), max_size=6) | st.lists(_text, max_size=2) | _json,
    "messages": st.lists(st.fixed_dictionaries({"role": _text, "content": _text | _json}), max_size=3) | _json,
    "model": st.sampled_from(["atom-kv-tiny", "other"]) | _json,
    "max_tokens": _small | _numbers | _json, "max_completion_tokens": _small | _numbers,
    "temperature": _numbers | _json, "seed": _numbers | _json, "n": _small | _numbers,
    "top_p": _numbers, "top_k": _numbers, "min_p": _numbers, "presence_penalty": _numbers,
    "frequency_penalty": _numbers, "repetition_penalty": _numbers, "min_tokens": _small | _numbers,
    "logprobs": _json, "best_of": _numbers, "logit_bias": _json, "response_format": _json,
    "stop": _text | st.lists(_text, max_size=3) | _json, "stop_token_ids": st.lists(_numbers, max_size=3) | _json,
    "stream": st.booleans() | _json, "stream_options": st.fixed_dictionaries({"include_usage": _json}) | _json,
    "kv_transfer_params": _json, "data_parallel_rank": _numbers | _json, "add_special_tokens": _json,
}
_VALID = {"prompt": "fuzz me", "messages": [{"role": "user", "content": "fuzz me"}], "max_tokens": 2}
#: any subset of the fields, each with a random value
_body = st.fixed_dictionaries({}, optional=FIELDS)
#: a valid body with one or two fields off (a body with many random fields is refused for its first bad one)
_near_valid = st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=2, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys}).map(lambda off: {**_VALID, **off}))


def _encode(body: dict, nan_as_json: bool) -> bytes:
    """Python's JSON (NaN and Infinity spelt as such, lone surrogates escaped), or NaN spelt as null."""
    if not nan_as_json:
        body = json.loads(json.dumps(body), parse_constant=lambda _: None)
    return json.dumps(body).encode()


def _valid_length(body: dict) -> dict:
    """Keep generation short: a length that would be accepted and run long is cut to 4 tokens
    (out-of-range ones stay, to be refused)."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 4 < value <= 256:
            body[key] = 4
    body.setdefault("max_tokens", 2)
    return body


@FUZZ
@given(body=_body | _near_valid, path=st.sampled_from(PATHS), nan_as_json=st.booleans())
def test_random_field_values(engine, body, path, nan_as_json):
    _check(engine.ports[0], path, _encode(_valid_length(body), nan_as_json))


@FUZZ
@given(data=st.binary(max_size=400), path=st.sampled_from(PATHS))
def test_random_bytes_as_the_body(engine, data, path):
    _check(engine.ports[0], path, data)


_good = json.dumps({"prompt": "fuzz me", "max_tokens": 2, "temperature": 0.5, "seed": 3, "stop": ["zz"]}).encode()
_splices = [b"NaN", b"-Infinity", b"1e999", b"9" * 5000, b'"\\ud800"', b'"\\udfff\\ud800"', b"\xed\xa0\x80",
            b"\xff", b"[" * 3000, b"{", b"}", b",", b":", b'"', b"\\", b"\x00", b"true", b"null", b"-", b"."]


@FUZZ
@given(cut=st.integers(0, len(_good)), insert=st.sampled_from(_splices) | st.binary(max_size=8),
       drop=st.integers(0, 4), path=st.sampled_from(PATHS))
def test_valid_bodies_cut_and_spliced(engine, cut, insert, drop, path):
    _check(engine.ports[0], path, _good[:cut] + insert + _good[cut + drop:])


#: what HTTP allows in a header value (RFC 9110 field-vchar, SP and obs-text; DEL and controls are refused
#: by the HTTP parser before the engine sees the request, as test_engine_http_garbage.py shows)
_field_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=200)


@FUZZ
@given(request_id=_field_text, dp_rank=_field_text)
def test_random_request_id_and_rank_headers(engine, request_id, dp_rank):
    headers = (("X-Request-Id", request_id), ("X-data-parallel-rank", dp_rank))
    _check(engine.ports[0], "/v1/completions", _good, headers)


def test_zz_the_engine_still_serves_and_logged_no_traceback(engine):
    """Runs after the fuzzers above (same module, same engine)."""
    status, answer = _exchange(engine.ports[0], "/v1/completions", _good)
    assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] <= 2
    assert engine.engine_health(0)["status"] == "ok"
    assert engine.engine_health(0)["kv_blocks"]["free"] == 64
    engine.engines[0].stop()
    log = engine.engines[0].log_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
