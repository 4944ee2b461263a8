"""A leg's charge on its instance is given back exactly once: every kind of request, through a real proxy and
fake engines on real sockets, leaves every instance's load at exactly 0; a second release, or a counter already at
0, is counted as an underflow (and logged), never clamped into a skewed load."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import msgspec
import pytest

from atom_kv.proxy.fleet.breaker import CircuitBreaker
from atom_kv.proxy.fleet.registry import Instance, Registration
from atom_kv.proxy.observability.metrics import ProxyMetrics
from atom_kv.proxy.routing.pick import ChargeState, LoadLedger
from tests.proxy.fake_engine import post

N = 8  # requests of each kind, all at once
RENDEZVOUS = ("rendezvous",)
FIRST_TOKEN = ("first_token",)


def _instance(dp: int = 2) -> Instance:
    return Instance(Registration(role="D", base_url="http://10.0.0.1:8000", host="10.0.0.1", http_port=8000,
                                 handshake_port=6000, dp_size=dp, tp_size=1), breaker=CircuitBreaker(3, 1.0))


def _underflows(metrics: ProxyMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("atom_kv_proxy_charge_underflows_total",
                                             {"role": "decode", "reason": reason}) or 0.0


def _idle(inst: Instance) -> bool:
    return inst.inflight == 0 and not any(inst.outstanding_tokens) and not any(inst.outstanding_requests)


# ---------------------------------------------------------------------- the charge itself
def test_a_second_release_is_counted_and_gives_nothing_back(caplog):
    metrics = ProxyMetrics()
    ledger = LoadLedger(metrics)
    inst = _instance()
    one, other = ledger.take(inst, 0, 100), ledger.take(inst, 0, 50)
    assert (inst.inflight, inst.outstanding_tokens, inst.outstanding_requests) == (2, [150, 0], [2, 0])
    one.release()
    with caplog.at_level(logging.WARNING, logger="atom_kv.proxy.routing.pick"):
        one.release()  # a bug: before, a flag hid it (and Instance.credit clamped any underflow to 0)
    assert (inst.inflight, inst.outstanding_tokens, inst.outstanding_requests) == (1, [50, 0], [1, 0])
    assert _underflows(metrics, "double_release") == 1
    assert [r.getMessage() for r in caplog.records if "released again" in r.getMessage()], caplog.text
    other.release()
    assert _idle(inst) and ledger.held == 0 and ledger.idle.is_set()


def test_a_counter_already_at_zero_is_an_underflow_not_a_silent_clamp(caplog):
    """A DP resize drops the counts of the ranks it removes; a leg on such a rank that ends after the rank
    came back finds its counters at 0: counted (below_zero), the counters stay at 0."""
    metrics = ProxyMetrics()
    ledger = LoadLedger(metrics)
    inst = _instance(dp=2)
    charge = ledger.take(inst, 1, 40)
    inst.resize_dp(1)
    inst.resize_dp(2)
    assert inst.outstanding_tokens == [0, 0]
    with caplog.at_level(logging.WARNING, logger="atom_kv.proxy.routing.pick"):
        charge.release()
    assert _underflows(metrics, "below_zero") == 1 and _underflows(metrics, "double_release") == 0
    assert inst.inflight == 0 and inst.outstanding_tokens == [0, 0] and inst.outstanding_requests == [0, 0]
    assert any("outstanding_tokens and outstanding_requests already at 0" in r.getMessage()
               for r in caplog.records), caplog.text


def test_each_holder_releases_once():
    """A block gives back what it still holds; one handed over or released inside it is left alone; a task
    gives it back when it ends, even when it was cancelled before it ran."""
    metrics = ProxyMetrics()
    ledger = LoadLedger(metrics)
    inst = _instance()
    with ledger.take(inst, 0, 10) as held:
        assert inst.inflight == 1
    assert held.state is ChargeState.RELEASED and _idle(inst)
    with ledger.take(inst, 0, 10) as early:
        early.release()
    with pytest.raises(ValueError):
        with ledger.take(inst, 1, 10):
            raise ValueError("a failed leg")
    with ledger.take(inst, 0, 10) as moved:
        new_holder = moved.hand_over()
    assert moved.state is ChargeState.HANDED_OVER and inst.inflight == 1
    new_holder.release()
    assert _idle(inst)
    with pytest.raises(RuntimeError):
        moved.hand_over()

    async def tasks() -> None:
        never_ran = asyncio.ensure_future(asyncio.sleep(3600))
        ledger.take(inst, 0, 10).release_when_done(never_ran)
        never_ran.cancel()  # before its first step: its body (and any block in it) never runs
        ran = asyncio.ensure_future(asyncio.sleep(0))
        ledger.take(inst, 1, 10).release_when_done(ran)
        assert inst.inflight == 2
        await asyncio.gather(never_ran, ran, return_exceptions=True)
        await asyncio.wait_for(ledger.idle.wait(), 5.0)

    asyncio.run(tasks())
    assert _idle(inst) and ledger.held == 0
    assert _underflows(metrics, "double_release") == 0 and _underflows(metrics, "below_zero") == 0


# ---------------------------------------------------------------------- every kind of request, end to end
async def _stream_then_leave(port: int, request_id: str) -> None:
    """A streamed request whose client closes its connection after the third event."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = msgspec.json.encode({"prompt": "x", "max_tokens": 200, "stream": True})
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"X-Request-Id: " + request_id.encode() + b"\r\nContent-Length: " + str(len(data)).encode()
                 + b"\r\n\r\n" + data)
    await writer.drain()
    seen = b""
    while seen.count(b"data: ") < 3:
        chunk = await asyncio.wait_for(reader.read(4096), 5.0)
        assert chunk, seen
        seen += chunk
    writer.close()
    await writer.wait_closed()


