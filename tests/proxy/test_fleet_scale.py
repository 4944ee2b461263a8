"""What one routing pick costs as the fleet grows: counted work (calls), never timings.

A pick asks the registry for the live instances of a role and drops those behind an open circuit. Neither
may look at every instance of a 1,000-engine fleet on every request (``bench fleet`` shows the cost).
"""

from __future__ import annotations

from atom_kv.proxy.fleet.breaker import CircuitBreaker
from atom_kv.proxy.fleet.health import HealthMonitor, UpstreamHealth
from atom_kv.proxy.fleet.registry import Instance, Registration, Registry
from atom_kv.proxy.observability.metrics import ProxyMetrics
from atom_kv.proxy.routing import policies
from atom_kv.proxy.routing.base import RouteContext
from atom_kv.proxy.routing.policies import LeastLoaded, PrefixHash

FLEET = 500  # instances per role
CTX = RouteContext(text="", prompt_tokens=10)


class CountingRegistry(Registry):
    """A registry that counts its liveness checks (one per instance looked at)."""

    checks = 0

    def alive(self, inst, now):  # type: ignore[no-untyped-def]
        self.checks += 1
        return super().alive(inst, now)


def _reg(role: str, k: int, draining: bool = False) -> Registration:
    host = f"10.0.{k // 250}.{k % 250 + 1}"
    return Registration(role=role, base_url=f"http://{host}:8000", host=host, http_port=8000, handshake_port=1,
                        dp_size=1, tp_size=1, draining=draining)


def _fleet(n: int = FLEET, timeout: float = 15.0) -> CountingRegistry:
    r = CountingRegistry(heartbeat_timeout=timeout, circuit_failures=2, circuit_cooldown_s=10.0, max_instances=4 * n)
    for role in ("P", "D"):
        for k in range(n):
            r.upsert(_reg(role, k), now=0.0)
    for inst in r.known("P") + r.known("D"):
        r.mark_up(inst, now=0.0)
    return r


def test_live_does_not_look_at_every_instance_on_every_pick():
    r = _fleet()
    r.checks = 0
    for i in range(100):  # 100 picks of each role within one second, pings arriving in between
        now = 1.0 + i / 100
        assert len(r.live("P", now)) == FLEET and len(r.live("D", now)) == FLEET
        r.upsert(_reg("P", i), now=now)
    # one look at each instance and one per ping, not one per instance per pick (100,000 before)
    assert r.checks <= 2 * FLEET + 100


def test_live_still_drops_the_silent_and_the_leaving_and_takes_back_the_returning():
    r = _fleet(3, timeout=5.0)
    assert len(r.live("P", 1.0)) == 3
    for now in (2.0, 4.0):  # P 0 and 1 keep pinging; P 2 is silent from 0.0 on
        r.upsert(_reg("P", 0), now=now)
        r.upsert(_reg("P", 1), now=now)
    assert [i.base_url for i in r.live("P", 5.5)] == [_reg("P", k).base_url for k in (0, 1)]  # no change told it
    r.upsert(_reg("P", 1, draining=True), now=5.6)  # its ping says it is leaving
    assert [i.base_url for i in r.live("P", 5.7)] == [_reg("P", 0).base_url]
    r.upsert(_reg("P", 2), now=5.8)  # the silent one, heard again before it was evicted
    assert [i.base_url for i in r.live("P", 5.9)] == [_reg("P", k).base_url for k in (0, 2)]
    live = r.live("P", 5.9)
    live.clear()  # the caller's own list
    assert len(r.live("P", 5.9)) == 2


def test_open_circuits_are_looked_for_only_while_one_is_open(monkeypatch):
    asked = []
    allows = CircuitBreaker.allows

    def counting(self, now):  # type: ignore[no-untyped-def]
        asked.append(self)
        return allows(self, now)

    monkeypatch.setattr(CircuitBreaker, "allows", counting)
    r = _fleet()
    live = r.live("P", 1.0)
    assert r.closed_circuits("P", live, 1.0) == live and asked == []  # all closed: nobody asked
    broken = live[7]
    assert not broken.breaker.record_failure(1.0, "a") and broken.breaker.record_failure(1.0, "b")  # opens
    kept = r.closed_circuits("P", live, 2.0)
    assert broken not in kept and len(kept) == FLEET - 1 and len(asked) == FLEET
    assert r.closed_circuits("D", r.live("D", 2.0), 2.0) and len(asked) == FLEET  # the other role: none open
    broken.breaker.record_success(3.0)  # closed again
    asked.clear()
    assert r.closed_circuits("P", live, 3.0) == live and asked == []
    assert live[8].breaker.record_failure(4.0, "c") is False and live[8].breaker.record_failure(4.0, "d")
    r.remove(live[8])  # an instance that leaves with its circuit open is no longer counted
    assert r.closed_circuits("P", r.live("P", 5.0), 5.0) is not None and asked == []


