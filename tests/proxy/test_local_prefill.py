"""Local prefill through the relay (fake engines, the proxy's KV index fed BlockStored events directly):
a request whose chosen decode rank caches all but at most --local-prefill-max-tokens of the prompt goes to
the decode engine alone, without kv_transfer_params, and is counted; one it lacks more of takes both legs."""

from __future__ import annotations

from atom_kv.proxy.kv_events.wire import BlockStored
from atom_kv.testing.fake_engine import FakeEngine
from tests.proxy.fake_engine import post, register

BS = 16
PROMPT = "a prompt the decode engine computed before, eighty bytes of it, four to a token."[:80]


def _held(proxy, engine: FakeEngine, text: str, blocks: int) -> None:
    ids = FakeEngine._prompt_token_ids({"prompt": text}, len(text) // 4)
    proxy.state.kv_events.index.apply(("D", engine.base_url), 0, [BlockStored(
        block_hashes=list(range(1, blocks + 1)), parent_block_hash=None, token_ids=ids[:blocks * BS],
        block_size=BS)])


async def test_a_prompt_the_decode_nearly_holds_skips_the_prefill_leg(make_proxy, make_engine):
    proxy = await make_proxy(policy="kv_aware", local_prefill_max_tokens=8)
    ps = [await make_engine("P") for _ in range(2)]
    ds = [await make_engine("D") for _ in range(2)]
    await register(proxy, *ps, *ds)
    _held(proxy, ds[1], PROMPT, 1)  # 16 of its 20 tokens: 4 left, under 8
    status, *_ = await post(proxy.url, {"prompt": PROMPT, "max_tokens": 2,
                                       "kv_transfer_params": {"do_remote_prefill": True, "remote_port": 1}})
    assert status == 200
    assert not any(p.received for p in ps) and not ds[0].received
    (got,) = ds[1].received
    assert "kv_transfer_params" not in got.body  # a plain request (the client's params dropped)
    assert proxy.metrics.local_prefills._value.get() == 1


async def test_a_prompt_the_decode_lacks_more_of_takes_both_legs(make_proxy, make_engine):
    proxy = await make_proxy(policy="kv_aware", local_prefill_max_tokens=3)
    ps = [await make_engine("P")]
    ds = [await make_engine("D")]
    await register(proxy, *ps, *ds)
    _held(proxy, ds[0], PROMPT, 1)  # 4 tokens left, over 3
    status, *_ = await post(proxy.url, {"prompt": PROMPT, "max_tokens": 2})
    assert status == 200 and len(ps[0].received) == 1
    (got,) = ds[0].received
    assert got.body["kv_transfer_params"]["do_remote_prefill"] is True
    assert proxy.metrics.local_prefills._value.get() == 0


async def test_local_prefill_is_off_by_default(make_proxy, make_engine):
    proxy = await make_proxy(policy="kv_aware")
    ps, ds = [await make_engine("P")], [await make_engine("D")]
    await register(proxy, *ps, *ds)
    _held(proxy, ds[0], PROMPT, 1)
    assert (await post(proxy.url, {"prompt": PROMPT[:40], "max_tokens": 2}))[0] == 200  # 10 tokens, 0 uncached
    assert len(ps[0].received) == 1 and proxy.metrics.local_prefills._value.get() == 0