def _completion(stream: bool, expect: tuple[int, ...] = (200,),
                error_event: bool = False) -> Callable[[Any, int], Awaitable[None]]:
    async def send(proxy: Any, i: int) -> None:
        body = {"model": "fake-model", "prompt": f"hello {i}", "max_tokens": 6, "stream": stream}
        status, _, raw = await asyncio.wait_for(post(proxy.url, body, headers={"X-Request-Id": f"r{i}"}), 10.0)
        assert status in expect, raw
        if stream and status == 200:
            assert raw.endswith(b"data: [DONE]\n\n"), raw
            assert (b'"error"' in raw) == error_event, raw
    return send


async def _leave_mid_stream(proxy: Any, i: int) -> None:
    await _stream_then_leave(proxy.settings.port, f"gone-{i}")


def _fail(role: str, status: int) -> Callable[[Any, Any], None]:
    def setup(p: Any, d: Any) -> None:
        (p if role == "P" else d).fail_status = status
    return setup


def _drop_stream(_p: Any, d: Any) -> None:
    d.drop_after_chunks = 2  # the decode engine's connection ends mid-stream


KINDS: dict[str, dict[str, Any]] = {
    "non_streamed": dict(send=_completion(False)),
    "streamed": dict(send=_completion(True)),
    "client_gone_mid_stream": dict(d=dict(token_delay_s=0.05), send=_leave_mid_stream,
                                   took=["atom_kv_proxy_client_disconnects_total"]),
    "decode_engine_error": dict(setup=_fail("D", 500), send=_completion(False, expect=(502,))),
    "prefill_engine_error": dict(setup=_fail("P", 500), send=_completion(True, expect=(502,))),
    # a dropped stream takes the decode engine out of routing until a probe reaches it: 503 meanwhile
    "decode_engine_gone_mid_stream": dict(setup=_drop_stream, send=_completion(True, (200, 503), error_event=True)),
    "concurrent_dispatch_streamed": dict(proxy=dict(concurrent_dispatch=True), p=dict(kv_features=RENDEZVOUS),
                                         d=dict(kv_features=RENDEZVOUS), send=_completion(True),
                                         took=["atom_kv_proxy_concurrent_dispatches_total"]),
    "concurrent_dispatch_non_streamed": dict(proxy=dict(concurrent_dispatch=True), p=dict(kv_features=RENDEZVOUS),
                                             d=dict(kv_features=RENDEZVOUS), send=_completion(False),
                                             took=["atom_kv_proxy_concurrent_dispatches_total"]),
    "concurrent_dispatch_decode_error": dict(proxy=dict(concurrent_dispatch=True), p=dict(kv_features=RENDEZVOUS),
                                             d=dict(kv_features=RENDEZVOUS), setup=_fail("D", 500),
                                             send=_completion(True, expect=(502,))),
    "concurrent_first_token": dict(proxy=dict(concurrent_dispatch=True),
                                   p=dict(kv_features=RENDEZVOUS + FIRST_TOKEN),
                                   d=dict(kv_features=RENDEZVOUS + FIRST_TOKEN), send=_completion(True),
                                   took=["atom_kv_proxy_concurrent_dispatches_total",
                                         "atom_kv_proxy_first_tokens_forwarded_total"]),
    "first_token": dict(d=dict(kv_features=FIRST_TOKEN), setup=lambda p, d: setattr(p, "first_token_ids", [72]),
                        send=_completion(True), took=["atom_kv_proxy_first_tokens_forwarded_total"]),
    "first_token_then_decode_error": dict(
        d=dict(kv_features=FIRST_TOKEN),
        setup=lambda p, d: (setattr(p, "first_token_ids", [72]), setattr(d, "fail_status", 503)),
        send=_completion(True, error_event=True), took=["atom_kv_proxy_first_tokens_forwarded_total"]),
}


@pytest.mark.parametrize("kind", list(KINDS))
async def test_every_kind_of_request_leaves_every_instance_at_zero(pd_pair, kind):
    spec = KINDS[kind]
    proxy, p, d = await pd_pair(proxy=dict(max_retries=1, circuit_failures=1000, **spec.get("proxy", {})),
                                p=spec.get("p"), d=spec.get("d"))
    if "setup" in spec:
        spec["setup"](p, d)
    await asyncio.gather(*(spec["send"](proxy, i) for i in range(N)))
    ledger = proxy.state.relay.charges
    instances = proxy.registry.known("P") + proxy.registry.known("D")
    # a stream's charge goes back when its upstream answer ends, which may be just after the client's
    try:
        await asyncio.wait_for(ledger.idle.wait(), 5.0)
    except asyncio.TimeoutError:
        pytest.fail(f"{ledger.held} charges still held: {[(i.base_url, i.inflight) for i in instances]}")
    assert [i.base_url for i in instances] == [p.base_url, d.base_url]
    for inst in instances:
        assert (inst.inflight, inst.outstanding_tokens, inst.outstanding_requests) == (0, [0], [0]), inst.base_url
    for role in ("prefill", "decode"):
        for reason in ("double_release", "below_zero"):
            assert proxy.count("atom_kv_proxy_charge_underflows_total", role=role, reason=reason) == 0
    assert proxy.count("atom_kv_proxy_dp_rank_requests_total", role="decode", instance=d.base_url,
                       dp_rank="0") >= N  # every request did route its legs
    for metric in spec.get("took", []):  # ... down the path this kind is about
        assert proxy.count(metric) == N, metric
