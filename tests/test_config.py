"""`--kv-transfer-config` validation: every bad input is one line naming the key."""

from __future__ import annotations

import json

import pytest

from atom_kv.config import ConfigError, KVTransferConfig, parse_kv_transfer_config


def _err(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_kv_transfer_config(text)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("kv-transfer-config: ")
    return message


def test_defaults_follow_atom():
    cfg = parse_kv_transfer_config('{"kv_role": "kv_producer"}')
    assert cfg.proxy_ping_port == 36367
    assert cfg.handshake_port == 6301
    assert cfg.backend == "auto"
    assert cfg.load_failure_policy == "fail"
    assert cfg.is_producer and not cfg.is_consumer


def test_empty_means_colocated():
    assert parse_kv_transfer_config(None) is None
    assert parse_kv_transfer_config("  ") is None


def test_round_trip():
    cfg = parse_kv_transfer_config(
        json.dumps({"kv_role": "kv_consumer", "backend": "tcp", "auth_token": "s3cret", "transfer_retries": 0})
    )
    again = parse_kv_transfer_config(cfg.to_json())
    assert again == cfg


def test_proxy_list():
    cfg = parse_kv_transfer_config('{"kv_role": "kv_producer", "proxy_ip": "10.0.0.1, 10.0.0.2:4000,"}')
    assert cfg.proxy_addresses == ["10.0.0.1", "10.0.0.2:4000"]


def test_invalid_json():
    assert "invalid JSON" in _err('{"kv_role": ')


def test_not_an_object():
    assert "expected a JSON object" in _err("[1, 2]")


def test_unknown_key_suggests_closest():
    message = _err('{"kv_role": "kv_producer", "handshake_timout_s": 3}')
    assert "`handshake_timout_s`" in message
    assert "did you mean `handshake_timeout_s`?" in message


def test_unknown_key_without_close_match():
    message = _err('{"kv_role": "kv_producer", "zzzz": 3}')
    assert "unknown key `zzzz`" in message
    assert "did you mean" not in message


def test_missing_role():
    assert "`kv_role`" in _err("{}")


@pytest.mark.parametrize(
    "key,value,expect",
    [
        ("handshake_port", '"6301"', "an integer"),
        ("transfer_retries", "1.5", "an integer"),
        ("enable_notification", '"yes"', "true or false"),
        ("proxy_ip", "5", "a string or null"),
        ("transfer_timeout_s", '"soon"', "a number"),
    ],
)
def test_wrong_type(key, value, expect):
    message = _err(f'{{"kv_role": "kv_producer", "{key}": {value}}}')
    assert f"`{key}`" in message and expect in message


@pytest.mark.parametrize(
    "key,value,allowed",
    [
        ("kv_role", '"kv_both"', "'kv_producer', 'kv_consumer'"),
        ("backend", '"rdma"', "'auto', 'tcp', 'cma', 'moriio'"),
        ("load_failure_policy", '"retry"', "'fail', 'recompute'"),
    ],
)
def test_bad_enum(key, value, allowed):
    body = {"kv_role": "kv_producer"}
    body[key] = json.loads(value)
    message = _err(json.dumps(body))
    assert f"`{key}`" in message and allowed in message


@pytest.mark.parametrize("key", ["ping_interval_s", "handshake_timeout_s", "transfer_timeout_s", "abort_timeout_s"])
@pytest.mark.parametrize("value", [-1, 0])
def test_non_positive_timeout(key, value):
    message = _err(json.dumps({"kv_role": "kv_producer", key: value}))
    assert f"`{key}`" in message and "positive" in message


@pytest.mark.parametrize(
    "key,value", [("transfer_retries", -1), ("peer_failure_threshold", 0), ("handshake_port", 70000), ("tcp_streams", 0)]
)
def test_out_of_range_ints(key, value):
    assert f"`{key}`" in _err(json.dumps({"kv_role": "kv_producer", key: value}))


def test_direct_construction_validates():
    with pytest.raises(ConfigError):
        KVTransferConfig(kv_role="kv_producer", abort_timeout_s=-5)