def test_a_repeat_ping_from_a_known_engine_only_refreshes_its_timestamp(monkeypatch):
    import msgspec

    from atom_kv.auth import PURPOSE_REGISTER, sign_fields
    from atom_kv.proxy.fleet import pings
    from atom_kv.proxy.fleet.discovery import DiscoveryListener
    from atom_kv.proxy.fleet.registry import Instance
    from atom_kv.proxy.observability.metrics import ProxyMetrics
    from atom_kv.wire import RegisterPing

    parsed, taken = [], []
    urlsplit, take = pings.urlsplit, Instance._take
    monkeypatch.setattr(pings, "urlsplit", lambda url: parsed.append(url) or urlsplit(url))
    monkeypatch.setattr(Instance, "_take", lambda self, reg: taken.append(reg) or take(self, reg))
    registry = Registry(heartbeat_timeout=15.0, circuit_failures=2, circuit_cooldown_s=10.0, max_instances=8)
    listener = DiscoveryListener("127.0.0.1", 0, registry, ProxyMetrics(), registration_token="tok")

    def ping(**changes: object) -> bytes:  # signed: a new ts, nonce and mac every time
        fields = RegisterPing(role="D", index="0", request_address="http://127.0.0.1:9/v1/completions",
                              handshake_port=1, kv_features=["first_token"], answers=True, **changes)
        return msgspec.msgpack.encode(sign_fields("tok", PURPOSE_REGISTER, msgspec.to_builtins(fields)))

    for _ in range(20):
        assert listener.handle(ping()).status == "registered"
    inst = registry.get("D", "http://127.0.0.1:9")
    assert len(parsed) == 1 and taken == []  # one URL parsed, the record made once, for 20 pings
    seen = inst.last_seen
    listener.handle(ping())
    assert inst.last_seen >= seen and len(parsed) == 1
    listener.handle(ping(draining=True))  # a ping that says something new is taken
    assert inst.draining and len(parsed) == 2 and len(taken) == 1
    inst.learn(model="learnt")  # a probe changed the record: the next ping is taken again, as before
    listener.handle(ping(draining=True))
    assert inst.model is None and len(taken) == 3 and len(parsed) == 2
    assert len(listener.known_pings) == 2


class CountingLoads(list):
    """A DP-rank load list that counts the reads a policy makes of it."""

    reads = 0

    def __getitem__(self, rank):  # type: ignore[no-untyped-def]
        CountingLoads.reads += 1
        return super().__getitem__(rank)


def test_least_loaded_pick_does_not_read_every_slot():
    r = _fleet()
    for inst in r.known("P"):
        inst.outstanding_tokens = CountingLoads(inst.outstanding_tokens)
    policy, ledger = LeastLoaded(), []
    CountingLoads.reads = 0
    for _ in range(100):  # 100 picks, 32 legs in flight at a time
        inst, rank = policy.choose(r.routable("P", 1.0), CTX)
        inst.add_load(rank, 10)
        ledger.append((inst, rank))
        if len(ledger) > 32:
            done, rank_done = ledger.pop(0)
            done.remove_load(rank_done, 10)
    # the idle slot each pick starts at, and the busy ones in its way: not 500 reads a pick (50,000 before)
    assert CountingLoads.reads <= 100 * 34


def test_least_loaded_picks_as_a_full_scan_would():
    r = _fleet(n=50)
    policy, inst_loads = LeastLoaded(), r.known("P")
    for k, inst in enumerate(inst_loads):
        inst.add_load(0, (k * 7919) % 5)  # some idle, most busy, ties among both
    counter = 0
    for _ in range(200):
        cands = r.routable("P", 1.0)
        slots = [(i, 0) for i in cands]
        start = counter % len(slots)
        counter += 1
        expected = min(slots[start:] + slots[:start], key=lambda s: s[0].outstanding_tokens[0])
        inst, rank = policy.choose(cands, CTX)
        assert (inst, rank) == expected
        inst.add_load(rank, 3)


def test_prefix_hash_weighs_every_candidate_once_per_prefix(monkeypatch):
    r = _fleet()
    weighed = []
    mix = policies._mix64
    monkeypatch.setattr(policies, "_mix64", lambda x: weighed.append(x) or mix(x))
    policy = PrefixHash(16)
    prompts = [f"system prompt {k % 5}" for k in range(100)]
    picks = [policy.choose(r.routable("P", 1.0), RouteContext(text=p, prompt_tokens=4))[0] for p in prompts]
    assert len(weighed) <= 5 * FLEET  # once per new prefix, not once per pick (50,000 before)
    full = PrefixHash(16)  # the same picks as weighing every candidate every time
    assert picks == [full.choose(list(r.live("P", 1.0)), RouteContext(text=p, prompt_tokens=4))[0] for p in prompts]


def test_a_dp_resize_rebuilds_the_routable_list():
    r = _fleet(n=4)
    before = r.routable("P", 1.0)
    assert r.routable("P", 1.0) is before
    before[0].resize_dp(2)
    after = r.routable("P", 1.0)
    assert after is not before
    policy = LeastLoaded()
    ranks = {(i.base_url, rank) for i, rank in (policy.choose(after, CTX) for _ in range(5))}
    assert len(ranks) == 5  # five idle slots, the resized instance's second rank among them


def test_the_health_tick_looks_only_at_the_engines_it_must_probe(monkeypatch):
    r = _fleet()
    looked = []
    state = Instance.static
    monkeypatch.setattr(Instance, "static", property(lambda self: looked.append(self) or state.fget(self)))
    monitor = HealthMonitor(r, UpstreamHealth(r, ProxyMetrics()), interval_s=2.0, timeout_s=1.0,
                            connect_timeout=1.0, tick_s=0.5)
    for k in range(10):
        monitor.tick(1.0 + k / 10)  # every engine up and pinging: nothing to probe
    assert len(looked) <= 10 and not monitor._probing  # 10,000 looks before (1,000 engines, 10 ticks)
    down = r.known("D")[7]
    r.mark_down(down, "refused", None)
    assert r.to_probe() == [down]
    r.mark_up(down, now=2.0)
    assert r.to_probe() == []
    r.remove(down)
    r.upsert(down.reg, now=2.0)
    assert [i.base_url for i in r.to_probe()] == [down.base_url]  # back, pending
