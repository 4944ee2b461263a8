"""End-to-end relay behaviour: rewrites of both legs, streaming, clients."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.proxy.fake_engine import register


@pytest.fixture
async def pd(make_proxy, make_engine):
    proxy = make_proxy()
    p = await make_engine("P", tp_size=2, handshake_port=41111)
    d = await make_engine("D", tp_size=4, handshake_port=42222, engine_id="dec-0")
    await register(proxy, p, d)
    return proxy, p, d


async def test_completion_non_stream_rewrites_both_legs(pd):
    proxy, p, d = pd
    body = {"model": "fake-model", "prompt": "hello world " * 10, "max_tokens": 5, "temperature": 0.5,
            "stream_options": {"include_usage": True}, "min_tokens": 3, "custom_field": {"x": [1, 2]}}
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + "/v1/completions", json=body, headers={"x-request-id": "rid-1"}) as r:
            assert r.status == 200
            assert r.headers["X-Request-Id"] == "rid-1"
            assert r.headers["Content-Type"].startswith("application/json")
            out = await r.json()
    assert out["choices"][0]["text"] == " t0 t1 t2 t3 t4"

    (pre,) = p.received
    assert pre.headers["X-Request-Id"] == "rid-1"
    assert pre.body["stream"] is False and "stream_options" not in pre.body
    assert pre.body["max_tokens"] == 1 and pre.body["min_tokens"] == 1
    assert pre.body["custom_field"] == {"x": [1, 2]} and pre.body["temperature"] == 0.5
    kv = pre.kv
    assert kv["do_remote_decode"] is True and kv["do_remote_prefill"] is False
    assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == d.port
    assert kv["remote_handshake_port"] == 42222 and kv["remote_tp_size"] == 4
    assert kv["remote_dp_size"] == 1 and kv["remote_dp_rank"] == 0

    (dec,) = d.received
    assert dec.headers["X-Request-Id"] == "rid-1"
    assert dec.body["max_tokens"] == 5 and dec.body["min_tokens"] == 3
    assert dec.body["stream_options"] == {"include_usage": True} and dec.body["custom_field"] == {"x": [1, 2]}
    dkv = dec.kv
    assert dkv["do_remote_prefill"] is True and dkv["do_remote_decode"] is False
    assert dkv["remote_engine_id"] == p.engine_id and dkv["remote_port"] == p.port
    assert dkv["remote_block_ids"] == [0, 1, 2] and dkv["transfer_id"].startswith(p.engine_id)
    assert dkv["remote_handshake_port"] == 41111 and dkv["tp_size"] == 2
    assert dkv["remote_tp_size"] == 2 and dkv["remote_dp_rank"] == 0


async def test_request_without_max_tokens_and_generated_request_id(pd):
    proxy, p, d = pd
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200
            rid = r.headers["X-Request-Id"]
            await r.read()
    assert len(rid) == 32 and int(rid, 16) >= 0
    assert p.received[0].request_id == rid and d.received[0].request_id == rid
    assert p.received[0].body["max_tokens"] == 1
    assert "max_tokens" not in d.received[0].body
    assert "max_completion_tokens" not in p.received[0].body


async def test_chat_max_completion_tokens_clamped(pd):
    proxy, p, d = pd
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7}
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            out = await r.json()
    assert out["object"] == "chat.completion"
    assert p.received[0].path == "/v1/chat/completions"
    assert p.received[0].body["max_completion_tokens"] == 1 and p.received[0].body["max_tokens"] == 1
    assert d.received[0].body["max_completion_tokens"] == 7


async def test_stream_passthrough_raw(pd):
    proxy, p, d = pd
    body = {"prompt": "abc", "max_tokens": 6, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = await r.read()
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert len(events) == 7
    assert p.received[0].body["stream"] is False
    assert d.received[0].body["stream"] is True


async def test_stream_usage_prompt_tokens_from_prefill(make_proxy, make_engine):
    proxy = make_proxy()
    p = await make_engine("P")
    d = await make_engine("D", prompt_tokens_override=0)
    await register(proxy, p, d)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    prompt = "z" * 400
    stream = await client.completions.create(model="m", prompt=prompt, max_tokens=3, stream=True,
                                             stream_options={"include_usage": True})
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.prompt_tokens == 100 and usage.total_tokens == 103
    full = await client.completions.create(model="m", prompt=prompt, max_tokens=3)
    assert full.usage.prompt_tokens == 100 and full.usage.total_tokens == 103
    await client.close()


async def test_openai_client_all_modes(pd):
    proxy, p, d = pd
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    c = await client.completions.create(model="fake-model", prompt="hi", max_tokens=4)
    assert c.choices[0].text == " t0 t1 t2 t3"
    text = ""
    async for chunk in await client.completions.create(model="fake-model", prompt="hi", max_tokens=4, stream=True):
        text += chunk.choices[0].text
    assert text == " t0 t1 t2 t3"
    chat = await client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].message.content == " t0 t1 t2"
    content = ""
    async for chunk in await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True):
        content += chunk.choices[0].delta.content or ""
    assert content == " t0 t1 t2"
    models = await client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    await client.close()
    assert len(p.received) == 4 and len(d.received) == 4


def test_usage_rewriter_handles_events_split_across_chunks():
    from atom_kv.proxy.sse import UsageRewriter

    stream = (b'data: {"choices":[{"text":"a"}]}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":0,"completion_tokens":2,"total_tokens":2}}\n\n'
              b"data: [DONE]\n\n")
    for cut in range(1, len(stream)):
        rw = UsageRewriter(prompt_tokens=7)
        out = rw.feed(stream[:cut]) + rw.feed(stream[cut:]) + rw.flush()
        assert out == stream.replace(b'"prompt_tokens":0', b'"prompt_tokens":7').replace(
            b'"total_tokens":2', b'"total_tokens":9'), cut


async def test_streams_complete_cleanly_over_pooled_connections(pd):
    proxy, p, d = pd
    async with aiohttp.ClientSession() as s:
        for stream in (True, True, False, True, False):
            async with s.post(proxy.url + "/v1/completions",
                              json={"prompt": "x", "max_tokens": 4, "stream": stream}) as r:
                assert r.status == 200
                await r.read()
    # one pooled upstream session: sequential requests reuse one keep-alive connection per engine
    assert len({x.peer for x in p.received}) == 1 and len({x.peer for x in d.received}) == 1
    assert d.cancelled == [] and p.cancelled == []
    reg = proxy.metrics.registry
    assert reg.get_sample_value("atom_kv_proxy_client_disconnects_total") == 0
    assert reg.get_sample_value("atom_kv_proxy_requests_total", {"endpoint": "/v1/completions", "status": "200"}) == 5
    assert all(i["inflight"] == 0 for i in proxy.state.registry.snapshot())


def test_request_id_validation():
    from atom_kv.proxy.fastpath import valid_request_id

    assert valid_request_id("abc-123") == "abc-123"
    for bad in (None, "", "x" * 200, "bad\nid", "caf\u00e9"):
        generated = valid_request_id(bad)
        assert generated != bad and len(generated) == 32
