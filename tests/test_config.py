"""`--kv-transfer-config` validation: every bad input is one line naming the key."""

from __future__ import annotations

import json
import logging
from typing import Any, Literal, Optional

import msgspec
import pytest

from atom_kv.config import (
    ConfigError,
    FieldError,
    KVTransferConfig,
    NonEmptyStr,
    NonNegativeFloat,
    PeerPort,
    Port,
    PositiveSeconds,
    RangesPerRequest,
    TcpConfig,
    convert_fields,
    describe_type,
    is_port,
    parse_kv_transfer_config,
)
from atom_kv.config_sections import FLAT_KEYS, SECTIONS
from atom_kv.config_types import describe_allowed, doc_type


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
    "key,value", [("transfer_retries", -1), ("peer_failure_threshold", 0), ("handshake_port", 70000)]
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
        ({"moriio": {"transport": "ib"}}, "`moriio.transport` must be one of 'rdma', 'xgmi', got 'ib'"),
        ({"moriio": {"poll_cq_mode": "busy"}}, "`moriio.poll_cq_mode` must be one of 'polling', 'event', got 'busy'"),
        ({"transfer_retry_backoff_ms": -1}, "`transfer_retry_backoff_ms` must be >= 0, got -1.0"),
        ({"abort_timeout_s": -1}, "`abort_timeout_s` must be a positive number of seconds, got -1.0"),
        ({"max_send_wr": -3}, "`max_send_wr` must be >= 0, got -3"),
        ({"qp_per_transfer": 0}, "`qp_per_transfer` must be >= 1, got 0"),
        ({"kv_connector": None}, "`kv_connector` must be a string, got None"),
        ({"enable_notification": 1}, "`enable_notification` must be true or false, got 1"),
        ({"backend": "nixI"}, "`backend` must be one of 'auto', 'tcp', 'cma', 'moriio', 'gpu_ipc', 'nixl', got 'nixI'"),
        ({"nixl": {"plugins": "UCX"}}, "`nixl.plugins` must be a list, got 'UCX'"),
        ({"nixl": {"plugins": []}}, '`nixl.plugins` must be a non-empty list of NIXL plugin names, e.g. ["UCX"], got []'),
        ({"nixl": {"progress_threads": -1}}, "`nixl.progress_threads` must be >= 0, got -1"),
        ({"nixl": {"ucx_tls": ""}}, "`nixl.ucx_tls` must be a non-empty string, got ''"),
        ({"tcp": {"streams": 0}}, "`tcp.streams` must be >= 1, got 0"),
        ({"tcp": {"max_ranges_per_request": 0}}, "`tcp.max_ranges_per_request` must be an integer in 1..1048576, got 0"),
        ({"tcp": {"hello_timeout_s": "soon"}}, "`tcp.hello_timeout_s` must be a number, got 'soon'"),
        ({"staging": {"piece_bytes": 100}}, "`staging.piece_bytes` must be a number of bytes in 65536..1073741824, got 100"),
        ({"staging": {"ring_buffers": 1}}, "`staging.ring_buffers` must be an integer in 2..16, got 1"),
        ({"staging": {"pool_pairs": 0}}, "`staging.pool_pairs` must be >= 1, got 0"),
        ({"gpu_ipc": {"wait_spin_us": 2000}}, "`gpu_ipc.wait_spin_us` must be a number of microseconds in 0..1000, got 2000.0"),
        ({"gpu_ipc": {"grant_timeout_s": 0}}, "`gpu_ipc.grant_timeout_s` must be a positive number of seconds, got 0.0"),
        ({"cma": {"grant_max_connections": 0}}, "`cma.grant_max_connections` must be >= 1, got 0"),
        ({"limits": {"handshake_max_connections": 0}}, "`limits.handshake_max_connections` must be >= 1, got 0"),
        ({"limits": {"tcp_reserved_connections": -1}}, "`limits.tcp_reserved_connections` must be >= 0, got -1"),
        ({"tcp": 5}, '`tcp` must be an object of tcp keys like {"streams": 4}, got 5'),
        ({"limits": [1]}, '`limits` must be an object of limits keys like {"handshake_max_connections": 1024}, got [1]'),
        ({"tcp": {"stream": 2}}, "unknown key `tcp.stream`; did you mean `tcp.streams`?"),
        ({"nixl": {"zzzz": 2}}, "unknown key `nixl.zzzz`"),
        ({"tcp.streams": 2}, '`tcp.streams` is written nested: {"tcp": {"streams": 2}}'),
        ({"tcp_stream": 2}, "unknown key `tcp_stream`; did you mean `tcp.streams`?"),
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
    assert describe_type(Optional[Literal["b", "a"]]) == "one of 'b', 'a' or null"
    assert describe_type(list[int]) == "a list"


