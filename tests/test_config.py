"""`--kv-transfer-config` validation: every bad input is one line naming the key."""

from __future__ import annotations

import json
from typing import Literal, Optional

import msgspec
import pytest

from atom_kv.config import (
    ConfigError,
    FieldError,
    KVTransferConfig,
    NonEmptyStr,
    PeerPort,
    Port,
    PositiveSeconds,
    convert_fields,
    describe_type,
    is_port,
    parse_kv_transfer_config,
)


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


def test_atoms_keys_take_atoms_defaults():
    # ATOM main's MoRIIO/Mooncake connectors: kv_role kv_producer, http_port 8000, 4 QPs and 4 worker threads
    cfg = KVTransferConfig.from_dict({}, default_role="kv_producer")
    assert (cfg.kv_role, cfg.http_port, cfg.qp_per_transfer, cfg.num_worker_threads, cfg.handshake_port) == (
        "kv_producer", 8000, 4, 4, 6301)


def test_a_missing_kv_role_is_refused_in_one_line_naming_the_roles():
    # never guessed outside ATOM: a decode engine launched without it must not become a producer
    for text in ("{}", '{"kv_connector_extra_config": {"backend": "tcp"}}', '{"handshake_port": 6401}'):
        message = _err(text)
        assert message == ("kv-transfer-config: `kv_role` is required: 'kv_producer' (a prefill engine) or "
                           "'kv_consumer' (a decode engine); 'kv_both' is not supported")
    assert KVTransferConfig.from_dict({"kv_role": "kv_consumer"}, default_role="kv_producer").is_consumer
    assert "'kv_producer', 'kv_consumer'" in _err('{"kv_role": null}')


def test_atoms_protocol_key_names_the_backend():
    assert parse_kv_transfer_config('{"kv_role": "kv_producer", "protocol": "tcp"}').backend == "tcp"
    assert parse_kv_transfer_config('{"kv_role": "kv_producer", "protocol": "rdma"}').backend == "moriio"
    assert parse_kv_transfer_config('{"kv_role": "kv_producer", "protocol": "tcp", "backend": "tcp"}').backend == "tcp"
    assert _err('{"kv_role": "kv_producer", "protocol": "rdma", "backend": "tcp"}') == (
        "kv-transfer-config: `protocol` 'rdma' means `backend` 'moriio', but `backend` is 'tcp'; give only one of them")
    assert _err('{"kv_role": "kv_producer", "protocol": "ib"}') == "kv-transfer-config: `protocol` must be one of 'tcp', 'rdma' or null, got 'ib'"


def test_atoms_extra_config_object_holds_our_keys():
    cfg = parse_kv_transfer_config(json.dumps(
        {"kv_role": "kv_consumer", "kv_connector_extra_config": {"backend": "tcp", "transfer_retries": 0}}))
    assert (cfg.kv_role, cfg.backend, cfg.transfer_retries) == ("kv_consumer", "tcp", 0)
    assert _err('{"backend": "cma", "kv_connector_extra_config": {"backend": "tcp"}}') == (
        "kv-transfer-config: `backend` is 'cma' at the top level but 'tcp' in `kv_connector_extra_config`; give it once")
    assert _err('{"kv_connector_extra_config": {"abort_timout_s": 1}}') == (
        "kv-transfer-config: unknown key `abort_timout_s`; did you mean `abort_timeout_s`?")
    assert "must be an object of atom-kv keys" in _err('{"kv_connector_extra_config": [1]}')


def test_atoms_multi_connector_list_is_refused_with_how_to_use_it():
    message = _err('{"kv_connector": "multi", "connectors": [{"kv_connector": "atom_kv"}]}')
    assert message.startswith("kv-transfer-config: `connectors` configures ATOM's `multi` connector")
    assert '{"kv_connector": "atom_kv", ...}' in message


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


