"""``--log-format json`` on a real proxy process in front of the fake engines: every line it writes is one
JSON object with ``ts`` (RFC 3339, UTC, milliseconds), ``level``, ``logger`` and ``msg``; the lines about a
request carry its id, the lines about an engine its instance; text stays the default; a bad value is
refused in one line by both command lines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from atom_kv.testing.polling import wait_until
from atom_kv.testing.ports import free_port_range
from atom_kv.testing.web import http_json
from tests.proxy.procs import ENV, ROOT, FakeEngines, ProxyProcess

TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
REQUIRED = ("ts", "level", "logger", "msg")


def parse_json_lines(text: str) -> list[dict]:
    """Every line of ``text`` as a JSON object with the required keys (the assertion names the first that is not)."""
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        record = json.loads(line)  # raises on a line that is not JSON: the test fails naming it
        assert isinstance(record, dict), (n, line)
        assert all(isinstance(record.get(k), str) for k in REQUIRED), (n, line)
        assert TS.match(record["ts"]), (n, line)
        records.append(record)
    return records


@pytest.fixture(scope="module")
def engines():
    e = FakeEngines()
    yield e
    e.stop()


def test_every_proxy_line_is_json_with_the_request_id_and_the_instance(engines):
    prefill, decode = engines.prefill[0], engines.decode[0]
    silent = f"http://127.0.0.1:{free_port_range(1)}"  # nobody listens: its probe logs that it is starting
    proxy = ProxyProcess("--no-discovery", "--prefill", prefill, "--decode", decode, "--decode", silent,
                         "--log-format", "json", "--log-level", "DEBUG")
    try:
        wait_until(lambda: http_json("GET", proxy.url + "/health", timeout=5)[0] == 200, 15, interval=0.1,
                   what="the proxy's /health")
        ok, _ = http_json("POST", proxy.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                          headers={"X-Request-Id": "json-log-ok"})
        bad, _ = http_json("POST", proxy.url + "/v1/completions", {"prompt": "hi", "max_tokens": "two"},
                           headers={"X-Request-Id": "json-log-bad"})
        assert (ok, bad) == (200, 400)
        assert proxy.terminate() == 0
        records = parse_json_lines(proxy.stderr_rest())
    finally:
        proxy.kill()
    assert any(r["msg"].startswith("proxy ready on http://") for r in records), records
    for rid in ("json-log-ok", "json-log-bad"):
        about = [r for r in records if rid in r["msg"]]
        assert about, (rid, records)
        assert all(r.get("request_id") == rid for r in about), about
    assert any(r.get("request_id") == "json-log-bad" and r["level"] == "INFO" and "-> 400" in r["msg"]
               for r in records), records
    assert not any("request_id" in r for r in records if r["msg"].startswith(("proxy ready", "proxy stopped")))
    starting = [r for r in records if f"instance {silent} is starting" in r["msg"]]  # logged by its probe's task
    assert starting and all(r.get("instance") == silent for r in starting), records


def test_text_stays_the_default(engines):
    proxy = ProxyProcess("--no-discovery", "--prefill", engines.prefill[0], "--decode", engines.decode[0])
    try:
        assert proxy.terminate() == 0
        lines = proxy.stderr_rest().splitlines()
    finally:
        proxy.kill()
    assert any("INFO atom_kv.proxy.app: proxy ready on http://" in line for line in lines), lines
    for line in lines:
        with pytest.raises(ValueError):
            json.loads(line)


@pytest.mark.parametrize(("module", "prog"), [("atom_kv.proxy", "atom-kv-proxy"),
                                              ("atom_kv.reference", "python -m atom_kv.reference")])
def test_a_bad_log_format_is_refused_in_one_line(module, prog):
    res = subprocess.run([sys.executable, "-m", module, "--log-format", "xml"], cwd=ROOT,
                         env=dict(ENV, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"{prog}: error: ") and line.endswith(f"(see {prog} --help)"), line
    assert "--log-format" in line and "must be text or json, got 'xml'" in line, line
