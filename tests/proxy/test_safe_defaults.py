"""Safe by default: with no flags the proxy listens on loopback only, open registration off loopback
is refused unless the operator names it, and open registration is always announced in the log."""

from __future__ import annotations

import pytest

from atom_kv.proxy.settings import ProxySettings, is_loopback
from tests.proxy.procs import ProxyProcess
from tests.proxy.test_cli import _run


def test_no_flags_listens_on_loopback_only_and_warns_that_registration_is_open():
    proxy = ProxyProcess(host=None)  # no --host at all
    try:
        text = "".join(proxy.lines)
        assert "proxy ready on http://127.0.0.1:" in text
        assert "discovery listening on tcp://127.0.0.1:" in text
        warnings = [line for line in proxy.lines if "REGISTRATION IS OPEN" in line]
        assert len(warnings) == 1 and "WARNING" in warnings[0] and "--registration-token" in warnings[0]
    finally:
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
