"""The port plan (``atom_kv.ports``) from the config alone: one block per listener kind, ATOM's
rank offset inside it, ``0`` for OS-assigned, collisions and overflows refused naming the keys,
and ``python -m atom_kv.ports`` printing the same plan."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from atom_kv.config import ConfigError, KVTransferConfig
from atom_kv.ports import LISTENERS, STRIDE, PlannedListener, Rank, firewall_rows, planned_ports, rank_ports
from atom_kv.testing.processes import REPO_ROOT
from atom_kv.wire import handshake_port


def cfg(**keys) -> KVTransferConfig:
    return KVTransferConfig.from_dict({"kv_role": "kv_producer", **keys})


def by_name(plan: list[PlannedListener]) -> dict[str, list[PlannedListener]]:
    out: dict[str, list[PlannedListener]] = {}
    for p in plan:
        out.setdefault(p.name, []).append(p)
    return out


@pytest.mark.parametrize("pp,dp,tp", [(1, 1, 1), (1, 1, 8), (1, 4, 2), (2, 2, 2), (4, 8, 8)])
def test_each_kind_is_a_block_at_its_slot_with_atoms_rank_offset(pp, dp, tp):
    base = 20000
    plan = by_name(planned_ports(cfg(handshake_port=base), pp_size=pp, dp_size=dp, tp_size=tp))
    assert set(plan) == {"handshake", "tcp", "cma", "gpu_ipc", "ucx"}  # a prefill engine under `auto`
    ranks = [Rank(*r) for r in itertools.product(range(pp), range(dp), range(tp))]
    for name, slot in (("handshake", 0), ("tcp", 1), ("cma", 2), ("gpu_ipc", 3)):
        assert [p.rank for p in plan[name]] == ranks
        for p in plan[name]:
            # the handshake block is exactly the side-channel layout consumers dial
            assert p.port == handshake_port(base, p.rank.dp, tp, p.rank.tp, pp_rank=p.rank.pp, dp_size=dp) + slot * STRIDE
        assert sorted(p.port for p in plan[name]) == list(range(base + slot * STRIDE, base + slot * STRIDE + pp * dp * tp))
    assert all(p.port == 0 for p in plan["ucx"])  # no range given: UCX's ports are OS-assigned


def test_engines_whose_handshake_ranges_do_not_overlap_have_disjoint_plans():
    prefill = {q for p in planned_ports(cfg(handshake_port=6301), dp_size=8, tp_size=8) for q in p.ports}
    decode = {q for p in planned_ports(cfg(handshake_port=6401, kv_role="kv_producer"), tp_size=8) for q in p.ports}
    assert len(prefill) == 4 * 64 and len(decode) == 4 * 8
    assert not prefill & decode


def test_an_own_key_moves_only_its_kind():
    plan = by_name(planned_ports(cfg(handshake_port=30000, tcp_port=31000, cma_grant_port=0), tp_size=2))
    assert [p.port for p in plan["handshake"]] == [30000, 30001]
    assert [p.port for p in plan["tcp"]] == [31000, 31001]
    assert [p.port for p in plan["cma"]] == [0, 0]  # 0: OS-assigned
    assert [p.port for p in plan["gpu_ipc"]] == [30000 + 3 * STRIDE, 30001 + 3 * STRIDE]
    assert plan["tcp"][1].describe() == "tcp listener of rank pp0/dp0/tp1 (`tcp_port` + 1)"


def test_handshake_port_0_makes_every_derived_port_os_assigned():
    plan = planned_ports(cfg(handshake_port=0, moriio_port=0), tp_size=4, dp_size=2)
    assert plan and all(p.port == 0 and not p.ports for p in plan)
    # an own key still places its kind
    plan = by_name(planned_ports(cfg(handshake_port=0, tcp_port=40000), tp_size=2))
    assert [p.port for p in plan["tcp"]] == [40000, 40001]
    assert [p.port for p in plan["handshake"]] == [0, 0]


@pytest.mark.parametrize("role,backend,kinds", [
    ("kv_producer", "auto", {"handshake", "tcp", "cma", "gpu_ipc", "ucx"}),
    ("kv_producer", "tcp", {"handshake", "tcp"}),
    ("kv_producer", "cma", {"handshake", "cma"}),
    ("kv_producer", "nixl", {"handshake", "ucx"}),
    ("kv_producer", "moriio", {"handshake", "moriio"}),
    ("kv_consumer", "auto", {"ucx"}),  # a decode engine serves nothing; UCX listens wherever it runs
    ("kv_consumer", "tcp", set()),
    ("kv_consumer", "moriio", {"moriio"}),
])
def test_only_the_listeners_a_role_and_backend_open_are_planned(role, backend, kinds):
    plan = planned_ports(KVTransferConfig.from_dict({"kv_role": role, "backend": backend}), tp_size=2)
    assert {p.name for p in plan} == kinds


def test_every_listener_kind_has_a_key_of_the_config():
    keys = set(KVTransferConfig.__struct_fields__)
    assert all(kind.key in keys for kind in LISTENERS)
    assert len({kind.name for kind in LISTENERS}) == len(LISTENERS)
    slots = [kind.slot for kind in LISTENERS if not kind.is_range]
    assert len(set(slots)) == len(slots)


@pytest.mark.parametrize("keys,words", [
    ({"handshake_port": 7000, "tcp_port": 7001}, ["handshake", "tcp", "`handshake_port`", "`tcp_port`", "7000..7003",
                                                  "7001..7004", "4 ranks"]),
    ({"tcp_port": 9000, "cma_grant_port": 9002}, ["`tcp_port`", "`cma_grant_port`", "overlap"]),
    ({"handshake_port": 32000, "backend": "nixl", "nixl_ucx_tcp_port_range": "31990-32000"},
     ["handshake", "ucx", "`nixl_ucx_tcp_port_range`", "overlap"]),
])
def test_colliding_blocks_are_refused_naming_both_keys(keys, words):
    with pytest.raises(ConfigError) as err:
        planned_ports(cfg(**keys), tp_size=4)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_blocks_past_65535_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"gpu_ipc ports \(`handshake_port` \+ 3000 = 65530.*set `gpu_ipc_grant_port`"):
        planned_ports(cfg(handshake_port=62530), tp_size=8)
    with pytest.raises(ConfigError, match=r"tcp ports \(`tcp_port` = 65534, one per rank, 4 ranks\) run past 65535"):
        planned_ports(cfg(handshake_port=1000, tcp_port=65534), tp_size=4)
    assert planned_ports(cfg(handshake_port=62530, gpu_ipc_grant_port=50000), tp_size=8)


def test_more_ranks_than_a_block_holds_are_refused():
    with pytest.raises(ConfigError, match=f"do not fit the port plan's blocks of {STRIDE} ports"):
        planned_ports(cfg(), pp_size=2, dp_size=32, tp_size=16)


def test_rank_ports_is_that_ranks_row_of_the_plan():
    c = cfg(handshake_port=21000)
    plan = planned_ports(c, pp_size=2, dp_size=2, tp_size=2)
    for pp, dp, tp in itertools.product(range(2), range(2), range(2)):
        mine = rank_ports(c, pp_rank=pp, dp_rank=dp, tp_rank=tp, pp_size=2, dp_size=2, tp_size=2)
        assert mine.rank == Rank(pp, dp, tp)
        assert {n: p.port for n, p in mine.listeners.items()} == {p.name: p.port for p in plan if p.rank == mine.rank}
    with pytest.raises(ValueError, match="listener 'no-such-listener' is not in atom_kv.ports.LISTENERS"):
        mine.port("no-such-listener")  # a new listener must be planned before it can bind
    assert rank_ports(cfg(backend="tcp")).port("cma") == 0  # planned kind, not opened here: the OS would pick


def test_ucx_range_is_one_range_for_every_rank():
    c = cfg(backend="nixl", nixl_ucx_tcp_port_range="40000-40099")
    plan = by_name(planned_ports(c, tp_size=2))
    assert [(p.port, p.ports[-1]) for p in plan["ucx"]] == [(40000, 40099), (40000, 40099)]
    assert rank_ports(c, tp_rank=1, tp_size=2).port_range("ucx") == (40000, 40099)
    assert ("ucx", "40000-40099") in [row[:2] for row in firewall_rows(plan["ucx"])]


@pytest.mark.parametrize("bad", ["40000-", "a-b", "5-4", "0-10", "1-70000", "1-2-3"])
def test_a_bad_ucx_range_is_refused_naming_the_key(bad):
    with pytest.raises(ConfigError, match="`nixl_ucx_tcp_port_range` must be a port range"):
        cfg(nixl_ucx_tcp_port_range=bad)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "*"])
def test_an_unspecified_advertise_host_is_refused(host):
    with pytest.raises(ConfigError) as err:
        cfg(advertise_host=host)
    assert str(err.value).startswith("kv-transfer-config: `advertise_host`")
    assert "unspecified" in str(err.value) and "\n" not in str(err.value)


def test_firewall_rows_merge_ranks_into_ranges():
    rows = {row.listener: row.ports for row in firewall_rows(planned_ports(cfg(handshake_port=6301), dp_size=2,
                                                                          tp_size=4, http_port=8100))}
    assert rows == {"http": "8100", "handshake": "6301-6308", "tcp": "7301-7308", "cma": "8301-8308",
                    "gpu_ipc": "9301-9308", "ucx": "OS-assigned (not planned)"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atom_kv.ports", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO_ROOT)


def test_the_cli_prints_the_plan_as_planned_ports_has_it():
    config = {"kv_role": "kv_producer", "backend": "tcp", "handshake_port": 6301}
    out = _cli("--kv-transfer-config", json.dumps(config), "--tp-size", "2", "--dp", "2", "--http-port", "8100",
               "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    expected = planned_ports(cfg(**config), dp_size=2, tp_size=2, http_port=8100)
    assert [(r["name"], r["rank"], r["port"]) for r in rows] == \
        [(p.name, None if p.rank is None else list(p.rank), p.port) for p in expected]
    table = _cli("--kv-transfer-config", json.dumps(config), "--tp", "2", "--dp", "2")
    assert table.returncode == 0 and "handshake  6301-6304" in table.stdout and "tcp        7301-7304" in table.stdout


def test_the_cli_refuses_a_colliding_plan_in_one_line():
    out = _cli("--kv-transfer-config", json.dumps({"kv_role": "kv_producer", "tcp_port": 6302}), "--tp", "2")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "`tcp_port`" in out.stderr and "`handshake_port`" in out.stderr


def test_the_cli_firewall_rows_say_who_must_reach_each_port():
    """deploy.md's table: the proxy reaches the engine's HTTP port and a prefill's handshake ports (releases)."""
    out = _cli("--kv-transfer-config", json.dumps({"kv_role": "kv_producer", "backend": "tcp"}), "--tp", "2",
               "--http-port", "8100")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# firewall"))
    rows = {line.split()[0]: line for line in lines[start + 1:]}
    assert "from the proxy:" in rows["http"]
    assert "6301-6302" in rows["handshake"] and "from decode engines, and the proxy (releases" in rows["handshake"]
    assert "from decode engines:" in rows["tcp"]


def test_a_collision_of_one_rank_is_counted_in_the_singular():
    with pytest.raises(ConfigError) as err:
        planned_ports(cfg(handshake_port=6301, tcp_port=6301))
    assert "overlap (1 rank);" in str(err.value) and "at least 1 port apart" in str(err.value)
    with pytest.raises(ConfigError) as err:
        planned_ports(cfg(handshake_port=6301, tcp_port=6302), tp_size=2)
    assert "overlap (2 ranks);" in str(err.value) and "at least 2 ports apart" in str(err.value)
