"""Clients cannot steer the circuit breaker; a dead instance still opens it (issue 27, item 1).

Real processes: ``python -m atom_kv.proxy`` with static engines, and fake engines
(``python -m atom_kv.testing.fake_engine``) that answer 500 to a "poison" prompt (a
request's own failure) or to everything (a broken engine). Reproductions on the code
before this change: with one prefill, 3 poison requests opened its circuit and every
other client got 503; with two prefills, 8 concurrent poison requests opened both.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from atom_kv.testing.polling import wait_until
from atom_kv.testing.web import http_json as http
from atom_kv.testing.web import scrape_metrics
from tests.proxy.procs import FakeEngines, ProxyProcess
from tests.proxy.test_cli import _run

ROUNDS = 3  # the burst, repeated
POISON = "poison"


def _proxy(prefills: list[str], decodes: list[str], *extra: str) -> ProxyProcess:
    args = ["--no-discovery", "--probe-interval", "0.2", "--max-retries", "2", "--retry-backoff", "0.01",
            "--circuit-cooldown", "60", *extra]  # an opened circuit stays open for the whole test
    for url in prefills:
        args += ["--prefill", url]
    for url in decodes:
        args += ["--decode", url]
    proxy = ProxyProcess(*args)
    want = {"status": "ok", "prefill": len(prefills), "decode": len(decodes)}
    wait_until(lambda: http("GET", proxy.url + "/health") == (200, want), 15, interval=0.05,
               what="the static engines to be probed up")
    return proxy


def _metric(proxy: ProxyProcess, name: str, **labels: str) -> float:
    """One sample from the proxy's /metrics (the exposition sorts the labels by name)."""
    key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    return scrape_metrics(proxy.url + "/metrics").get(key, 0.0)


async def _post(session: aiohttp.ClientSession, url: str, prompt: str) -> int:
    async with session.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}) as r:
        await r.read()
        return r.status


async def _bursts(url: str) -> tuple[list[int], list[int]]:
    """The issue's load shape, ``ROUNDS`` times: 3 sequential poison requests, then 8 concurrent
    ones, while victims keep coming; 8 more victims after each burst. Returns (poison, victim) statuses."""
    poison: list[int] = []
    victims: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async def sequential() -> None:
            for _ in range(3):
                poison.append(await _post(s, url, POISON))

        async def victim(n: int) -> None:
            for i in range(n):
                victims.append(await _post(s, url, f"victim {i}"))

        for _ in range(ROUNDS):
            await asyncio.gather(sequential(), victim(4))
            results = await asyncio.gather(*(_post(s, url, POISON) for _ in range(8)), victim(4))
            poison.extend(results[:8])
            victims.extend(await asyncio.gather(*(_post(s, url, f"after {i}") for i in range(8))))
    return poison, victims


@pytest.mark.parametrize("prefills", [1, 2])
def test_bursts_of_poison_requests_leave_victims_served(prefills):
    engines = FakeEngines("--prefills", str(prefills), "--decodes", "1", "--fail-prompt", POISON)
    proxy = _proxy(engines.prefill, engines.decode)
    try:
        poison, victims = asyncio.run(asyncio.wait_for(_bursts(proxy.url), 90))
        assert victims == [200] * (ROUNDS * 16)  # every other client is served ...
        assert poison == [502] * (ROUNDS * 11)  # ... and each poison request gets its own failure
        assert _metric(proxy, "atom_kv_proxy_circuit_opened_total", role="prefill") == 0
        status, listing = http("GET", proxy.url + "/instances")
        assert status == 200 and all(i["circuit"] == "closed" for i in listing)
        # one prefill: nobody else could judge them; two: each failed on both, the request's own fault
        verdict = "unresolved" if prefills == 1 else "request"
        assert _metric(proxy, "atom_kv_proxy_suspect_failures_judged_total", role="prefill",
                       verdict=verdict) == ROUNDS * 11 * prefills  # one verdict per request and instance
    finally:
        proxy.kill()
        engines.stop()


@pytest.mark.parametrize("status", [500, 503])
def test_a_broken_instance_still_opens_its_circuit(status):
    """Regression: an engine that fails every request (500 while another instance serves the same
    requests, or 503) is taken out of routing after --circuit-failures requests."""
    good = FakeEngines("--prefills", "1", "--decodes", "1")
    broken = FakeEngines("--prefills", "1", "--decodes", "0", "--fail-status", str(status))
    proxy = _proxy([good.prefill[0], broken.prefill[0]], good.decode, "--circuit-failures", "3")
    try:
        async def requests() -> list[int]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
                return [await _post(s, proxy.url, f"request {i}") for i in range(12)]

        assert asyncio.run(asyncio.wait_for(requests(), 60)) == [200] * 12  # retried on the good one
        _, listing = http("GET", proxy.url + "/instances")
        circuits = {i["address"]: i["circuit"] for i in listing if i["role"] == "P"}
        assert circuits == {good.prefill[0]: "closed", broken.prefill[0]: "open"}
        assert _metric(proxy, "atom_kv_proxy_circuit_opened_total", role="prefill") == 1
        # 3 failures opened it; round robin sent it every other request until then, none after
        assert _metric(proxy, "atom_kv_proxy_upstream_failures_total", role="prefill", kind="5xx") == 3
    finally:
        proxy.kill()
        good.stop()
        broken.stop()


@pytest.mark.parametrize("flag, value, says", [
    ("--circuit-failure-ratio", "1.5", "must be a fraction > 0 and <= 1"),
    ("--circuit-failure-ratio", "0", "must be > 0"),
    ("--circuit-min-requests", "0", "must be >= 1"),
    ("--circuit-window", "-1", "must be > 0"),
    ("--circuit-failures", "0", "must be >= 1"),
    ("--max-upstream-head-bytes", "100", "max_upstream_head_bytes: must be >= 1024"),
    ("--max-upstream-body-bytes", "0", "must be >= 1"),
    ("--max-server-timing-bytes", "-1", "must be >= 0"),
    ("--max-first-token-text-bytes", "x", "not an integer"),
])
def test_breaker_and_answer_bound_flags_are_checked_in_one_line(flag, value, says, monkeypatch, capsys, caplog):
    """The proxy's own main(), in this process (a process start per flag cost more than the checks): the
    refusal comes before it listens, and a flag let through fails here instead of serving."""
    from atom_kv.proxy import __main__ as proxy_main

    def accepted(*args, **kwargs):
        raise AssertionError(f"{flag} {value} was accepted: the proxy went on to listen")

    monkeypatch.setattr(proxy_main, "listen_socket", accepted)
    monkeypatch.setattr(proxy_main, "configure_logging", lambda *a: None)  # this process's logging stays as it is
    with pytest.raises(SystemExit) as exit_info:
        proxy_main.main([flag, value, "--port", "0", "--discovery-port", "0"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []  # nor logged with one
    assert says in last and (flag in last or flag.lstrip("-").replace("-", "_") in last), last


def test_a_bad_breaker_flag_is_one_line_from_the_proxy_process():
    res = _run("--circuit-failures", "0", "--port", "0", "--discovery-port", "0")
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "must be >= 1" in last and ("--circuit-failures" in last or "circuit_failures" in last), last
