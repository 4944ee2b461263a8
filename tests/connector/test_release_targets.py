"""Issue 38, F2: a client of a decode engine's HTTP port names the producer in ``kv_transfer_params``.
Whatever it names, a release goes to at most MAX_RELEASE_RANKS ranks, every port within 1..65535,
and to more than one port only of a producer whose handshake this engine completed; a load's
handshakes go to one port until its first rank answered as what the params say it is."""

from __future__ import annotations

import pytest

from atom_kv.connector.release import MAX_RELEASE_RANKS, ReleaseSpec
from atom_kv.connector.types import LoadSpec
from tests.connector.engines import run_until
from tests.connector.inproc import consumer_engine
from tests.connector.port_watch import PortWatch


def _load(**kw) -> LoadSpec:
    base = dict(request_id="d1", transfer_id="t", block_ids=[1], remote_block_ids=[1], num_tokens=16,
                remote_engine_id="P", remote_host="10.0.0.9", remote_handshake_port=9000)
    return LoadSpec(**{**base, **kw})


def test_a_release_never_names_more_ranks_than_the_bound_or_a_port_past_65535():
    assert len(ReleaseSpec("t", "h", 9000, tp_size=MAX_RELEASE_RANKS).targets()) == MAX_RELEASE_RANKS
    for bad in (dict(tp_size=2_000_000), dict(tp_size=64, pp_size=32), dict(handshake_port=65535, tp_size=2),
                dict(handshake_port=0), dict(tp_size=0), dict(dp_rank=-1)):
        args = {"handshake_port": 9000, **bad}
        with pytest.raises(ValueError, match="release of transfer 't' to h"):
            ReleaseSpec("t", "h", **args)
        assert ReleaseSpec.bounded("t", "h", args.pop("handshake_port"), **args) is None
    # the request, as the load the scheduler built from it before its params were bounded
    assert ReleaseSpec.from_load(_load(remote_tp_size=2_000_000, remote_handshake_port=65535)) is None
    assert ReleaseSpec.from_load(_load(remote_tp_size=2, remote_dp_rank=1, remote_dp_size=2)).targets() == [
        ("10.0.0.9", 9002), ("10.0.0.9", 9003)]


def test_a_producer_never_read_from_gets_its_first_rank_only():
    from atom_kv.connector.known_producers import KnownProducers

    spec = ReleaseSpec("t", "h", 9000, tp_size=4, dp_rank=2, pp_size=2, dp_size=3)
    assert len(spec.targets()) == 8
    assert spec.first_rank().targets() == [("h", 9008)]  # TP rank 0, stage 0, DP rank 2
    known = KnownProducers(capacity=2)
    assert known.reach(spec).targets() == [("h", 9008)]
    known.answered(spec)
    assert known.reach(spec) == spec
    assert known.reach(ReleaseSpec("t2", "h", 9000, tp_size=4, dp_rank=2, pp_size=2, dp_size=3)).targets() == \
        spec.targets()  # another transfer of the same producer
    assert known.reach(ReleaseSpec("t", "other-host", 9000, tp_size=4)).targets() == [("other-host", 9000)]
    known.answered(ReleaseSpec("a", "h1", 1000, tp_size=2))
    known.answered(ReleaseSpec("b", "h2", 1000, tp_size=2))  # the least recently answered is forgotten
    assert len(known) == 2 and known.reach(spec).targets() == [("h", 9008)]


def test_a_host_a_client_names_gets_one_port_contacted_never_a_range():
    """A decode engine (its worker, scheduler and release sender, all real) given params naming four
    pipeline stages on a host where nothing answers: it tries the first rank's port only, its load
    fails within the budget, and its release goes to that port too; the other three hear nothing."""
    watch = PortWatch(4)
    D, dw, _ = consumer_engine(watch.base + 100, handshake_timeout_s=0.3, transfer_timeout_s=0.3,
                               transfer_retries=1)
    try:
        raw = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "127.0.0.1",
               "remote_handshake_port": watch.base, "remote_tp_size": 1, "remote_pp_size": 4,
               "remote_block_ids": [0, 1, 2], "transfer_id": "t-named"}
        D.admit("d1", 40, raw)
        run_until([D], lambda: "d1" in D.failed, timeout_s=15)
        assert f"no handshake reply from 127.0.0.1:{watch.base} " in D.failed["d1"]  # the first rank's port
        assert watch.wait_for(lambda: "Release" in watch.seen[0], 5.0), watch.seen
        watch.collect(0.5)  # anything still on its way to the other ports
        assert watch.seen[1:] == [[], [], []], watch.seen
        assert watch.seen[0].count("HandshakeRequest") <= 2  # transfer_retries + 1 tries, at most
        assert watch.seen[0].count("Release") == 1
    finally:
        dw.close()
        D.sched.close()
        watch.close()
