"""End-to-end relay behaviour: rewrites of both legs, streaming, clients."""

from __future__ import annotations

import time

import aiohttp
import openai
import pytest

from tests.proxy.fake_engine import post


@pytest.fixture
async def pd(pd_pair):
    return await pd_pair(p=dict(tp_size=2, handshake_port=41111), d=dict(tp_size=4, handshake_port=42222,
                                                                       engine_id="dec-0"))


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
    assert dkv["remote_block_ids"] == [0, 1, 2]
    assert dkv["remote_handshake_port"] == 41111 and dkv["tp_size"] == 2
    assert dkv["remote_tp_size"] == 2 and dkv["remote_dp_rank"] == 0


async def test_request_without_max_tokens_and_generated_request_id(pd):
    proxy, p, d = pd
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200
            rid = r.headers["X-Request-Id"]
            await r.read()
    assert len(rid) == 32 and set(rid) <= set("0123456789abcdef")  # a generated uuid4 hex
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


async def test_stream_usage_prompt_tokens_from_prefill(pd_pair):
    proxy, p, d = await pd_pair(d=dict(prompt_tokens_override=0))
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


def test_event_framer_handles_events_split_across_chunks():
    from atom_kv.proxy.http.sse import EventFramer

    events = [b'data: {"choices":[{"text":"a"}]}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":0,"completion_tokens":2,"total_tokens":2}}\n\n',
              b"data: [DONE]\n\n"]
    stream = b"".join(events)
    expected = [e.replace(b'"prompt_tokens":0', b'"prompt_tokens":7').replace(b'"total_tokens":2', b'"total_tokens":9')
                for e in events]
    for cut in range(1, len(stream)):
        for a, b in ((cut, len(stream)), (cut // 2, cut)):
            framer = EventFramer(prompt_tokens=7)
            out = framer.feed(stream[:a]) + framer.feed(stream[a:b]) + framer.feed(stream[b:])
            assert out == expected and framer.flush() == b"", (a, b)
    # grouped into writes: one per event up to split_max, else one for all
    for split_max in (0, 2, 3):
        for cut in range(1, len(stream)):
            framer = EventFramer(prompt_tokens=7 if split_max == 2 else None)
            writes = framer.feed_writes(stream[:cut], split_max) + framer.feed_writes(stream[cut:], split_max)
            want = expected if split_max == 2 else events
            assert b"".join(w for w, _ in writes) == b"".join(want) and writes[-1][1], (split_max, cut)
            assert [ends for _, ends in writes].count(True) == 1
    assert [w for w, _ in EventFramer().feed_writes(stream, 3)] == events  # one write per event
    assert EventFramer().feed_writes(stream, 2) == [(stream, True)]  # a backlog: one write
    # CRLF framing and an unterminated tail
    framer = EventFramer()
    assert framer.feed(b"data: 1\r\n\r\ndata: 2\n\ndata: 3") == [b"data: 1\r\n\r\n", b"data: 2\n\n"]
    assert framer.flush() == b"data: 3"


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
    from atom_kv.proxy.relay.fastpath import valid_request_id

    assert valid_request_id("abc-123") == "abc-123"
    for bad in (None, "", "x" * 200, "bad\nid", "caf\u00e9"):
        generated = valid_request_id(bad)
        assert generated != bad and len(generated) == 32


async def test_one_transfer_id_for_both_legs(pd):
    proxy, p, d = pd
    for stream in (False, True, False):
        status, _, _ = await post(proxy.url, {"prompt": "abc", "max_tokens": 2, "stream": stream})
        assert status == 200
    minted = [x.kv["transfer_id"] for x in p.received]
    # the proxy names the transfer before the prefill answers: a fresh, sane token per request
    assert len(set(minted)) == 3 and all(len(t) == 32 and t.isalnum() for t in minted)
    assert [x.kv["transfer_id"] for x in d.received] == minted


async def test_decode_leg_carries_the_producers_id_when_it_did_not_adopt_ours(pd):
    proxy, p, d = pd
    p.adopt_transfer_id = False  # e.g. a producer that mints its own ids
    assert (await post(proxy.url, {"prompt": "abc", "max_tokens": 2}))[0] == 200
    ours = p.received[0].kv["transfer_id"]
    theirs = d.received[0].kv["transfer_id"]
    assert theirs.startswith(p.engine_id) and theirs != ours


async def test_moriio_registered_pair_gets_every_key_vllms_toy_proxy_sets(make_proxy, make_engine):
    from tests.proxy.fake_engine import register

    proxy = await make_proxy()
    p = await make_engine("P", handshake_port=7001, tp_size=2)
    d = await make_engine("D", handshake_port=7002, tp_size=4)
    await register(proxy, p, d, fmt="moriio")
    assert (await post(proxy.url, {"prompt": "x", "max_tokens": 3}))[0] == 200
    pre, dec = p.received[0].kv, d.received[0].kv
    assert pre["transfer_id"] == dec["transfer_id"]
    assert {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": "127.0.0.1", "remote_port": d.port,
            "remote_handshake_port": 7002, "remote_notify_port": 41000, "remote_tp_size": 4,
            "remote_dp_size": 1, "remote_dp_rank": 0}.items() <= pre.items()
    assert {"do_remote_decode": False, "do_remote_prefill": True, "remote_host": "127.0.0.1",
            "remote_port": p.port, "remote_handshake_port": 7001, "remote_notify_port": 41000,
            "remote_tp_size": 2, "remote_dp_size": 1, "remote_dp_rank": 0}.items() <= dec.items()


async def _http_chunks(url: str, body: dict) -> list[bytes]:
    """The response body as the HTTP chunks the proxy wrote (one ASGI send each)."""
    chunks: list[bytes] = []
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            buf = b""
            async for data, end_of_chunk in r.content.iter_chunks():
                buf += data
                if end_of_chunk:
                    chunks.append(buf)
                    buf = b""
    return [c for c in chunks if c]


async def test_sse_events_are_forwarded_one_per_write(pd_pair):
    """The decode engine writes 3 events at a time; the client must still get each event in its
    own HTTP chunk (one write per event), not the proxy's read sizes."""
    proxy, p, d = await pd_pair(proxy=dict(sse_split_max=8), d=dict(token_delay_s=0.02))
    d.events_per_write = 3
    events = await _http_chunks(proxy.url, {"prompt": "x", "max_tokens": 9, "stream": True,
                                            "stream_options": {"include_usage": True}})
    assert len(events) == 9 + 2  # 9 tokens, the usage event, [DONE]
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") and e.count(b"\n\n") == 1 for e in events), events
    assert events[-1] == b"data: [DONE]\n\n" and b'"usage"' in events[-2]


async def test_a_backlog_of_events_goes_out_in_one_write(pd_pair):
    """Past --sse-split-max events in one read (the proxy is behind), they are written together."""
    proxy, p, d = await pd_pair(proxy=dict(sse_split_max=0), d=dict(token_delay_s=0.02))
    d.events_per_write = 3
    chunks = await _http_chunks(proxy.url, {"prompt": "x", "max_tokens": 9, "stream": True})
    assert b"".join(chunks).count(b"\n\n") == 10
    assert any(c.count(b"\n\n") == 3 for c in chunks)


async def test_events_reach_the_client_as_they_arrive(pd):
    """Each event is sent as soon as the decode engine sends it (nothing waits for the next one)."""
    proxy, p, d = pd
    d.token_delay_s = 0.15
    arrivals = []
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True}) as r:
            async for data, end_of_chunk in r.content.iter_chunks():
                if data:
                    arrivals.append(time.monotonic())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:4])]
    assert len(arrivals) >= 5 and all(g > 0.05 for g in gaps), gaps


