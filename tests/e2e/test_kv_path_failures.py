"""A decode engine that cannot connect to the prefill engine's KV ports: the failure takes one connect timeout.

Real processes on loopback (the cluster harness): a proxy, reference engines, and a "cut-off" prefill engine
whose KV listeners bind 127.0.0.1 while it advertises 127.0.0.7 (``bind_host``), where a listener with a full
backlog holds its handshake port: the decode engine's connection attempts get no answer, as behind a
firewall's DROP rule, while the proxy reaches the engine's HTTP port there.

- One prefill and one decode engine: the client's 502 names the decode-to-prefill KV path, after one
  ``connect_timeout_s`` (default 5 s), well before one ``handshake_timeout_s``; the prefill engine ran one
  prefill (the pair is not tried again: no other pair exists).
- Two prefill engines, one cut off: every request succeeds; one that met the cut-off prefill first was
  retried once on the other pair, again after one connect timeout.
"""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.ports import free_plan_base
from atom_kv.testing.unaccepting import ConnectionsNotDropped, unaccepting_listener
from atom_kv.testing.web import scrape_metrics
from tests.e2e.helpers import PROMPTS, generate

CUT_OFF_HOST = "127.0.0.7"  # the cut-off prefill engine's advertised address (all of 127/8 is loopback)
CONNECT_S = 5.0  # connect_timeout_s's default: the tests leave it
HANDSHAKE_S = 30.0  # the decode engine's handshake_timeout_s: what each attempt would wait without the fix
CLIENT_TIMEOUT_S = 40.0  # below the three connect-less handshakes of one attempt (transfer_retries 2)


@pytest.fixture
def cut_off_port() -> Iterator[int]:
    """A handshake port for the cut-off prefill: free on 127.0.0.1 (its KV listeners bind there) and dropping
    connections on :data:`CUT_OFF_HOST` (what it advertises)."""
    for _ in range(20):
        base = free_plan_base(1)
        try:
            with unaccepting_listener(CUT_OFF_HOST, base) as port:
                yield port
                return
        except ConnectionsNotDropped as exc:
            pytest.skip(str(exc))
        except OSError:  # taken on that address: another base
            continue
    pytest.skip(f"no port free on both 127.0.0.1 and {CUT_OFF_HOST}")


def _cut_off_prefill(port: int) -> EngineSpec:
    return EngineSpec("P", host=CUT_OFF_HOST, extra_config={"handshake_port": port, "bind_host": "127.0.0.1"})


def _decode() -> EngineSpec:
    return EngineSpec("D", extra_config={"handshake_timeout_s": HANDSHAKE_S})


def _prefills(c: Cluster, i: int) -> float:
    """Requests engine ``i`` has finished, whichever way (a prefill leg counts once)."""
    m = scrape_metrics(c.engine_url(i) + "/metrics")
    return sum(m.get(f"atom_kv_requests_{end}_total", 0.0) for end in ("ok", "failed", "aborted"))


def _timed(c: Cluster, prompt: str):
    t0 = time.monotonic()
    res = generate(c.proxy_url, prompt, chat=False, stream=False, max_tokens=4, timeout=CLIENT_TIMEOUT_S)
    return res, time.monotonic() - t0


def test_a_kv_path_that_cannot_connect_fails_once_after_one_connect_timeout(cut_off_port, tmp_path):
    with Cluster([_cut_off_prefill(cut_off_port), _decode()], log_dir=str(tmp_path)) as c:
        p, d = c.index_of("P"), c.index_of("D")
        res, took = _timed(c, PROMPTS[0])
        assert res.status == 502, res
        assert res.error.startswith("decode-to-prefill KV path failed: the prefill engine could not hand its KV "
                                    "cache to the decode engine (request "), res
        assert CONNECT_S <= took < HANDSHAKE_S / 2, took  # one connect timeout, not a handshake timeout
        assert _prefills(c, p) == 1  # one prefill: the same pair is not tried again
        log = c.engines[d].log_text()
        assert f"cannot connect to {CUT_OFF_HOST}:{cut_off_port} within 5 s (connect_timeout_s)" in log
        wait_until(lambda: (lambda kv: kv["free"] == kv["total"])(c.engine_health(d)["kv_blocks"]), 10,
                   what="every KV block of the decode engine to be free")


def test_a_kv_path_failure_is_retried_on_another_prefill_instance(cut_off_port, tmp_path):
    with Cluster([_cut_off_prefill(cut_off_port), EngineSpec("P"), _decode()], log_dir=str(tmp_path)) as c:
        cut, good = c.index_of("P", 0), c.index_of("P", 1)
        for prompt in PROMPTS[:2]:  # round robin: the cut-off prefill is met first at least once
            res, took = _timed(c, prompt)
            assert res.status == 200 and res.error is None, res
            assert took < HANDSHAKE_S / 2, took
        met = _prefills(c, cut)
        assert met >= 1 and _prefills(c, good) == 2
        retries = scrape_metrics(c.proxy_url + "/metrics").get("atom_kv_proxy_retries_total", 0.0)
        assert retries == met  # each pair that could not move its KV was retried once, on the other prefill
