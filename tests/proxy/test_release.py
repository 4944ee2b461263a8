"""The proxy's releases: an abandoned prefill's producer ranks hear it at once, signed
with the cluster secret; a decode engine's prefill-side failure is charged to the prefill.

The fake prefill engines move no KV; a real ZeroMQ ROUTER on each one's handshake
port stands in for its producer ranks and records what arrives."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from atom_kv import wire
from atom_kv.auth import PURPOSE_RELEASE, ReplayWindow, verify_struct
from atom_kv.openai_errors import KV_TRANSFER_FAILURE_HEADER
from atom_kv.proxy.relay.release import ProducerAddress
from tests.proxy.fake_engine import post, register

TOKEN = "cluster-secret-0123456789abcdef"


class ProducerPorts:
    """ROUTER sockets on ``tp_size`` consecutive handshake ports, collecting releases."""

    def __init__(self, base: int, tp_size: int = 1) -> None:
        self.ctx = zmq.asyncio.Context()
        self.socks = []
        for rank in range(tp_size):
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"tcp://127.0.0.1:{base + rank}")
            self.socks.append(sock)
        self.received: list[tuple[int, wire.Release]] = []

    async def collect(self, n: int, timeout: float = 3.0) -> list[tuple[int, wire.Release]]:
        """Wait until ``n`` releases arrived in all (rank, release)."""
        deadline = asyncio.get_running_loop().time() + timeout
        poller = zmq.asyncio.Poller()
        for sock in self.socks:
            poller.register(sock, zmq.POLLIN)
        while len(self.received) < n:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            for sock, _ in await poller.poll(left * 1000):
                frames = await sock.recv_multipart()
                self.received.append((self.socks.index(sock), wire.decode(frames[-1], wire.Release)))
        return self.received

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)
        self.ctx.term()


def _free_base(n: int) -> int:
    from atom_kv.testing.ports import free_port_range

    return free_port_range(n)


async def test_decode_refusal_releases_the_prefill_at_the_address_it_answered_signed(make_proxy, make_engine):
    base = _free_base(2)
    ports = ProducerPorts(base, tp_size=2)
    try:
        proxy = await make_proxy(registration_token=TOKEN)
        p = await make_engine("P", handshake_port=base, tp_size=2)
        d = await make_engine("D")
        await register(proxy, p, d, token=TOKEN)
        d.fail_status = 400  # the decode engine refuses before its first byte
        status, _, _ = await post(proxy.url, {"prompt": "x", "max_tokens": 2})
        assert status == 400
        got = await ports.collect(2)
        assert sorted(rank for rank, _ in got) == [0, 1]  # every producer rank
        tid = d.received[0].kv["transfer_id"]
        for _, msg in got:
            assert (msg.transfer_id, msg.sender, msg.reason) == (tid, "proxy", "decode_rejected")
            verify_struct(TOKEN, PURPOSE_RELEASE, msg, ReplayWindow(30))  # signed with the cluster secret
        assert proxy.count("atom_kv_proxy_releases_total", outcome="sent") == 2
    finally:
        ports.close()


async def test_client_gone_during_prefill_releases_by_registration_and_minted_id(pd_pair):
    base = _free_base(1)
    ports = ProducerPorts(base)
    try:
        proxy, p, d = await pd_pair(p=dict(handshake_port=base))
        p.hang = True
        task = asyncio.create_task(post(proxy.url, {"prompt": "x", "max_tokens": 2}))
        assert await p.wait_until(lambda: len(p.received) == 1)
        task.cancel()  # the client goes away while the prefill runs
        ((rank, msg),) = await ports.collect(1)
        assert msg.transfer_id == p.received[0].kv["transfer_id"]  # the id the proxy minted for both legs
        assert (rank, msg.reason, msg.mac) == (0, "client_gone", None)  # no token: unsigned
    finally:
        ports.close()


async def test_retry_onto_another_pair_releases_the_first_prefill(make_proxy, make_engine):
    base = _free_base(1)
    ports = ProducerPorts(base)
    try:
        proxy = await make_proxy(circuit_failures=100)
        p = await make_engine("P", handshake_port=base)
        bad = await make_engine("D")
        good = await make_engine("D")
        await register(proxy, p, bad, good)
        bad.fail_status = 503
        for _ in range(2):  # round robin: one of them goes to the failing decode first
            status, _, _ = await post(proxy.url, {"prompt": "x", "max_tokens": 2})
            assert status == 200
        got = await ports.collect(len(bad.received))
        assert len(bad.received) >= 1
        assert sorted(m.transfer_id for _, m in got) == sorted(r.kv["transfer_id"] for r in bad.received)
        assert all(m.reason == "decode_rejected" for _, m in got)
    finally:
        ports.close()


async def test_prefill_side_load_failure_is_charged_to_the_prefill_and_retried(make_proxy, make_engine):
    proxy = await make_proxy(circuit_failures=1, max_retries=2)
    bad_p = await make_engine("P")
    good_p = await make_engine("P")
    d = await make_engine("D")
    await register(proxy, bad_p, good_p, d)
    seen: list[str] = []

    # the decode engine cannot read what bad_p prefilled: it answers 502 naming the prefill side
    from aiohttp import web

    original = d._handle

    async def handle(request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        seen.append(body["kv_transfer_params"]["remote_engine_id"])
        if body["kv_transfer_params"]["remote_engine_id"] == bad_p.engine_id:
            return web.json_response({"error": {"message": "KV transfer failed: handshake refused"}}, status=502,
                                     headers={KV_TRANSFER_FAILURE_HEADER: "prefill"})
        return await original(request, chat)

    d._handle = handle  # type: ignore[method-assign]
    for _ in range(4):
        status, _, _ = await post(proxy.url, {"prompt": "x", "max_tokens": 2})
        assert status == 200
    dec = proxy.registry.live("D")[0]
    assert dec.breaker.state() == "closed" and dec.breaker.failures == 0  # the decode engine is not blamed
    bad = next(i for i in proxy.registry.known("P") if i.engine_id == bad_p.engine_id)
    assert bad.breaker.failures == 1  # the prefill is (its circuit opened: it got no more traffic)
    assert proxy.count("atom_kv_proxy_upstream_failures_total", role="prefill", kind="kv_transfer") == 1
    assert bad_p.engine_id in seen and seen.count(good_p.engine_id) == 4
    assert proxy.count("atom_kv_proxy_abandoned_prefills_total", reason="kv_transfer_failed") == 1


async def test_no_release_for_moriio_engines_or_with_no_release(make_proxy, make_engine):
    base = _free_base(1)
    ports = ProducerPorts(base)
    try:
        for overrides, fmt in ((dict(), "moriio"), (dict(release_prefills=False), "atom")):
            proxy = await make_proxy(**overrides)
            p = await make_engine("P", handshake_port=base)
            d = await make_engine("D")
            await register(proxy, p, d, fmt=fmt)
            d.fail_status = 400
            assert (await post(proxy.url, {"prompt": "x", "max_tokens": 2}))[0] == 400
            assert proxy.count("atom_kv_proxy_abandoned_prefills_total", reason="decode_rejected") == 1
            assert proxy.count("atom_kv_proxy_releases_total", outcome="sent") == 0
        assert await ports.collect(1, timeout=0.5) == []
    finally:
        ports.close()


async def test_graceful_shutdown_with_a_prefill_outstanding_still_releases_it(make_proxy, make_engine):
    base = _free_base(1)
    ports = ProducerPorts(base)
    try:
        proxy = await make_proxy(shutdown_timeout=0.3)
        p = await make_engine("P", handshake_port=base)
        d = await make_engine("D")
        await register(proxy, p, d)
        p.hang = True
        task = asyncio.create_task(post(proxy.url, {"prompt": "x", "max_tokens": 2}))
        assert await p.wait_until(lambda: len(p.received) == 1)
        await proxy.stop()  # SIGTERM's path: graceful period, then in-flight requests are cancelled
        ((_, msg),) = await ports.collect(1)
        assert msg.transfer_id == p.received[0].kv["transfer_id"] and msg.reason == "client_gone"
        try:
            await asyncio.wait_for(task, 5)  # the client got an answer or a closed connection, not a hang
        except Exception:
            pass
    finally:
        ports.close()


def test_producer_address_from_the_answer_else_the_registration():
    from atom_kv.proxy.fleet.registry import CircuitBreaker, Instance, Registration

    inst = Instance(Registration(role="P", base_url="http://10.0.0.5:8000", host="10.0.0.5", http_port=8000,
                                 handshake_port=7000, dp_size=4, tp_size=2), breaker=CircuitBreaker(3, 1.0))
    assert ProducerAddress.of(None, inst, 3).targets() == [("10.0.0.5", 7006), ("10.0.0.5", 7007)]
    answered = {"remote_host": "10.0.0.6", "remote_handshake_port": 9000, "tp_size": 1, "dp_rank": 0}
    assert ProducerAddress.of(answered, inst, 3).targets() == [("10.0.0.6", 9000)]
    assert ProducerAddress.of({"remote_port": 9100, "remote_tp_size": "x"}, inst, 0) is not None
    inst.learn(handshake_port=None)
    assert ProducerAddress.of(None, inst, 0) is None
    inst.learn(handshake_port=65535)
    assert ProducerAddress.of(None, inst, 1) is None  # ports past 65535


def test_producer_address_of_a_dp_rank_with_pipeline_stages():
    """An abandoned prefill is released on every stage of the DP rank that ran it, and on no other rank."""
    from atom_kv.proxy.fleet.registry import CircuitBreaker, Instance, Registration

    inst = Instance(Registration(role="P", base_url="http://10.0.0.5:8000", host="10.0.0.5", http_port=8000,
                                 handshake_port=7000, dp_size=4, tp_size=2), breaker=CircuitBreaker(3, 1.0))
    answered = {"remote_handshake_port": 7000, "tp_size": 2, "dp_rank": 1, "remote_pp_size": 2}
    # stage s, DP rank 1 of 4, TP rank r: 7000 + s*8 + 1*2 + r
    assert ProducerAddress.of(answered, inst, 0).targets() == [("10.0.0.5", p) for p in (7002, 7003, 7010, 7011)]