async def test_the_proxy_owns_kv_transfer_params_on_both_legs(pd):
    """Today's reproduction: a client's remote_handshake_port, remote_dp_rank and remote_tp_size
    reached the decode leg, pointing the decode engine's handshake at a port of its choosing."""
    proxy, p, d = pd
    client_kv = {"remote_handshake_port": 22, "remote_dp_rank": 7, "remote_tp_size": 99, "remote_host": "10.6.6.6",
                 "remote_notify_port": 23, "do_remote_prefill": True, "planted": "x"}
    status, _, _ = await post(proxy.url, {"prompt": "hi", "max_tokens": 2, "kv_transfer_params": client_kv})
    assert status == 200
    (prefill_leg,) = [r.body["kv_transfer_params"] for r in p.received]
    (decode_leg,) = [r.body["kv_transfer_params"] for r in d.received]
    for kv in (prefill_leg, decode_leg):
        assert "planted" not in kv and "remote_notify_port" not in kv
        assert 7 not in (kv.get("remote_dp_rank"), kv.get("dp_rank")) and kv["remote_host"] == "127.0.0.1"
    assert prefill_leg["do_remote_decode"] is True and prefill_leg["do_remote_prefill"] is False
    assert prefill_leg["remote_handshake_port"] == 42222 and prefill_leg["remote_tp_size"] == 4
    assert decode_leg["remote_handshake_port"] == 41111  # the prefill's, from its answer and the registry
    assert decode_leg["remote_tp_size"] == 2 and decode_leg["remote_dp_rank"] == 0
