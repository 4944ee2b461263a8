"""The proxy's tokens off the command line, as a real subprocess: ``--registration-token-file`` and
``--admin-token-file``, ``ATOM_KV_REGISTRATION_TOKEN`` and ``ATOM_KV_ADMIN_TOKEN``; refusals in one line; the
inline flags still work, with one warning each naming the file flag."""

from __future__ import annotations

import os
import subprocess
import sys

from atom_kv.proxy.token_flags import ADMIN_TOKEN_ENV, REGISTRATION_TOKEN_ENV
from atom_kv.testing.polling import wait_until
from atom_kv.testing.token_files import write_token_file
from atom_kv.testing.web import http_json as http
from tests.proxy.procs import ENV, ROOT, FakeEngines, ProxyProcess

TOKEN = "proxy-file-secret-0123456789"
ADMIN = "admin-file-secret-9876543210"
INLINE = "given inline is visible to every user of this host"


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _signed_engines_register_and_admin_routes_need_the_admin_token(proxy: ProxyProcess) -> None:
    engines = FakeEngines("--discovery", proxy.discovery, "--ping-interval", "0.2", "--auth-token", TOKEN)
    try:
        wait_until(lambda: http("GET", proxy.url + "/health")[0] == 200, 10, interval=0.05,
                   what="the signed engines to register")
        assert http("GET", proxy.url + "/instances")[0] == 401
        status, listing = http("GET", proxy.url + "/instances", headers={"Authorization": f"Bearer {ADMIN}"})
        assert status == 200 and len(listing) == 2
    finally:
        engines.stop()


def test_token_files_work_and_keep_both_tokens_out_of_the_process_list(tmp_path):
    registration = write_token_file(str(tmp_path / "registration"), TOKEN)
    admin = write_token_file(str(tmp_path / "admin"), ADMIN)
    proxy = ProxyProcess("--registration-token-file", registration, "--admin-token-file", admin)
    try:
        _signed_engines_register_and_admin_routes_need_the_admin_token(proxy)
        cmdline = _cmdline(proxy.proc.pid)
        assert registration in cmdline and TOKEN not in cmdline and ADMIN not in cmdline
        assert not [line for line in proxy.lines if INLINE in line]
    finally:
        proxy.kill()


def test_the_variables_give_the_tokens_when_no_flag_does():
    proxy = ProxyProcess(env={REGISTRATION_TOKEN_ENV: TOKEN, ADMIN_TOKEN_ENV: ADMIN})
    try:
        _signed_engines_register_and_admin_routes_need_the_admin_token(proxy)
        assert TOKEN not in _cmdline(proxy.proc.pid)
    finally:
        proxy.kill()


def _refused(*args: str, env: dict[str, str] | None = None) -> str:
    res = subprocess.run([sys.executable, "-m", "atom_kv.proxy", "--port", "0", "--discovery-port", "0", *args],
                         cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=20)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


def test_a_token_file_others_may_read_an_empty_one_or_two_sources_stop_the_proxy_in_one_line(tmp_path):
    path = write_token_file(str(tmp_path / "token"), TOKEN)
    os.chmod(path, 0o644)
    assert _refused("--registration-token-file", path) == (
        f"atom-kv-proxy: --registration-token-file: {path} is readable by group or others (mode 0644); "
        "chmod 600 it")
    assert _refused("--admin-token-file", path).startswith(f"atom-kv-proxy: --admin-token-file: {path} is readable")
    os.chmod(path, 0o600)
    assert _refused("--registration-token-file", path, "--registration-token", TOKEN).startswith(
        "atom-kv-proxy: --registration-token and --registration-token-file are both given; give one of them")
    empty = str(tmp_path / "empty")
    write_token_file(empty, "")  # a newline alone
    assert _refused("--registration-token-file", empty) == (
        f"atom-kv-proxy: --registration-token-file: {empty} is empty; put a token in it: "
        f"(umask 077; openssl rand -hex 32 > {empty})")
    assert _refused(env={ADMIN_TOKEN_ENV: ""}) == (
        f"atom-kv-proxy: {ADMIN_TOKEN_ENV} is set but empty; unset it, or set it to the token")


def test_inline_tokens_still_work_with_one_warning_each_naming_the_file_flag():
    proxy = ProxyProcess("--registration-token", TOKEN, "--admin-token", ADMIN)
    try:
        _signed_engines_register_and_admin_routes_need_the_admin_token(proxy)
        warnings = [line for line in proxy.lines if INLINE in line]
        assert len(warnings) == 2, warnings
        assert "WARNING" in warnings[0] and "use --registration-token-file instead" in warnings[0]
        assert "WARNING" in warnings[1] and "use --admin-token-file instead" in warnings[1]
        assert not any(TOKEN in line or ADMIN in line for line in proxy.lines)
    finally:
        proxy.kill()


def test_the_file_flags_set_the_settings_they_name(tmp_path):
    from atom_kv.proxy.__main__ import build_parser, settings_from_args

    path = write_token_file(str(tmp_path / "token"), TOKEN)
    args = build_parser().parse_args(["--registration-token-file", path, "--admin-token-file", path])
    settings = settings_from_args(args)
    assert (settings.registration_token, settings.admin_token) == (TOKEN, TOKEN)
    assert settings_from_args(args) == settings  # the parsed flags are left as they were