# --- messages the tests above do not cover --------------------------------------
@pytest.mark.parametrize(
    "body,message",
    [
        ({"post_batch_size": 0}, "`post_batch_size` must be -1 (library default) or >= 1, got 0"),
        ({"post_batch_size": -5}, "`post_batch_size` must be -1 (library default) or >= 1, got -5"),
        ({"http_port": "x"}, "`http_port` must be an integer or null, got 'x'"),
        ({"http_port": 70000}, "`http_port` must be a TCP port in 0..65535, got 70000"),
        ({"proxy_ping_port": -1}, "`proxy_ping_port` must be a TCP port in 0..65535, got -1"),
        ({"moriio_backend": "ib"}, "`moriio_backend` must be one of 'rdma', 'xgmi', got 'ib'"),
        ({"poll_cq_mode": "busy"}, "`poll_cq_mode` must be one of 'polling', 'event', got 'busy'"),
        ({"transfer_retry_backoff_ms": -1}, "`transfer_retry_backoff_ms` must be >= 0, got -1.0"),
        ({"abort_timeout_s": -1}, "`abort_timeout_s` must be a positive number of seconds, got -1.0"),
        ({"max_send_wr": -3}, "`max_send_wr` must be >= 0, got -3"),
        ({"qp_per_transfer": 0}, "`qp_per_transfer` must be >= 1, got 0"),
        ({"kv_connector": None}, "`kv_connector` must be a string, got None"),
        ({"enable_notification": 1}, "`enable_notification` must be true or false, got 1"),
        ({"backend": "nixI"}, "`backend` must be one of 'auto', 'tcp', 'cma', 'moriio', 'gpu_ipc', 'nixl', got 'nixI'"),
        ({"nixl_plugins": "UCX"}, "`nixl_plugins` must be a list, got 'UCX'"),
        ({"nixl_plugins": []}, '`nixl_plugins` must be a non-empty list of NIXL plugin names, e.g. ["UCX"], got []'),
        ({"nixl_progress_threads": -1}, "`nixl_progress_threads` must be >= 0, got -1"),
        ({"nixl_ucx_tls": ""}, "`nixl_ucx_tls` must be a non-empty string, got ''"),
    ],
)
def test_exact_messages(body, message):
    assert _err(json.dumps({"kv_role": "kv_producer", **body})) == f"kv-transfer-config: {message}"


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_seconds_are_refused(text):
    message = _err(f'{{"kv_role": "kv_producer", "ping_interval_s": {text}}}')
    assert message.startswith("kv-transfer-config: `ping_interval_s` must be a positive number of seconds")


def test_an_integer_for_a_seconds_key_becomes_a_float():
    cfg = KVTransferConfig.from_dict({"kv_role": "kv_consumer", "transfer_timeout_s": 5})
    assert cfg.transfer_timeout_s == 5.0 and isinstance(cfg.transfer_timeout_s, float)


def test_direct_construction_checks_types_too():
    with pytest.raises(ConfigError, match="`handshake_port` must be an integer, got 'x'"):
        KVTransferConfig(kv_role="kv_producer", handshake_port="x")


# --- the shared constrained types -------------------------------------------------
def test_port_types():
    assert is_port(0) and is_port(65535) and not is_port(65536) and not is_port(-1)
    assert not is_port(0, allow_zero=False) and is_port(1, allow_zero=False)
    assert not is_port(True) and not is_port("80") and not is_port(80.0)
    assert msgspec.convert(8080, PeerPort) == 8080
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(0, PeerPort)


def test_convert_fields_names_the_key_and_converts():
    class Probe(msgspec.Struct, kw_only=True):
        port: Port = 1
        wait_s: Optional[PositiveSeconds] = None
        name: NonEmptyStr = "x"

    assert convert_fields({"port": 7, "wait_s": 2, "other": object()}, Probe) == {"port": 7, "wait_s": 2.0}
    with pytest.raises(FieldError) as info:
        convert_fields({"name": "", "port": 99999}, Probe)
    assert info.value.key == "name" and str(info.value) == "`name` must be a non-empty string, got ''"
    with pytest.raises(FieldError) as info:  # a wrong type is reported before any range
        convert_fields({"port": 99999, "wait_s": "soon"}, Probe)
    assert info.value.key == "wait_s" and str(info.value) == "`wait_s` must be a number or null, got 'soon'"


def test_describe_type():
    assert describe_type(Optional[Port]) == "an integer or null"
    assert describe_type(Literal["b", "a"]) == "one of 'b', 'a'"  # declaration order
    assert describe_type(list[int]) == "a list"


@pytest.mark.parametrize("fields, key", [
    ({"handshake_reserved_challenges": 4096}, "`handshake_reserved_challenges` must be below 4096"),
    ({"tcp_max_connections": 16, "tcp_reserved_connections": 16}, "`tcp_reserved_connections` must be below"),
    ({"handshake_max_connections": 0}, "`handshake_max_connections`"),
    ({"rendezvous_max_waiting_per_source": 0}, "`rendezvous_max_waiting_per_source`"),
])
def test_pre_authentication_shares_are_validated_naming_the_key(fields, key):
    with pytest.raises(ConfigError) as err:
        KVTransferConfig.from_dict({"kv_role": "kv_producer", **fields})
    assert key in str(err.value) and "\n" not in str(err.value)
