"""Error replies in vLLM's shape with real statuses, and everything refused before a prefill is spent."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from atom_kv.openai_errors import ERROR_TYPES, error_body, error_type
from tests.proxy.fake_engine import post, register


def _is_vllm_error(payload: dict, status: int) -> bool:
    err = payload.get("error")
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and err["code"] == status and isinstance(err["message"], str) and bool(err["message"])
            and err["type"] == error_type(status))


def test_one_error_table():
    assert error_body(413, "too big") == {"error": {"message": "too big", "type": "RequestTooLargeError",
                                                    "param": None, "code": 413}}
    assert error_type(418) == "BadRequestError" and error_type(599) == "InternalServerError"
    assert all(isinstance(t, str) and t.endswith("Error") for t in ERROR_TYPES.values())


async def test_503_when_a_role_is_missing(make_proxy, make_engine):
    proxy = await make_proxy()
    status, ctype, raw = await post(proxy.url, {"prompt": "x"})
    assert status == 503 and ctype.startswith("application/json")
    assert _is_vllm_error(json.loads(raw), 503) and b"decode" in raw
    d = await make_engine("D")
    await register(proxy, d)
    status, _, raw = await post(proxy.url, {"prompt": "x"}, path="/v1/chat/completions")
    assert status == 503 and b"prefill" in raw
    assert d.received == []


async def test_400_on_bad_client_json_bad_utf8_and_deep_nesting(make_proxy):
    proxy = await make_proxy()
    bodies = [b"{not json", b"[1, 2]", b"", b'{"prompt": "\xff\xfe"}', b"\xff\xfe",
              b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000]
    for data in bodies:
        status, _, raw = await post(proxy.url, data=data)
        assert status == 400 and _is_vllm_error(json.loads(raw), 400), (data[:20], raw)
    assert b"UTF-8" in (await post(proxy.url, data=b'{"prompt": "\xff"}'))[2]
    assert b"nested too deeply" in (await post(proxy.url, data=b"[" * 100_000 + b"]" * 100_000))[2]


async def test_max_tokens_is_checked_before_any_prefill(pd_pair):
    proxy, p, d = await pd_pair()
    cases = [("max_tokens", -1), ("max_tokens", 0), ("max_tokens", "12"), ("max_tokens", 1.5), ("max_tokens", True),
             ("max_completion_tokens", -3), ("max_completion_tokens", [1])]
    for key, value in cases:
        status, _, raw = await post(proxy.url, {"prompt": "x", key: value})
        err = json.loads(raw)
        assert status == 400 and _is_vllm_error(err, 400) and err["error"]["param"] == key, (key, value, raw)
        assert key in err["error"]["message"]
    assert p.received == [] and d.received == []  # no prefill was spent on any of them
    assert (await post(proxy.url, {"prompt": "x", "max_tokens": None}))[0] == 200


async def test_token_id_prompt_over_the_context_is_refused_exactly(pd_pair):
    proxy, p, d = await pd_pair(p=dict(max_model_len=100), d=dict(max_model_len=120))
    status, _, raw = await post(proxy.url, {"prompt": list(range(90)), "max_tokens": 11})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "max_tokens"
    assert err["message"].startswith("This model's maximum context length is 100 tokens. However, you requested "
                                     "101 tokens (90 in the messages, 11 in the completion).")
    assert (await post(proxy.url, {"prompt": list(range(90)), "max_tokens": 10}))[0] == 200
    assert len(p.received) == 1 and p.tokenize_calls == 0  # exact: no tokenizer needed


async def test_long_text_prompt_is_tokenized_by_the_engine_before_the_prefill(pd_pair):
    proxy, p, d = await pd_pair(p=dict(max_model_len=1000), d=dict(max_model_len=1000))
    # short prompts are not worth a /tokenize round trip
    assert (await post(proxy.url, {"prompt": "a" * 400, "max_tokens": 100}))[0] == 200
    assert p.tokenize_calls == d.tokenize_calls == 0
    # 10000 chars: the fake engine counts 2500 tokens > 1000
    status, _, raw = await post(proxy.url, {"prompt": "a" * 10000, "max_tokens": 500})
    assert status == 400 and "maximum context length is 1000 tokens" in json.loads(raw)["error"]["message"]
    assert p.tokenize_calls == 1 and len(p.received) == 1  # refused before its prefill
    # plausible but fits: tokenized, then served
    assert (await post(proxy.url, {"prompt": "a" * 2000, "max_tokens": 400}))[0] == 200
    assert p.tokenize_calls == 2 and len(p.received) == 2
    # chat messages are tokenized the same way
    status, _, raw = await post(proxy.url, {"messages": [{"role": "user", "content": "b" * 8000}]},
                                path="/v1/chat/completions")
    assert status == 400 and json.loads(raw)["error"]["param"] == "messages"


async def test_engine_without_tokenize_means_no_check(pd_pair):
    proxy, p, d = await pd_pair(p=dict(max_model_len=1000), d=dict(max_model_len=1000))
    p.tokenize_enabled = d.tokenize_enabled = False
    for _ in range(2):
        assert (await post(proxy.url, {"prompt": "a" * 10000, "max_tokens": 5}))[0] == 200
    assert p.tokenize_calls == 0 and len(p.received) == 2
    assert proxy.registry.live("P")[0].tokenize is False  # asked once, remembered


async def test_upstream_4xx_passed_through(pd_pair):
    proxy, p, d = await pd_pair()
    p.fail_status = 422
    status, _, raw = await post(proxy.url, {"prompt": "x"})
    assert status == 422 and json.loads(raw)["error"]["message"] == "fake engine failure 422"
    assert len(p.received) == 1 and d.received == []  # a client error is not retried
    p.fail_status = None
    d.fail_status = 400
    status, _, raw = await post(proxy.url, {"prompt": "x", "stream": True})
    assert status == 400 and json.loads(raw)["error"]["message"] == "fake engine failure 400"


async def test_502_when_upstream_unreachable(pd_pair):
    proxy, p, d = await pd_pair(proxy=dict(max_retries=1))
    await p.close()  # registered, but nobody listens any more
    status, _, raw = await post(proxy.url, {"prompt": "x"})
    assert status == 502 and _is_vllm_error(json.loads(raw), 502)
    message = json.loads(raw)["error"]["message"]
    assert message.startswith("the prefill engine could not be reached (request ") and p.base_url not in message
    prefill = [i for i in proxy.registry.snapshot() if i["role"] == "P"][0]
    assert p.base_url in prefill["last_error"]["message"]  # the operator's account
    assert proxy.count("atom_kv_proxy_retries_total") == 1
    assert d.received == []


async def test_504_on_prefill_timeout(pd_pair):
    proxy, p, d = await pd_pair(proxy=dict(prefill_timeout=0.5))
    p.hang = True
    status, _, raw = await post(proxy.url, {"prompt": "x"})
    assert status == 504 and _is_vllm_error(json.loads(raw), 504)
    assert await p.wait_until(lambda: len(p.cancelled) == 1)  # the hung leg was abandoned
    assert d.received == []


async def test_504_on_decode_timeout(pd_pair):
    proxy, p, d = await pd_pair(proxy=dict(decode_timeout=0.5))
    d.hang = True
    status, _, raw = await post(proxy.url, {"prompt": "x"})
    assert status == 504 and _is_vllm_error(json.loads(raw), 504)


async def test_mid_stream_failure_becomes_error_event(pd_pair):
    proxy, p, d = await pd_pair()
    d.drop_after_chunks = 3
    status, ctype, raw = await post(proxy.url, {"prompt": "x", "max_tokens": 10, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = [e for e in raw.decode().split("\n\n") if e]
    assert len(events) == 5, events
    assert all(e.startswith("data: {") for e in events[:3]) and '"error"' not in "".join(events[:3])
    err = json.loads(events[3][len("data: "):])
    assert _is_vllm_error(err, 502) and "interrupted" in err["error"]["message"]
    assert events[4] == "data: [DONE]"


async def test_unknown_route_is_json_404(make_proxy):
    proxy = await make_proxy()
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/v2/nothing") as r:
            assert r.status == 404 and _is_vllm_error(await r.json(), 404)


async def test_never_an_empty_200(pd_pair):
    proxy, p, d = await pd_pair()
    d.empty_response = True
    status, _, raw = await post(proxy.url, {"prompt": "x"})
    assert status == 502 and _is_vllm_error(json.loads(raw), 502) and b"empty" in raw
    status, _, raw = await post(proxy.url, {"prompt": "x", "stream": True})
    events = [e for e in raw.decode().split("\n\n") if e]
    assert status == 200 and len(events) == 2 and events[1] == "data: [DONE]"
    assert _is_vllm_error(json.loads(events[0][len("data: "):]), 502)


async def test_wrong_method_and_oversized_body_have_one_status(make_proxy):
    proxy = await make_proxy(max_request_bytes=1024)
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/v1/completions", headers={"X-Request-Id": "r-405"}) as r:
            assert r.status == 405 and _is_vllm_error(await r.json(), 405)
            assert r.headers["X-Request-Id"] == "r-405"
        for path in ("/v1/chat/completions", "/v1/completions"):
            async with s.post(proxy.url + path, json={"prompt": "x" * 2048}) as r:
                assert r.status == 413 and _is_vllm_error(await r.json(), 413), path


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def test_slow_request_head_is_cut_off(make_proxy):
    proxy = await make_proxy(header_timeout=0.5)
    reader, writer = await _open(proxy.settings.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")  # ... and never the rest of the head
    await writer.drain()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await asyncio.wait_for(reader.read(), 5.0) == b""  # closed by the proxy
    assert loop.time() - t0 < 3.0
    writer.close()


async def test_slow_request_body_gets_408(make_proxy):
    proxy = await make_proxy(body_timeout=0.5)
    reader, writer = await _open(proxy.settings.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\":")  # 10 of 100 bytes, then silence
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 5.0)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert _is_vllm_error(json.loads(body), 408)


async def test_decode_silence_mid_stream_ends_with_a_504_event(pd_pair):
    """The decode engine sent its headers and then nothing for longer than --decode-timeout."""
    proxy, p, d = await pd_pair(proxy=dict(decode_timeout=0.3), d=dict(token_delay_s=2.0))
    status, ctype, raw = await post(proxy.url, {"prompt": "x", "max_tokens": 3, "stream": True})
    events = [e for e in raw.decode().split("\n\n") if e]
    assert status == 200 and ctype.startswith("text/event-stream") and events[-1] == "data: [DONE]"
    err = json.loads(events[-2][len("data: "):])
    assert _is_vllm_error(err, 504) and "timed out" in err["error"]["message"]
    assert proxy.count("atom_kv_proxy_upstream_failures_total", role="decode", kind="timeout") == 1
    assert await d.wait_until(lambda: len(d.cancelled) == 1, 3.0)  # the silent leg was dropped
