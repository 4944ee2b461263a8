"""FairShares: the per-source cap, the shared pool, the reserve for proven sources, max-min displacement."""

from __future__ import annotations

from atom_kv._fairshare import FairShares, ProvenSources


def _fill(shares: FairShares, source: str, n: int) -> None:
    for _ in range(n):
        verdict = shares.admit(source)
        assert verdict.ok and verdict.evict is None, (source, verdict.evict, verdict.reason)
        shares.add(source, verdict.reserved)


def test_a_source_at_its_cap_replaces_its_own_oldest():
    shares = FairShares(capacity=100, per_source=4)
    _fill(shares, "a", 4)
    verdict = shares.admit("a")
    assert verdict.ok and verdict.evict == "a"
    assert shares.admit("b").evict is None  # another source is not touched


def test_strangers_share_capacity_minus_the_reserve_and_the_largest_gives_way():
    shares = FairShares(capacity=10, per_source=10, reserved=4)
    _fill(shares, "a", 4)
    _fill(shares, "b", 2)  # the open pool (6) is full
    verdict = shares.admit("c")  # holds none: the largest (a) gives way
    assert verdict.ok and verdict.evict == "a" and not verdict.reserved
    shares.remove("a", False)
    shares.add("c", False)
    # b (2) holds as many as the largest (a: 3 > 2): a again; then when b is the largest, b's own goes
    assert shares.admit("b").evict == "a"


def test_proven_sources_use_the_reserve_and_strangers_never_take_it():
    proven = ProvenSources()
    shares = FairShares(capacity=10, per_source=10, reserved=4, proven=proven)
    _fill(shares, "stranger", 6)  # the open pool is full
    proven.proved("peer")
    _fill(shares, "peer", 4)  # the reserve
    assert len(shares) == 10
    verdict = shares.admit("newcomer")  # holds none, the stranger holds 6: it gives way (not the peer)
    assert verdict.evict == "stranger"
    # once the stranger holds no more than the peer... a stranger holding none is refused
    only_peers = FairShares(capacity=4, per_source=10, reserved=3, proven=proven)
    _fill(only_peers, "peer", 4)
    assert not only_peers.admit("stranger").ok


def test_proof_is_forgotten_after_its_ttl():
    now = [0.0]
    proven = ProvenSources(ttl_s=10.0, clock=lambda: now[0])
    proven.proved("peer")
    assert "peer" in proven
    now[0] = 11.0
    assert "peer" not in proven and len(proven) == 0
