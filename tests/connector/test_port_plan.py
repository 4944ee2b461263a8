"""Real connector ranks bind exactly their port plan (``atom_kv.ports``) and advertise an address
apart from the one they bind: ports read back from /proc, busy ports refused in one line naming
the key, ``handshake_port`` 0 for OS-assigned ports, a decode rank listening on nothing."""

from __future__ import annotations

import socket

import pytest

from atom_kv.testing.listeners import listeners
from atom_kv import engine_hooks, wire
from atom_kv.config import ConfigError
from atom_kv.ports import PortInUse, planned_ports
from atom_kv.testing.ports import free_plan_base
from atom_kv.transfer.cma.syscalls import cma_unavailable_reason

from .kvutil import OS_ASSIGNED, compat, make_caches
from .kvutil import config as _config

CMA = cma_unavailable_reason() is None


def config(role: str, port: int, **keys):
    """The test config with every listener on its planned port."""
    return _config(role, port, **{**{key: None for key in OS_ASSIGNED}, **keys})


def listening() -> set[tuple[str, int]]:
    """(address, port) of every socket this process listens on (IPv4, from /proc)."""
    return listeners(v6=False)


def worker(cfg, tp_rank: int, tp_size: int, *, host: str = "127.0.0.1", **kw):
    w = engine_hooks.build_worker_hooks(cfg, engine_id="e", host=host, tp_rank=tp_rank, tp_size=tp_size,
                                        compat=compat(), **kw)
    try:
        w.register_kv_caches(make_caches(4, tp_rank, tp_size, fill=True))
    except BaseException:
        w.close()
        raise
    return w


@pytest.mark.parametrize("backend", ["auto", "tcp"])
def test_prefill_ranks_listen_on_exactly_their_planned_ports(backend):
    tp = 2
    cfg = config("kv_producer", free_plan_base(tp, blocks=3), backend=backend)
    before = listening()
    workers = []
    try:
        for r in range(tp):
            workers.append(worker(cfg, r, tp))
        opened = listening() - before
        wanted = {"handshake", "tcp"} | ({"cma"} if CMA and backend == "auto" else set())
        plan = {("127.0.0.1", p.port) for p in planned_ports(cfg, tp_size=tp) if p.name in wanted}
        assert opened == plan
    finally:
        for w in workers:
            w.close()
    assert not (listening() - before)  # closed: every port given back


def test_a_decode_rank_listens_on_nothing():
    before = listening()
    w = worker(config("kv_consumer", free_plan_base(1)), 0, 1)
    try:
        assert listening() - before == set()
    finally:
        w.close()


def test_handshake_port_0_lets_the_os_pick_every_port():
    before = listening()
    workers = [worker(config("kv_producer", 0, backend="tcp"), r, 2) for r in range(2)]
    try:
        ports = {w.handshake_server.port for w in workers}
        assert len(ports) == 2 and 0 not in ports
        descriptors = [wire.decode(w.backend.export_descriptor(), wire.TcpDescriptor) for w in workers]
        assert len({d.port for d in descriptors}) == 2 and all(d.port > 1024 for d in descriptors)
        assert {p for _, p in listening() - before} == ports | {d.port for d in descriptors}
    finally:
        for w in workers:
            w.close()


@pytest.mark.parametrize("kind,key,slot", [("handshake", "handshake_port", 0), ("tcp", "tcp_port", 1)])
def test_a_busy_planned_port_fails_at_start_in_one_line_naming_the_key(kind, key, slot):
    base = free_plan_base(2, blocks=2)
    cfg = config("kv_producer", base, backend="tcp")
    taken = base + slot * 1000 + 1  # rank tp1's port of this kind
    holder = socket.create_server(("127.0.0.1", taken))
    try:
        first = worker(cfg, 0, 2)  # rank 0's ports are free
        try:
            with pytest.raises(PortInUse) as err:
                worker(cfg, 1, 2)
        finally:
            first.close()
    finally:
        holder.close()
    message = str(err.value)
    assert "\n" not in message
    assert f"`{key}`: port {taken} on 127.0.0.1 is already in use" in message
    assert f"{kind} listener of rank pp0/dp0/tp1 (`{key}` + 1)" in message


def test_listeners_bind_one_address_and_descriptors_advertise_another():
    cfg = config("kv_producer", free_plan_base(1, blocks=2), backend="tcp", advertise_host="127.0.0.1",
                 bind_host="127.0.0.2")
    before = listening()
    w = worker(cfg, 0, 1, host="10.255.255.1")  # the engine's own guess: overridden by the config
    try:
        assert (w.host, w.bind_host) == ("127.0.0.1", "127.0.0.2")
        assert {a for a, _ in listening() - before} == {"127.0.0.2"}
        assert wire.decode(w.backend.export_descriptor(), wire.TcpDescriptor).host == "127.0.0.1"
    finally:
        w.close()
    sched = engine_hooks.build_scheduler_hooks(cfg, engine_id="e", host="10.255.255.1", tp_size=1, block_size=16)
    assert sched.host == "127.0.0.1"


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_an_unspecified_engine_address_is_refused_unless_advertise_host_is_set(host):
    cfg = config("kv_producer", free_plan_base(1, blocks=2), backend="tcp")
    with pytest.raises(ConfigError, match="the engine's address .* is an unspecified address.*set `advertise_host`"):
        engine_hooks.build_scheduler_hooks(cfg, engine_id="e", host=host, tp_size=1, block_size=16)
    with pytest.raises(ConfigError, match="set `advertise_host`"):
        worker(cfg, 0, 1, host=host)
    ok = config("kv_producer", free_plan_base(1, blocks=2), backend="tcp", advertise_host="127.0.0.1",
                bind_host="127.0.0.1")
    w = worker(ok, 0, 1, host=host)  # the engine's 0.0.0.0 stays its own: the config says what to advertise
    try:
        assert w.host == "127.0.0.1"
    finally:
        w.close()


def test_listeners_beyond_loopback_need_the_token_or_the_operators_word():
    base = free_plan_base(1, blocks=2)
    open_cfg = config("kv_producer", base, backend="tcp", advertise_host="127.0.0.1", bind_host="0.0.0.0")
    with pytest.raises(ConfigError) as err:
        worker(open_cfg, 0, 1, host="127.0.0.1")
    message = str(err.value)
    assert "\n" not in message and "'0.0.0.0'" in message
    assert "`auth_token`" in message and "`allow_open_listeners: true`" in message
    for allowed in (dict(auth_token="listeners-secret"), dict(allow_open_listeners=True)):
        cfg = config("kv_producer", base, backend="tcp", advertise_host="127.0.0.1", bind_host="0.0.0.0", **allowed)
        w = worker(cfg, 0, 1, host="127.0.0.1")
        try:
            assert w.bind_host == "0.0.0.0"
        finally:
            w.close()
    w = worker(config("kv_producer", base, backend="tcp", bind_host="127.0.0.2"), 0, 1, host="127.0.0.1")
    w.close()  # all of 127.0.0.0/8 is loopback: no token needed there