def test_what_a_type_allows_comes_from_its_constraints_or_its_description():
    assert describe_allowed(RangesPerRequest) == "an integer in 1..1048576"  # ge and le
    assert describe_allowed(NonNegativeFloat) == ">= 0"  # the largest float as upper bound is no bound
    assert describe_allowed(Optional[NonEmptyStr]) == "a non-empty string"
    assert describe_allowed(Port) == "a TCP port in 0..65535"  # its description wins over its bounds
    assert describe_allowed(bool) == "true or false"
    assert doc_type(Optional[PositiveSeconds]) == "float > 0 or null"
    assert doc_type(RangesPerRequest) == "int in 1..1048576"
    assert doc_type(Literal["b", "a"]) == r'`"b"` \| `"a"`'
    assert doc_type(list[NonEmptyStr]) == "list of non-empty strings"


@pytest.mark.parametrize("fields, key", [
    ({"limits": {"handshake_reserved_challenges": 4096}}, "`limits.handshake_reserved_challenges` must be below 4096"),
    ({"tcp": {"max_connections": 16}, "limits": {"tcp_reserved_connections": 16}},
     "`limits.tcp_reserved_connections` must be below `tcp.max_connections` (16), got 16"),
    ({"limits": {"handshake_max_connections": 0}}, "`limits.handshake_max_connections`"),
    ({"limits": {"rendezvous_max_waiting_per_source": 0}}, "`limits.rendezvous_max_waiting_per_source`"),
])
def test_pre_authentication_shares_are_validated_naming_the_key(fields, key):
    with pytest.raises(ConfigError) as err:
        KVTransferConfig.from_dict({"kv_role": "kv_producer", **fields})
    assert key in str(err.value) and "\n" not in str(err.value)


# --- the sections -------------------------------------------------------------
def _deprecations(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "atom_kv.config" and "deprecated" in r.getMessage()]


def test_each_section_has_its_own_defaults_and_is_read_nested():
    cfg = KVTransferConfig.from_dict({"kv_role": "kv_producer"})
    for key, cls in SECTIONS.items():
        assert type(getattr(cfg, key)) is cls
    assert (cfg.tcp.streams, cfg.staging.piece_bytes, cfg.limits.handshake_max_connections) == (4, 1 << 20, 1024)
    assert (cfg.moriio.transport, cfg.nixl.plugins, cfg.gpu_ipc.grant_timeout_s) == ("rdma", ["UCX"], 3.0)
    cfg = parse_kv_transfer_config(json.dumps({"kv_role": "kv_consumer", "tcp": {"streams": 8, "read_timeout_s": 3},
                                               "moriio": {"transport": "xgmi"}}))
    assert (cfg.tcp.streams, cfg.tcp.read_timeout_s, cfg.tcp.server_threads, cfg.moriio.transport) == (8, 3.0, 4, "xgmi")
    assert isinstance(cfg.tcp.read_timeout_s, float)


def test_a_section_made_directly_validates_naming_the_dotted_key():
    with pytest.raises(ConfigError, match=r"^`tcp.streams` must be >= 1, got 0$"):
        TcpConfig(streams=0)
    with pytest.raises(ConfigError, match=r"^`tcp.streams` must be >= 1, got 0$"):
        KVTransferConfig(kv_role="kv_producer", tcp={"streams": 0})
    assert KVTransferConfig(kv_role="kv_producer", tcp={"streams": 2}).tcp == TcpConfig(streams=2)
    with pytest.raises(TypeError):  # kw_only
        TcpConfig(4)  # type: ignore[misc]
    with pytest.raises(msgspec.ValidationError):  # no unknown fields, in a config passed on to a rank too
        KVTransferConfig.from_resolved({**KVTransferConfig(kv_role="kv_producer").to_dict(), "tcp": {"stream": 4}})


#: a valid value, not the default, for every deprecated flat key
_FLAT_VALUES: dict[str, Any] = {
    "tcp_streams": 8, "tcp_server_threads": 2, "tcp_max_connections": 100, "tcp_max_ranges_per_request": 16,
    "tcp_read_timeout_s": 1.5, "tcp_hello_timeout_s": 0.5, "tcp_max_unauthenticated_per_source": 9,
    "tcp_idle_timeout_s": 60.0, "staging_piece_bytes": 65536, "staging_pool_pairs": 3, "staging_ring_buffers": 2,
    "handshake_max_connections": 10, "handshake_max_unproven_connections_per_source": 5,
    "handshake_max_challenges_per_source": 6, "handshake_reserved_challenges": 7, "tcp_reserved_connections": 8,
    "rendezvous_max_waiting_per_source": 11, "cma_grant_timeout_s": 1.0, "cma_grant_max_connections": 12,
    "gpu_ipc_grant_timeout_s": 2.0, "gpu_ipc_grant_max_connections": 13, "gpu_ipc_wait_spin_us": 7.0,
    "nixl_plugins": ["UCX", "POSIX"], "nixl_progress_threads": 2, "nixl_ucx_tls": "tcp", "nixl_ucx_proto_info": True,
    "moriio_backend": "xgmi", "poll_cq_mode": "event",
}


def test_every_flat_key_has_a_value_here():
    assert sorted(_FLAT_VALUES) == sorted(FLAT_KEYS)


