"""The chaos soak's judgement, without hosts: how an answer is classified, how requests count per fault kind,
recovery after a fault, RSS and tracebacks (atom_kv/bench/chaos_client.py, chaos_report.py). The soak
itself runs in tests/e2e/test_chaos.py (root only)."""

from __future__ import annotations

from atom_kv.bench.__main__ import parse_args
from atom_kv.bench.chaos import _read_faults
from atom_kv.bench.chaos_client import Outcome, Request, Shape, classify
from atom_kv.bench.chaos_faults import Fault
from atom_kv.bench.chaos_fleet import Incarnation
from atom_kv.bench.chaos_report import count_requests, recoveries, rss_report, tracebacks

EXPECTED = "the colocated engine's text"


def test_answers_are_classified_against_the_colocated_text():
    assert classify(200, EXPECTED, "", True, EXPECTED) is Outcome.OK
    assert classify(200, EXPECTED + "!", "", True, EXPECTED) is Outcome.WRONG
    assert classify(200, "the colo", "upstream failed", True, EXPECTED) is Outcome.CUT  # an error event
    assert classify(200, "the colo", "stream broken: reset", False, EXPECTED) is Outcome.DROPPED
    assert classify(200, "a wrong start", "upstream failed", True, EXPECTED) is Outcome.WRONG
    assert classify(503, "", "no decode instance", True, EXPECTED) is Outcome.CLEAN_ERROR
    assert classify(502, "", "not a JSON error: b'<html>'", False, EXPECTED) is Outcome.UNCLEAN
    assert classify(500, "", "internal", True, EXPECTED) is Outcome.UNCLEAN
    assert classify(0, "", "no answer: refused", False, EXPECTED) is Outcome.REFUSED


def _req(started: float, ended: float, outcome: Outcome, proxy: str = "http://p1", late: bool = False) -> Request:
    return Request(Shape(0, False, True, 8), proxy, started, ended, 200, outcome, late)


def test_requests_count_under_each_fault_they_overlap_and_a_refusal_only_under_its_proxys_kill():
    faults = [Fault("link_down", "decode1", "for_s=2", 10.0, 12.0), Fault("proxy_kill", "proxy1", "", 11.0, 14.0)]
    urls = {"proxy1": "http://p1", "proxy2": "http://p2"}
    requests = [
        _req(1.0, 2.0, Outcome.OK),
        _req(9.0, 10.5, Outcome.CUT),                         # link_down only
        _req(11.5, 11.6, Outcome.REFUSED),                    # both: the kill of its own proxy explains it
        _req(11.5, 11.6, Outcome.REFUSED, proxy="http://p2"),  # the other proxy was not killed: unclean
        _req(30.0, 95.0, Outcome.OK, late=True),
        _req(40.0, 41.0, Outcome.WRONG),
    ]
    table = count_requests(requests, faults, urls, end=100.0)
    assert table["all"] == {"requests": 6, "ok": 2, "cut": 1, "clean_errors": 0, "refused": 1, "dropped": 0,
                            "wrong": 1, "unclean": 1, "late": 1}
    assert table["link_down"]["requests"] == 3 and table["link_down"]["cut"] == 1
    assert table["proxy_kill"]["refused"] == 1 and table["proxy_kill"]["unclean"] == 1
    assert table["none"]["requests"] == 3 and table["none"]["wrong"] == 1


def test_recovery_is_the_first_success_begun_after_the_fault_cleared():
    faults = [Fault("engine_stop", "decode1", "", 10.0, 13.0), Fault("proxy_kill", "proxy1", "", 20.0, 22.0),
              Fault("engine_kill", "prefill1", "", 30.0, None, failed="not back")]
    urls = {"proxy1": "http://p1"}
    requests = [_req(12.0, 14.0, Outcome.OK), _req(13.5, 15.0, Outcome.OK), _req(22.5, 23.0, Outcome.OK, "http://p2"),
                _req(23.0, 24.5, Outcome.OK)]
    rows = {r["kind"]: r for r in recoveries(requests, faults, urls)}
    assert rows["engine_stop"]["recovery_s"] == 2.0  # 13.5 -> 15.0, not the request begun during the stop
    assert rows["proxy_kill"]["recovery_s"] == 2.5   # only a request to the killed proxy counts
    assert rows["engine_kill"]["recovery_s"] is None and rows["engine_kill"]["failed"] == "not back"


def test_rss_is_flat_within_the_slack_and_tracebacks_are_found():
    mib = 2**20
    flat = Incarnation("decode1-1", None, 0.0, [(t, 300 * mib) for t in range(0, 100, 2)])  # type: ignore[arg-type]
    leak = Incarnation("proxy1-2", None, 0.0, [(t, (60 + t) * mib) for t in range(0, 100, 2)])  # type: ignore[arg-type]
    short = Incarnation("prefill1-3", None, 90.0, [(90.0, mib), (92.0, mib)])  # type: ignore[arg-type]
    rss = rss_report([flat, leak, short], warmup_s=10.0, min_span_s=30.0, slack_mib=24.0, slack_ratio=0.1)
    assert rss["decode1-1"]["flat"] and not rss["proxy1-2"]["flat"] and "prefill1-3" not in rss
    found = tracebacks({"a": "INFO fine\n", "b": "ERROR x\nTraceback (most recent call last):\n  File ..."})
    assert list(found) == ["b"]


def test_the_suite_is_registered_with_its_flags():
    args = parse_args(["chaos", "--duration", "60", "--json", "out.json", "--seed", "7"])
    assert (args.suite, args.duration, args.json, args.seed, args.read_fail) == ("chaos", 60.0, "out.json", 7, 0.05)


def test_transient_reads_are_read_off_the_decode_logs():
    attempt = ("INFO atom_kv.connector.reads: D/dp0/tp0: request {rid}: attempt {n} of 3: read of 4096 bytes in 2 "
               "ranges from peer P at 10.0.0.3:6301 failed: {why}\n")
    injected = "fault injector: read of 4096 bytes in 2 ranges from peer tcp:P#1 failed"
    log = (attempt.format(rid="a", n=1, why=injected) + attempt.format(rid="b", n=1, why="timed out")
           + attempt.format(rid="b", n=2, why=injected) + attempt.format(rid="b", n=3, why=injected)
           + f"WARNING atom_kv.connector.scheduler.consumer: request b: remote KV load failed: {injected}\n"
           + "WARNING atom_kv.connector.scheduler.consumer: request c: remote KV load failed: no confirmation\n"
           + "WARNING atom_kv.connector.peers: D/dp0/tp0: peer P at 10.0.0.3:6301 declared failed after 3 "
             "consecutive failures; will re-handshake\n"
           + "INFO atom_kv.connector.peers: D/dp0/tp0: handshake with engine P rank 0 at 10.0.0.3:6301 took 3.1 ms\n")
    got = _read_faults({"decode1-3": log, "prefill1-1": log}, 0.05)  # a prefill's log is not read
    assert got == {"read_fail": 0.05, "injected": 3, "attempts_failed": 4, "peers_dropped": 1, "handshakes": 1,
                   "loads_retried": 2, "loads_recovered": 1, "loads_failed": 2}
