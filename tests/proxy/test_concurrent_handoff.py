"""Concurrent dispatch with fake engines: the decode's stream goes to the client as soon as its head
arrives, without waiting for the prefill's own answer (the decode engine answers only once it
learned the blocks, so the prefill lent them)."""

from __future__ import annotations

import asyncio

from tests.proxy.fake_engine import post

RENDEZVOUS = ("rendezvous",)


async def test_a_decode_stream_goes_out_while_the_prefill_has_not_answered(pd_pair):
    proxy, p, d = await pd_pair(proxy=dict(concurrent_dispatch=True), p=dict(kv_features=RENDEZVOUS),
                                d=dict(kv_features=RENDEZVOUS + ("first_token",)))
    p.hang = True  # its answer never comes
    status, ctype, body = await asyncio.wait_for(
        post(proxy.url, {"model": "fake-model", "prompt": "hello", "max_tokens": 4, "stream": True}), 5.0)
    assert status == 200 and ctype.startswith("text/event-stream") and body.endswith(b"data: [DONE]\n\n"), body
    kv = d.received[-1].body["kv_transfer_params"]
    assert kv["remote_blocks_pending"] is True and kv["first_token_pending"] is True, kv
    assert kv["transfer_id"] == p.received[-1].body["kv_transfer_params"]["transfer_id"]
    assert p.completed == []  # the prefill leg is still open: the client did not wait for it
    assert proxy.count("atom_kv_proxy_concurrent_dispatches_total") == 1
    assert proxy.count("atom_kv_proxy_abandoned_prefills_total", reason="client_gone") == 0


async def test_a_non_streamed_answer_still_waits_for_the_prefill(pd_pair):
    proxy, p, d = await pd_pair(proxy=dict(concurrent_dispatch=True), p=dict(kv_features=RENDEZVOUS),
                                d=dict(kv_features=RENDEZVOUS))
    status, _, body = await post(proxy.url, {"model": "fake-model", "prompt": "hello", "max_tokens": 4})
    assert status == 200, body
    kv = d.received[-1].body["kv_transfer_params"]
    assert kv["remote_blocks_pending"] is True and "first_token_pending" not in kv, kv  # D does not continue
    assert len(p.completed) == 1


async def test_legs_go_in_turn_while_the_prefill_rank_has_a_queue(pd_pair):
    proxy, p, d = await pd_pair(proxy=dict(concurrent_dispatch=True, concurrent_max_queued_tokens=0),
                                p=dict(kv_features=RENDEZVOUS, delay_s=0.5), d=dict(kv_features=RENDEZVOUS))
    body = {"model": "fake-model", "prompt": "hello there", "max_tokens": 4}
    first = asyncio.ensure_future(post(proxy.url, body))
    assert await p.wait_until(lambda: len(p.received) == 1)  # the first prefill is computing ...
    second = await post(proxy.url, body)                      # ... so the second one queues behind it
    assert (await first)[0] == 200 and second[0] == 200
    pending = [r.body["kv_transfer_params"].get("remote_blocks_pending") for r in d.received]
    assert sorted(pending, key=bool) == [None, True], pending  # one concurrent, one in turn
    assert proxy.count("atom_kv_proxy_concurrent_dispatches_total") == 1
    assert proxy.count("atom_kv_proxy_concurrent_skipped_total") == 1
