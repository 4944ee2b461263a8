"""atom-kv's settings from vLLM's config: the ``--kv-transfer-config`` keys, where this engine (and rank)
sits, the KV event publisher its registration ping announces, and atom-kv's log lines in vLLM's log."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from vllm.config import VllmConfig

from atom_kv.config import KV_ROLE_REQUIRED, ConfigError, KVTransferConfig
from atom_kv.integrations.vllm.layout import UnsupportedKVCache

logger = logging.getLogger(__name__)

#: ``idle_wait_ms`` (vLLM only): the longest a step that computes nothing while transfers are out waits for
#: their news. vLLM's engine loop steps again about 1 ms after such a step, each step a round trip to every
#: worker; waiting instead wakes at once when a load or a send finishes and leaves the CPU to the engines
#: doing work. A request arriving meanwhile waits at most this long to be scheduled. 0: never wait.
DEFAULT_IDLE_WAIT_MS = 5.0
MAX_IDLE_WAIT_MS = 1000.0


def idle_wait_s(vllm_config: VllmConfig) -> float:
    """``kv_connector_extra_config.idle_wait_ms`` in seconds (checked by :func:`parse_settings`)."""
    vkv = vllm_config.kv_transfer_config
    extra = (vkv.kv_connector_extra_config or {}) if vkv is not None else {}
    return float(extra.get("idle_wait_ms", DEFAULT_IDLE_WAIT_MS)) / 1e3


def parse_settings(vllm_config: VllmConfig) -> tuple[KVTransferConfig, Optional[str]]:
    """atom-kv's config from vLLM's ``kv_role`` and ``kv_connector_extra_config``, and ``host_ip``."""
    vkv = vllm_config.kv_transfer_config
    assert vkv is not None
    role = vkv.kv_role
    if role is None:
        raise ConfigError(KV_ROLE_REQUIRED)
    if role not in ("kv_producer", "kv_consumer"):
        raise ConfigError(
            f"kv-transfer-config: `kv_role` {role!r} is not supported by AtomKVConnector; run prefill "
            "instances with 'kv_producer' and decode instances with 'kv_consumer'"
        )
    extra = dict(vkv.kv_connector_extra_config or {})
    host = extra.pop("host_ip", None)
    if host is not None and (not isinstance(host, str) or not host.strip()):
        raise ConfigError(f"kv_connector_extra_config: `host_ip` must be a host name or IP address, got {host!r}")
    wait = extra.pop("idle_wait_ms", DEFAULT_IDLE_WAIT_MS)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= MAX_IDLE_WAIT_MS:
        raise ConfigError(f"kv_connector_extra_config: `idle_wait_ms` must be a number of milliseconds from 0 "
                          f"to {MAX_IDLE_WAIT_MS:g}, got {wait!r}")
    if "kv_role" in extra and extra["kv_role"] != role:
        raise ConfigError(
            f"kv_connector_extra_config: `kv_role` {extra['kv_role']!r} contradicts vLLM's kv_role {role!r}; "
            "set it once, as vLLM's kv_role"
        )
    extra["kv_role"] = role
    config = KVTransferConfig.from_dict(extra)
    if config.proxy_addresses and extra.get("http_port") is None:
        # atom-kv's default (ATOM's server port) says nothing about vLLM's --port
        raise ConfigError("kv_connector_extra_config: `http_port` is required with `proxy_ip` "
                          "(set it to vLLM's --port, where the proxy sends requests)")
    if "load_failure_policy" in extra:
        logger.warning("kv_connector_extra_config: `load_failure_policy` is ignored under vLLM; vLLM's own "
                       "kv_load_failure_policy (%s) decides what a failed load does", vkv.kv_load_failure_policy)
    return config, host


@dataclass(frozen=True)
class _Place:
    """Where this engine (and, on a worker, this rank) sits."""

    engine_id: str
    host: str
    tp_size: int
    dp_rank: int
    dp_size: int


def _place(vllm_config: VllmConfig, config: KVTransferConfig, host: Optional[str]) -> _Place:
    pc = vllm_config.parallel_config
    for name, label in (("pipeline_parallel_size", "pipeline parallel"),
                        ("prefill_context_parallel_size", "prefill context parallel"),
                        ("decode_context_parallel_size", "decode context parallel")):
        size = getattr(pc, name, 1) or 1
        if size > 1:
            raise UnsupportedKVCache(f"AtomKVConnector does not support {label} (size {size}); use tensor "
                                     "and data parallelism")
    if config.advertise_host is not None:
        if host is not None and host != config.advertise_host:
            raise ConfigError(f"kv_connector_extra_config: `host_ip` {host!r} and `advertise_host` "
                              f"{config.advertise_host!r} disagree; give one of them")
        host = config.advertise_host
    if host is None:
        from vllm.utils.network_utils import get_ip

        host = get_ip()
    vkv = vllm_config.kv_transfer_config
    assert vkv is not None
    return _Place(engine_id=str(config.engine_id or vkv.engine_id), host=host, tp_size=pc.tensor_parallel_size,
                  dp_rank=int(getattr(pc, "data_parallel_index", pc.data_parallel_rank)),
                  dp_size=pc.data_parallel_size)


def _log_with_vllm() -> None:
    """Show atom-kv's own log lines (handshakes, failed loads, transfer summaries) in vLLM's log.

    vLLM configures only its ``vllm`` logger; without this, atom-kv's INFO lines
    would be dropped in vLLM's processes. Done once per process, and only when
    nobody configured the ``atom_kv`` logger.
    """
    ours = logging.getLogger("atom_kv")
    if ours.handlers:
        return
    theirs = logging.getLogger("vllm")
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())


def _tp_rank(vllm_config: VllmConfig, tp_size: int) -> int:
    """This worker's TP rank: vLLM's TP group when initialised, else ``parallel_config.rank``."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return vllm_config.parallel_config.rank % tp_size


def announced_kv_events(vllm_config: VllmConfig) -> tuple[Optional[str], Optional[str]]:
    """vLLM's KV event publisher and replay endpoint (``--kv-events-config``) of DP rank 0, for the registration
    ping, so a proxy follows them: ``(None, None)`` where events are off or no proxy could follow them (one
    logged line says why). vLLM binds its publisher only for ``*``/``::`` endpoints and connects to a host
    address, where only a subscriber that binds would hear it; ``tcp://*:PORT`` is announced as is (the proxy
    connects to the engine's host)."""
    events = getattr(vllm_config, "kv_events_config", None)
    if events is None or not events.enable_kv_cache_events or events.publisher != "zmq":
        return None, None
    endpoint, replay = events.endpoint, events.replay_endpoint
    if not endpoint.startswith("tcp://") or endpoint.rpartition(":")[2] == "0":
        logger.warning("atom-kv: --kv-events-config endpoint %r is not a tcp://HOST:PORT with a fixed port, which "
                       "is all a proxy follows: the registration ping does not announce it", endpoint)
        return None, None
    if "*" not in endpoint and "::" not in endpoint:
        logger.warning("atom-kv: --kv-events-config endpoint %r names a host, so vLLM's publisher connects there "
                       "instead of binding and no proxy can follow it; use tcp://*:%s to have the registration "
                       "ping announce it", endpoint, endpoint.rpartition(":")[2])
        return None, None
    if replay is not None and (not replay.startswith("tcp://") or replay.rpartition(":")[2] == "0"):
        replay = None  # the proxy follows without replay (a gap then clears what it holds of this engine)
    return endpoint, replay
