"""Reference engines as an operator runs them: a prefill/decode pair listens on exactly the ports
its plan names (read from /proc for each engine's process tree), and an engine binds one address
while advertising another, never an unspecified one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from atom_kv.testing.listeners import listeners
from atom_kv.config import AUTH_TOKEN_ENV, KVTransferConfig
from atom_kv.ports import planned_ports
from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.ports import free_plan_base
from atom_kv.testing.processes import REPO_ROOT
from atom_kv.testing.web import http_json
from atom_kv.transfer.cma.syscalls import cma_unavailable_reason

from .helpers import PROMPTS, generate

#: engines bind and advertise this address; their TP ranks' gloo store stays on 127.0.0.1
HOST = "127.0.0.2"
TOKEN = "port-plan-test-secret"


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except OSError:
                continue
    return out


def listening_ports(pids: list[int], host: str) -> set[int]:
    """Ports the processes ``pids`` listen on at ``host`` (IPv4)."""
    return {port for addr, port in listeners(pids, v6=False) if addr == host}


def test_a_pd_pair_listens_on_exactly_its_planned_ports():
    cma = cma_unavailable_reason() is None
    with Cluster([EngineSpec("P", tp=2), EngineSpec("D", tp=1)], engine_host=HOST) as cluster:
        result = generate(cluster.proxy_url, PROMPTS[1], chat=False, stream=False)
        assert result.status == 200 and result.error is None, result.error  # KV was read: every listener was used
        for i, spec in enumerate(cluster.specs):
            cfg = KVTransferConfig.from_dict(json.loads(cluster._configs[i][1]))
            plan = planned_ports(cfg, tp_size=spec.tp, dp_size=spec.dp, http_port=cluster.ports[i])
            opened = {"http"} | ({"handshake", "tcp"} | ({"cma"} if cma else set()) if spec.role == "P" else set())
            expected = {p.port for p in plan if p.name in opened}
            assert all(port for port in expected)  # every one planned, none OS-assigned
            assert listening_ports(process_tree(cluster.engines[i].pid), HOST) == expected, spec.role
            # and the plan is what the handshake port layout and the HTTP port say
            if spec.role == "P":
                assert {p.port for p in plan if p.name == "handshake"} == \
                    {cfg.handshake_port, cfg.handshake_port + 1}


def _engine(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    config = {"kv_role": "kv_producer", "handshake_port": 0}  # the token from the variable: no inline warning
    return subprocess.run([sys.executable, "-m", "atom_kv.reference", "--port", "0", "--kv-transfer-config",
                           json.dumps(config), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
                          env={**os.environ, AUTH_TOKEN_ENV: TOKEN})


def test_an_unspecified_address_is_refused_in_one_line_naming_advertise_host():
    for args in (["--host", "0.0.0.0"], ["--host", "::"], ["--advertise-host", "0.0.0.0"]):
        out = _engine(*args)
        assert out.returncode == 2, out.stderr
        assert out.stderr.count("\n") == 1, out.stderr
        assert "unspecified address" in out.stderr and "set --advertise-host" in out.stderr, out.stderr


def test_an_engine_bound_to_every_interface_advertises_its_advertise_host():
    spec = EngineSpec("P", extra_config={"auth_token": TOKEN},
                      extra_args=["--host", "0.0.0.0", "--advertise-host", "127.0.0.1"])
    decode = EngineSpec("D", extra_config={"auth_token": TOKEN})
    with Cluster([spec, decode], proxy_args=["--registration-token", TOKEN]) as cluster:
        pid = cluster.engines[0].pid
        assert cluster.ports[0] in listening_ports(process_tree(pid), "0.0.0.0")  # bound: every interface
        # the registration ping names the advertise address
        status, body = http_json("GET", cluster.proxy_url + "/instances", timeout=10)
        assert status == 200
        text = json.dumps(body)
        assert f"http://127.0.0.1:{cluster.ports[0]}" in text and "0.0.0.0" not in text, text
        # and so does the prefill's kv_transfer_params
        status, reply = http_json("POST", cluster.engine_url(0) + "/v1/completions", {
            "model": "atom-kv-tiny", "prompt": PROMPTS[0], "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t-advertise"}}, timeout=60)
        assert status == 200, reply
        assert reply["kv_transfer_params"]["remote_host"] == "127.0.0.1"


def test_a_busy_planned_port_stops_the_engine_in_one_line_naming_the_key():
    base = free_plan_base(2, blocks=2)
    taken = base + 1000 + 1  # rank tp1's tcp read server
    config = {"kv_role": "kv_producer", "backend": "tcp", "handshake_port": base}
    with socket.create_server(("127.0.0.1", taken)):
        out = subprocess.run([sys.executable, "-m", "atom_kv.reference", "--port", "0", "--tp", "2",
                              "--log-level", "WARNING", "--kv-transfer-config", json.dumps(config)],
                             capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 1
    failed = [line for line in out.stderr.splitlines() if "engine failed" in line]
    assert len(failed) == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"`tcp_port`: port {taken} on 127.0.0.1 is already in use" in failed[0]
    assert "tcp listener of rank pp0/dp0/tp1 (`tcp_port` + 1)" in failed[0]


def test_advertise_host_given_twice_differently_is_refused(capsys):
    from atom_kv.reference.__main__ import main

    config = {"kv_role": "kv_producer", "advertise_host": "127.0.0.2"}
    assert main(["--advertise-host", "127.0.0.1", "--kv-transfer-config", json.dumps(config)]) == 2
    assert capsys.readouterr().err == ("error: --advertise-host 127.0.0.1 and the config's `advertise_host` 127.0.0.2 "
                                       "disagree; give one of them\n")
