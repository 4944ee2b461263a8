"""A pair whose decode-to-prefill KV path failed (the decode engine answers ``X-KV-Transfer-Failure: prefill``)
is planned again only onto another pair: a different prefill or decode instance. With one prefill and one
decode engine the client gets one 502 naming that hop after one prefill, not three prefills that each
fail the same way.

The fake decode engines fail the load of the prefills the test names, as a decode engine that cannot reach
a prefill host's handshake port answers (502 with the header; the reference engine does it for real in
``tests/e2e/test_kv_path_failures.py``)."""

from __future__ import annotations

import json

from aiohttp import web

from atom_kv.openai_errors import KV_TRANSFER_FAILURE_HEADER
from tests.proxy.fake_engine import FakeEngine, post, register

_RID = "kv-path-1"


def _cannot_load_from(decode: FakeEngine, *prefills: FakeEngine) -> None:
    """``decode`` answers every load from one of ``prefills`` (or from any prefill, without them) as failed."""
    original = decode._handle
    failing = {p.engine_id for p in prefills}

    async def handle(request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        if not failing or body["kv_transfer_params"]["remote_engine_id"] in failing:
            decode.received.append(body)
            return web.json_response({"error": {"message": "KV transfer failed: remote KV load failed: cannot "
                                                           "connect to 127.0.0.1:1 within 5 s (connect_timeout_s)",
                                                "type": "BadGatewayError", "param": None, "code": 502}},
                                     status=502, headers={KV_TRANSFER_FAILURE_HEADER: "prefill"})
        return await original(request, chat)

    decode._handle = handle  # type: ignore[method-assign]


async def test_one_pair_whose_kv_path_fails_is_answered_once_with_the_hop_named(make_proxy, make_engine):
    proxy = await make_proxy(max_retries=2)
    p, d = await make_engine("P"), await make_engine("D")
    await register(proxy, p, d)
    _cannot_load_from(d)
    status, _, raw = await post(proxy.url, {"prompt": "x", "max_tokens": 2}, headers={"X-Request-Id": _RID})
    assert status == 502, raw
    assert len(p.received) == 1 and len(d.received) == 1  # one prefill: no second one to fail the same way
    assert json.loads(raw)["error"]["message"] == (
        f"decode-to-prefill KV path failed: the prefill engine could not hand its KV cache to the decode engine "
        f"(request {_RID}; details in the proxy's log)")
    assert proxy.count("atom_kv_proxy_retries_total") == 0
    assert proxy.count("atom_kv_proxy_abandoned_prefills_total", reason="kv_transfer_failed") == 1


async def test_another_prefill_instance_is_tried_after_a_kv_path_failure(make_proxy, make_engine):
    proxy = await make_proxy(max_retries=2, circuit_failures=100)
    bad_p, good_p, d = await make_engine("P"), await make_engine("P"), await make_engine("D")
    await register(proxy, bad_p, good_p, d)
    _cannot_load_from(d, bad_p)
    for _ in range(2):  # round robin: one of the two goes to the prefill the decode cannot load from first
        status, _, raw = await post(proxy.url, {"prompt": "x", "max_tokens": 2})
        assert status == 200, raw
    met = len(bad_p.received)  # each one retried once, on the other prefill instance
    assert 1 <= met <= 2 and len(good_p.received) == 2
    assert proxy.count("atom_kv_proxy_retries_total") == met


async def test_another_decode_instance_is_tried_after_a_kv_path_failure(make_proxy, make_engine):
    proxy = await make_proxy(max_retries=2, circuit_failures=100)
    p, cut_off, d = await make_engine("P"), await make_engine("D"), await make_engine("D")
    await register(proxy, p, cut_off, d)
    _cannot_load_from(cut_off)  # this decode host reaches no prefill (its own firewall)
    for _ in range(2):
        status, _, raw = await post(proxy.url, {"prompt": "x", "max_tokens": 2})
        assert status == 200, raw
    # each request that met the cut-off decode engine went on to the other one, with the same prefill instance
    # (the only one), and never back to the pair that failed
    met = len(cut_off.received)
    assert 1 <= met <= 2 and len(d.received) == 2 and len(p.received) == 2 + met
    assert proxy.count("atom_kv_proxy_retries_total") == met
