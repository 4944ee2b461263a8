"""Tokens off the command line: a token file read as ssh reads a key, the environment variable, the one
precedence rule, and the engines' ``auth_token_file`` key (each refusal one line naming the key or flag)."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from atom_kv.config import AUTH_TOKEN_ENV, ConfigError, KVTransferConfig, parse_kv_transfer_config
from atom_kv.token_sources import (
    MAX_TOKEN_FILE_BYTES,
    TokenSource,
    TokenSourceError,
    read_token_file,
    resolve_token,
)
from atom_kv.testing.token_files import write_token_file

OPTION = "--some-token-file"


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch):
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)


def _file(tmp_path, content: bytes, mode: int = 0o600, name: str = "token") -> str:
    path = tmp_path / name
    path.write_bytes(content)
    os.chmod(path, mode)
    return str(path)


def _refusal(path: str) -> str:
    with pytest.raises(TokenSourceError) as info:
        read_token_file(path, OPTION)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{OPTION}: {path} "), message
    return message


def test_a_token_file_gives_its_one_line_without_the_trailing_newline(tmp_path):
    assert read_token_file(_file(tmp_path, b"s3cret\n"), OPTION) == "s3cret"
    assert read_token_file(_file(tmp_path, b"s3cret"), OPTION) == "s3cret"
    assert read_token_file(_file(tmp_path, b"s3cret\r\n"), OPTION) == "s3cret"
    assert read_token_file(_file(tmp_path, b" spaced token "), OPTION) == " spaced token "  # only a newline goes
    assert read_token_file(_file(tmp_path, b"x" * MAX_TOKEN_FILE_BYTES), OPTION) == "x" * MAX_TOKEN_FILE_BYTES


def test_a_file_group_or_others_may_open_is_refused_as_ssh_does(tmp_path):
    for mode, what in ((0o644, "readable"), (0o640, "readable"), (0o604, "readable"), (0o620, "writable"),
                       (0o601, "writable")):
        path = _file(tmp_path, b"s3cret\n", mode, name=f"token-{mode:o}")
        assert _refusal(path) == (f"{OPTION}: {path} is {what} by group or others (mode {mode:04o}); "
                                  "chmod 600 it")
    assert read_token_file(_file(tmp_path, b"s3cret\n", 0o400, name="read-only"), OPTION) == "s3cret"


def test_an_empty_file_is_refused_with_how_to_fill_it(tmp_path):
    for content in (b"", b"\n", b"\r\n"):
        path = _file(tmp_path, content)
        assert _refusal(path) == (f"{OPTION}: {path} is empty; put a token in it: "
                                  f"(umask 077; openssl rand -hex 32 > {path})")


def test_anything_but_one_line_of_text_is_refused(tmp_path):
    assert "more than one line" in _refusal(_file(tmp_path, b"s3cret\n\n"))
    assert "more than one line" in _refusal(_file(tmp_path, b"one\ntwo\n"))
    assert "not UTF-8" in _refusal(_file(tmp_path, b"\xff\xfe\n"))
    assert f"larger than {MAX_TOKEN_FILE_BYTES} bytes" in _refusal(_file(tmp_path, b"x" * (MAX_TOKEN_FILE_BYTES + 1)))


def test_a_missing_path_a_directory_and_a_fifo_are_refused_without_waiting(tmp_path):
    missing = str(tmp_path / "nowhere")
    assert _refusal(missing) == (f"{OPTION}: {missing} does not exist; create it with: "
                                 f"(umask 077; openssl rand -hex 32 > {missing})")
    assert "not a regular file" in _refusal(str(tmp_path))
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo, 0o600)
    outcome: list[str] = []
    reader = threading.Thread(target=lambda: outcome.append(_refusal(fifo)), name="test-fifo-reader", daemon=True)
    reader.start()
    reader.join(10)
    assert outcome and "not a regular file" in outcome[0]  # no writer, yet the open did not block


def test_write_token_file_makes_a_file_the_reader_accepts(tmp_path):
    path = str(tmp_path / "token")
    _file(tmp_path, b"old", 0o644)
    write_token_file(path, "fresh")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert read_token_file(path, OPTION) == "fresh"


def test_one_rule_inline_or_file_never_both_either_over_the_variable(tmp_path):
    path = _file(tmp_path, b"from-file\n")
    names = dict(inline_name="--t", file_name="--t-file", env="T_ENV")
    with pytest.raises(TokenSourceError, match=r"^--t and --t-file are both given; give one of them"):
        resolve_token(inline="x", file=path, environ={}, **names)
    env = {"T_ENV": "from-env"}
    assert resolve_token(inline=None, file=path, environ=env, **names).value == "from-file"
    assert resolve_token(inline="inline", file=None, environ=env, **names).value == "inline"
    got = resolve_token(inline=None, file=None, environ=env, **names)
    assert (got.value, got.source) == ("from-env", TokenSource.ENV)
    assert resolve_token(inline=None, file=None, environ={}, **names).source is TokenSource.NONE
    with pytest.raises(TokenSourceError, match=r"^T_ENV is set but empty; unset it"):
        resolve_token(inline=None, file=None, environ={"T_ENV": ""}, **names)


# --- the engines' config ----------------------------------------------------------------------------
def _config_error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        KVTransferConfig.from_dict({"kv_role": "kv_producer", **data})
    message = str(info.value)
    assert "\n" not in message and message.startswith("kv-transfer-config: "), message
    return message


def test_auth_token_file_gives_the_engines_token_and_stays_off_the_serialized_secret_path(tmp_path, caplog):
    path = _file(tmp_path, b"cluster-secret\n")
    with caplog.at_level(logging.WARNING, logger="atom_kv.config"):
        cfg = parse_kv_transfer_config(f'{{"kv_role": "kv_consumer", "auth_token_file": "{path}"}}')
        assert (cfg.auth_token, cfg.auth_token_file) == ("cluster-secret", path)
        # a rank's process gets the resolved config back: the same token, nothing read again, no warning
        os.chmod(path, 0o644)
        again = KVTransferConfig.from_resolved(cfg.to_dict())
    assert (again.auth_token, again.auth_token_file) == ("cluster-secret", path)
    assert caplog.records == []
    # ATOM's and vLLM's adapters hand over kv_connector_extra_config: the key works there too
    os.chmod(path, 0o600)
    nested = KVTransferConfig.from_dict({"kv_role": "kv_producer", "kv_connector_extra_config": {
        "auth_token_file": path}})
    assert nested.auth_token == "cluster-secret"


def test_auth_token_file_refusals_name_the_key(tmp_path):
    path = _file(tmp_path, b"cluster-secret\n", 0o644)
    assert _config_error({"auth_token_file": path}) == (
        f"kv-transfer-config: `auth_token_file`: {path} is readable by group or others (mode 0644); chmod 600 it")
    os.chmod(path, 0o600)
    message = _config_error({"auth_token_file": path, "auth_token": "inline-too"})
    assert "`auth_token` and `auth_token_file` are both given" in message
    assert "is empty" in _config_error({"auth_token_file": _file(tmp_path, b"", name="empty")})
    assert _config_error({"auth_token_file": 7}) == "kv-transfer-config: `auth_token_file` must be a string or null, got 7"
    assert "`auth_token_file` must be a non-empty string" in _config_error({"auth_token_file": ""})
    with pytest.raises(ConfigError, match=r"^`auth_token_file`: .* is readable by group"):
        os.chmod(path, 0o644)
        KVTransferConfig(kv_role="kv_producer", auth_token_file=path)  # built directly: read all the same


def test_the_variable_gives_the_engines_token_unless_the_config_names_one(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(AUTH_TOKEN_ENV, "from-env")
    assert KVTransferConfig.from_dict({"kv_role": "kv_producer"}).auth_token == "from-env"
    path = _file(tmp_path, b"from-file\n")
    assert KVTransferConfig.from_dict({"kv_role": "kv_producer", "auth_token_file": path}).auth_token == "from-file"
    with caplog.at_level(logging.WARNING, logger="atom_kv.config"):
        assert KVTransferConfig.from_dict({"kv_role": "kv_producer", "auth_token": "inline"}).auth_token == "inline"
    assert len(caplog.records) == 1  # the inline form's warning, nothing about the variable
    monkeypatch.setenv(AUTH_TOKEN_ENV, "")
    assert f"{AUTH_TOKEN_ENV} is set but empty" in _config_error({})


def test_an_inline_auth_token_logs_one_warning_naming_the_file_key(caplog):
    with caplog.at_level(logging.WARNING, logger="atom_kv.config"):
        cfg = KVTransferConfig.from_dict({"kv_role": "kv_producer", "auth_token": "inline-secret"})
    assert cfg.auth_token == "inline-secret"
    [record] = caplog.records
    message = record.getMessage()
    assert "`auth_token_file`" in message and AUTH_TOKEN_ENV in message and "inline-secret" not in message
    assert "\n" not in message


def test_atoms_adapter_reads_auth_token_file_through_the_config(tmp_path):
    from types import SimpleNamespace

    from atom_kv.integrations.atom.settings import AtomEngine

    path = _file(tmp_path, b"cluster-secret\n")
    atom_config = SimpleNamespace(kv_transfer_config=f'{{"kv_role": "kv_consumer", "auth_token_file": "{path}"}}',
                                  kv_cache_block_size=16, model="/models/tiny")
    assert AtomEngine.from_config(atom_config).kv.auth_token == "cluster-secret"
    os.chmod(path, 0o640)
    with pytest.raises(ConfigError, match=r"`auth_token_file`: .* is readable by group or others \(mode 0640\)"):
        AtomEngine.from_config(atom_config)
