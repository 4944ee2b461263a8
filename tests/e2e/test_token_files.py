"""Tokens off the command line, end to end: a real proxy and real reference engines that take the cluster
secret from a file (mode 0600) or ``ATOM_KV_AUTH_TOKEN`` register with signed pings and move KV through the
authenticated handshake, while no process list shows the secret. A file others may read, or an empty one,
stops an engine in one line; ``auth_token`` inline still works, with one warning naming ``auth_token_file``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from atom_kv.config import AUTH_TOKEN_ENV
from atom_kv.testing.cluster import Cluster, EngineSpec
from atom_kv.testing.polling import wait_until
from atom_kv.testing.ports import free_plan_base
from atom_kv.testing.processes import REPO_ROOT, ManagedProcess
from atom_kv.testing.token_files import write_token_file
from atom_kv.testing.web import http_json, scrape_metrics
from tests.proxy.procs import ProxyProcess

from .helpers import PROMPTS, generate
from .test_port_plan import process_tree

TOKEN = "e2e-token-file-secret-0123456789abcdef"
INLINE = "given inline is visible to every user of this host"


def _cmdlines(pid: int) -> list[str]:
    out = []
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                out.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue  # gone meanwhile
    return out


def test_a_cluster_on_a_token_file_registers_signed_moves_kv_and_shows_no_secret(tmp_path):
    cluster = Cluster([EngineSpec("P", num_blocks=64, backend="tcp"), EngineSpec("D", num_blocks=64, backend="tcp")],
                      token=TOKEN, log_dir=str(tmp_path))
    with cluster:  # the proxy refuses unsigned pings: both engines registered by proving the file's token
        assert cluster.token_file is not None and os.stat(cluster.token_file).st_mode & 0o777 == 0o600
        d = cluster.index_of("D")
        before = scrape_metrics(cluster.engine_url(d) + "/metrics").get("atom_kv_transfer_bytes", 0.0)
        res = generate(cluster.proxy_url, PROMPTS[1], chat=False, stream=False, max_tokens=4)
        assert res.status == 200 and res.error is None, res
        after = scrape_metrics(cluster.engine_url(d) + "/metrics").get("atom_kv_transfer_bytes", 0.0)
        assert after > before  # read from the prefill engine after the handshake's challenge-response
        for proc in (cluster.proxy, *cluster.engines):
            cmdlines = _cmdlines(proc.pid)
            assert cmdlines and any(cluster.token_file in c for c in cmdlines[:1]), (proc.name, cmdlines)
            assert not [c for c in cmdlines if TOKEN in c], proc.name
            assert INLINE not in proc.log_text(), proc.name


def _reference(config: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atom_kv.reference", "--port", "0", "--kv-transfer-config",
                           json.dumps(config), *args], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": REPO_ROOT})


def _one_line_refusal(config: dict) -> str:
    out = _reference(config)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_an_engine_refuses_an_open_or_empty_token_file_in_one_line(tmp_path):
    path = write_token_file(str(tmp_path / "token"), TOKEN)
    os.chmod(path, 0o644)
    assert _one_line_refusal({"kv_role": "kv_producer", "auth_token_file": path}) == (
        f"error: kv-transfer-config: `auth_token_file`: {path} is readable by group or others (mode 0644); "
        "chmod 600 it")
    empty = write_token_file(str(tmp_path / "empty"), "")
    assert _one_line_refusal({"kv_role": "kv_producer", "auth_token_file": empty}).startswith(
        f"error: kv-transfer-config: `auth_token_file`: {empty} is empty; put a token in it: (umask 077;")
    os.chmod(path, 0o600)
    line = _one_line_refusal({"kv_role": "kv_producer", "auth_token_file": path, "auth_token": TOKEN})
    assert "`auth_token` and `auth_token_file` are both given" in line


def test_an_inline_auth_token_still_works_with_one_warning_naming_the_file_key():
    # --port 70000 stops the engine right after it read its config: the warning came first
    out = _reference({"kv_role": "kv_producer", "auth_token": TOKEN}, "--port", "70000")
    assert out.returncode == 2, out.stderr
    warnings = [line for line in out.stderr.splitlines() if INLINE in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "use `auth_token_file` instead" in warnings[0]
    assert TOKEN not in out.stderr


def test_an_engine_takes_the_token_from_the_variable(tmp_path, monkeypatch):
    token_file = write_token_file(str(tmp_path / "proxy-token"), TOKEN)
    proxy = ProxyProcess("--registration-token-file", token_file)
    engine = None
    try:
        monkeypatch.setenv(AUTH_TOKEN_ENV, TOKEN)  # the engine's environment, not its command line
        cfg = {"kv_role": "kv_producer", "backend": "tcp", "handshake_port": free_plan_base(1),
               "proxy_ip": f"127.0.0.1:{proxy.discovery_port}", "ping_interval_s": 0.5}
        engine = ManagedProcess("engine", [
            sys.executable, "-m", "atom_kv.reference", "--host", "127.0.0.1", "--port", "0", "--tp", "1",
            "--num-blocks", "16", "--log-level", "INFO", "--kv-transfer-config", json.dumps(cfg)], str(tmp_path))

        def registered() -> bool:
            if not engine.alive():
                raise AssertionError(f"the engine exited:\n{engine.tail()}")
            status, body = http_json("GET", proxy.url + "/health", timeout=2.0)
            return isinstance(body, dict) and body.get("prefill") == 1

        wait_until(registered, 60, what="the engine to register with the variable's token")
        assert not [c for c in _cmdlines(engine.pid) if TOKEN in c]
        assert INLINE not in engine.log_text()
    finally:
        if engine is not None:
            engine.stop()
        proxy.kill()
