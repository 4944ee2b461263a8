"""Safe by default: with no flags the proxy listens on loopback only and refuses every registration (loopback
is no trust boundary) until given a token or --allow-open-registration; open registration off loopback is
refused at start unless the operator names it, and open registration is always announced in the log."""

from __future__ import annotations

import pytest
import zmq

from atom_kv.proxy.settings import ProxySettings, is_loopback
from atom_kv.testing.web import http_json as http
from atom_kv.wire import RegisterAnswer, RegisterPing, decode, encode
from tests.proxy.procs import ProxyProcess
from tests.proxy.test_cli import _run


def test_no_flags_listens_on_loopback_only_and_refuses_registration_saying_how_to_enable_it():
    proxy = ProxyProcess(host=None)  # no --host at all
    try:
        text = "".join(proxy.lines)
        assert "proxy ready on http://127.0.0.1:" in text
        assert "discovery listening on tcp://127.0.0.1:" in text
        warnings = [line for line in proxy.lines if "REGISTRATION IS REFUSED" in line]
        assert len(warnings) == 1 and "WARNING" in warnings[0]
        assert "--registration-token" in warnings[0] and "--allow-open-registration" in warnings[0]
        assert "REGISTRATION IS OPEN" not in text
    finally:
        proxy.kill()


def test_open_registration_on_loopback_needs_the_operators_flag_and_is_announced():
    proxy = ProxyProcess("--allow-open-registration")
    try:
        warnings = [line for line in proxy.lines if "REGISTRATION IS OPEN" in line]
        assert len(warnings) == 1 and "WARNING" in warnings[0] and "--registration-token" in warnings[0]
        assert "REGISTRATION IS REFUSED" not in "".join(proxy.lines)
    finally:
        proxy.kill()


def test_without_token_or_flag_a_loopback_ping_is_refused_and_its_sender_told_why():
    """Loopback is no trust boundary: a local process's unsigned ping registers nothing, is counted, and a
    sender that asks for an answer learns the reason."""
    proxy = ProxyProcess()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(proxy.discovery)
        sock.send(encode(RegisterPing(role="D", index="0", request_address="http://127.0.0.1:1/v1/completions",
                                      handshake_port=1, answers=True)))
        assert sock.poll(10_000), "no answer"
        answer = decode(sock.recv(), RegisterAnswer)
        assert (answer.status, answer.reason) == ("refused", "token")
        assert "--registration-token" in answer.detail and "--allow-open-registration" in answer.detail
        assert http("GET", proxy.url + "/instances") == (200, [])
        _, metrics = http("GET", proxy.url + "/metrics")
        assert 'atom_kv_proxy_rejected_registrations_total{reason="open"} 1.0' in metrics
    finally:
        sock.close(0)
        ctx.term()
        proxy.kill()


@pytest.mark.parametrize("args", [("--host", "0.0.0.0"), ("--discovery-host", "0.0.0.0")])
def test_open_registration_off_loopback_is_refused_in_one_line(args):
    res = _run(*args, "--port", "0", "--discovery-port", "0")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert "--registration-token" in last and "--allow-open-registration" in last


def test_open_registration_off_loopback_needs_the_operators_flag():
    with pytest.raises(ValueError, match="registration_token"):
        ProxySettings(host="10.0.0.9")
    ProxySettings(host="10.0.0.9", allow_open_registration=True)
    ProxySettings(host="10.0.0.9", registration_token="t")
    ProxySettings(host="10.0.0.9", discovery=False)
    ProxySettings(host="10.0.0.9", discovery_host="127.0.0.1")
    assert ProxySettings().host == "127.0.0.1"


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("127.1.2.3") and is_loopback("::1") and is_loopback("localhost")
    for host in ("0.0.0.0", "", "::", "10.0.0.9", "example.com"):
        assert not is_loopback(host), host