@pytest.mark.parametrize("old", sorted(_FLAT_VALUES))
def test_a_flat_key_still_works_with_one_deprecation_line_naming_its_new_place(caplog, old):
    section, name = FLAT_KEYS[old]
    value = _FLAT_VALUES[old]
    with caplog.at_level(logging.WARNING, logger="atom_kv.config"):
        cfg = KVTransferConfig.from_dict({"kv_role": "kv_producer", "backend": "tcp", old: value})
    assert getattr(getattr(cfg, section), name) == value
    assert _deprecations(caplog) == [
        f"kv-transfer-config: `{old}` is deprecated: write {json.dumps({section: {name: value}})}"]
    assert cfg == KVTransferConfig.from_dict({"kv_role": "kv_producer", "backend": "tcp", section: {name: value}})


def test_several_flat_keys_give_one_line_each_and_atoms_keys_none(caplog):
    atom = {"kv_role": "kv_consumer", "kv_connector": "atom_kv", "proxy_ip": "10.0.0.5", "proxy_ping_port": 36367,
            "http_port": 8020, "handshake_port": 6401, "protocol": "rdma", "qp_per_transfer": 2,
            "num_worker_threads": 8, "post_batch_size": 4, "max_send_wr": 1, "max_cqe_num": 1, "max_msg_sge": 1,
            "enable_notification": True}
    with caplog.at_level(logging.WARNING, logger="atom_kv.config"):
        KVTransferConfig.from_dict(atom)
        assert caplog.records == []  # an ATOM launch line works unchanged, without a word
        cfg = KVTransferConfig.from_dict({**atom, "tcp_streams": 2, "poll_cq_mode": "event",
                                          "kv_connector_extra_config": {"tcp_streams": 2, "nixl_ucx_tls": "rc"}})
    lines = _deprecations(caplog)
    assert len(lines) == 3 and all("\n" not in line for line in lines)
    assert [line.split("`")[1] for line in lines] == ["tcp_streams", "poll_cq_mode", "nixl_ucx_tls"]
    assert (cfg.tcp.streams, cfg.moriio.poll_cq_mode, cfg.nixl.ucx_tls) == (2, "event", "rc")


def test_a_flat_key_and_its_nested_key_must_agree():
    assert _err('{"kv_role": "kv_producer", "tcp_streams": 4, "tcp": {"streams": 8}}') == (
        "kv-transfer-config: `tcp_streams` is 4 but `tcp.streams` is 8; give only `tcp.streams` "
        "(`tcp_streams` is deprecated)")
    assert _err('{"kv_role": "kv_producer", "moriio_backend": "xgmi", '
                '"kv_connector_extra_config": {"moriio": {"transport": "rdma"}}}') == (
        "kv-transfer-config: `moriio_backend` is 'xgmi' but `moriio.transport` is 'rdma'; give only "
        "`moriio.transport` (`moriio_backend` is deprecated)")
    cfg = KVTransferConfig.from_dict({"kv_role": "kv_producer", "tcp_streams": 8, "tcp": {"streams": 8, "server_threads": 2}})
    assert (cfg.tcp.streams, cfg.tcp.server_threads) == (8, 2)
    assert "`tcp` must be an object" in _err('{"kv_role": "kv_producer", "tcp_streams": 4, "tcp": 4}')


def test_atoms_extra_config_takes_the_sections_too():
    cfg = KVTransferConfig.from_dict({"kv_role": "kv_consumer", "tcp": {"streams": 3},
                                      "kv_connector_extra_config": {"tcp": {"server_threads": 2},
                                                                    "nixl": {"ucx_tls": "rc"}}})
    assert (cfg.tcp.streams, cfg.tcp.server_threads, cfg.nixl.ucx_tls) == (3, 2, "rc")
    assert _err('{"kv_role": "kv_consumer", "tcp": {"streams": 3}, "kv_connector_extra_config": {"tcp": {"streams": 2}}}'
                ) == ("kv-transfer-config: `tcp.streams` is 3 at the top level but 2 in `kv_connector_extra_config`; "
                      "give it once")
    assert _err('{"kv_role": "kv_consumer", "kv_connector_extra_config": {"tcp": {"streams": 0}}}') == (
        "kv-transfer-config: `tcp.streams` must be >= 1, got 0")


def test_the_sections_round_trip_through_to_dict(caplog):
    with caplog.at_level(logging.WARNING, logger="atom_kv.config"):
        cfg = KVTransferConfig.from_dict({"kv_role": "kv_producer", "tcp": {"streams": 7}, "staging": {"pool_pairs": 2},
                                          "limits": {"tcp_reserved_connections": 3}, "nixl": {"plugins": ["UCX", "POSIX"]},
                                          "cma": {"grant_timeout_s": 1}, "backend": "tcp"})
        data = cfg.to_dict()
        assert data["tcp"]["streams"] == 7 and "tcp_streams" not in data
        assert json.loads(cfg.to_json()) == data
        assert KVTransferConfig.from_resolved(data) == cfg
        assert KVTransferConfig.from_dict(data) == cfg
        assert parse_kv_transfer_config(cfg.to_json()) == cfg
    assert _deprecations(caplog) == []
    again = KVTransferConfig.from_resolved(data)
    again.tcp.streams = 1
    assert cfg.tcp.streams == 7  # each config owns its sections
