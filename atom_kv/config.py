"""The schema of ``--kv-transfer-config '<json>'`` and its validation.

Every bad input becomes one :class:`ConfigError` whose message is a single
line naming the key and saying what is allowed. Use :func:`parse_kv_transfer_config`
for JSON text and :meth:`KVTransferConfig.from_dict` for a mapping.
"""

from __future__ import annotations

import difflib
import json
import math
from typing import Any, Literal, Optional

import msgspec

__all__ = ["ConfigError", "KVTransferConfig", "parse_kv_transfer_config"]

KVRole = Literal["kv_producer", "kv_consumer"]
BackendName = Literal["auto", "tcp", "cma", "moriio"]
LoadFailurePolicy = Literal["fail", "recompute"]
PollCqMode = Literal["polling", "event"]


class ConfigError(ValueError):
    """A ``--kv-transfer-config`` problem, phrased for the operator in one line."""


class KVTransferConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything ``--kv-transfer-config`` can set; owns the defaults.

    The first group of keys is ATOM's (same names, same defaults) so an ATOM
    launch line works unchanged; the second group is ours.
    """

    # --- ATOM's keys -------------------------------------------------------
    kv_role: KVRole
    kv_connector: str = "atom_kv"
    proxy_ip: Optional[str] = None
    proxy_ping_port: int = 36367
    http_port: Optional[int] = None
    handshake_port: int = 6301
    qp_per_transfer: int = 1
    num_worker_threads: int = 1
    post_batch_size: int = -1
    max_send_wr: int = 0
    max_cqe_num: int = 0
    max_msg_sge: int = 0
    enable_notification: bool = False

    # --- our keys ----------------------------------------------------------
    backend: BackendName = "auto"
    engine_id: Optional[str] = None
    ping_interval_s: float = 3.0
    handshake_timeout_s: float = 10.0
    transfer_timeout_s: float = 30.0
    abort_timeout_s: float = 120.0
    load_failure_policy: LoadFailurePolicy = "fail"
    transfer_retries: int = 2
    transfer_retry_backoff_ms: float = 50.0
    peer_failure_threshold: int = 3
    auth_token: Optional[str] = None
    tcp_streams: int = 4
    moriio_backend: Literal["rdma", "xgmi"] = "rdma"
    poll_cq_mode: PollCqMode = "polling"

    def __post_init__(self) -> None:
        for key in _POSITIVE_FLOATS:
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(
                    f"`{key}` must be a positive number of seconds, got {value!r}"
                )
        if self.transfer_retry_backoff_ms < 0 or not math.isfinite(self.transfer_retry_backoff_ms):
            raise ConfigError(
                "`transfer_retry_backoff_ms` must be >= 0, "
                f"got {self.transfer_retry_backoff_ms!r}"
            )
        for key, low in _INT_MINIMUMS.items():
            value = getattr(self, key)
            if value < low:
                raise ConfigError(f"`{key}` must be >= {low}, got {value!r}")
        for key in ("proxy_ping_port", "handshake_port", "http_port"):
            value = getattr(self, key)
            if value is not None and not 0 <= value <= 65535:
                raise ConfigError(
                    f"`{key}` must be a TCP port in 0..65535, got {value!r}"
                )
        if self.post_batch_size == 0 or self.post_batch_size < -1:
            raise ConfigError(
                "`post_batch_size` must be -1 (library default) or >= 1, "
                f"got {self.post_batch_size!r}"
            )

    # --- helpers -----------------------------------------------------------
    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"

    @property
    def is_consumer(self) -> bool:
        return self.kv_role == "kv_consumer"

    @property
    def proxy_addresses(self) -> list[str]:
        """``proxy_ip`` split on commas (one engine may ping several proxies)."""
        if not self.proxy_ip:
            return []
        return [p.strip() for p in self.proxy_ip.split(",") if p.strip()]

    @classmethod
    def from_dict(cls, data: Any) -> "KVTransferConfig":
        """Validate a mapping; raise :class:`ConfigError` with a one-line message."""
        if not isinstance(data, dict):
            raise ConfigError(
                f"kv-transfer-config: expected a JSON object like "
                f'{{"kv_role": "kv_producer"}}, got {type(data).__name__}'
            )
        fields = set(cls.__struct_fields__)
        for key in data:
            if key not in fields:
                hint = difflib.get_close_matches(str(key), sorted(fields), n=1, cutoff=0.5)
                suggestion = f"; did you mean `{hint[0]}`?" if hint else ""
                raise ConfigError(f"kv-transfer-config: unknown key `{key}`{suggestion}")
        if "kv_role" not in data:
            raise ConfigError(
                "kv-transfer-config: missing required key `kv_role` "
                "(allowed: 'kv_producer', 'kv_consumer')"
            )
        try:
            return msgspec.convert(data, cls)
        except ConfigError:
            raise
        except msgspec.ValidationError as exc:
            raise ConfigError(_explain(exc, data)) from None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


_POSITIVE_FLOATS = ("ping_interval_s", "handshake_timeout_s", "transfer_timeout_s", "abort_timeout_s")
_INT_MINIMUMS = {
    "transfer_retries": 0,
    "peer_failure_threshold": 1,
    "qp_per_transfer": 1,
    "num_worker_threads": 1,
    "max_send_wr": 0,
    "max_cqe_num": 0,
    "max_msg_sge": 0,
    "tcp_streams": 1,
}


def _explain(exc: msgspec.ValidationError, data: dict[str, Any]) -> str:
    """Turn msgspec's message into ours: name the key and what is allowed."""
    text = str(exc)
    key = None
    if "- at `$." in text:
        key = text.rsplit("- at `$.", 1)[1].split("`", 1)[0].split("[", 1)[0]
    if key is None:
        return f"kv-transfer-config: {text}"
    field_type = KVTransferConfig.__annotations__.get(key, "")
    allowed = _allowed(str(field_type))
    got = data.get(key)
    return f"kv-transfer-config: `{key}` must be {allowed}, got {got!r}"


def _allowed(annotation: str) -> str:
    names = {
        "KVRole": "one of 'kv_producer', 'kv_consumer'",
        "BackendName": "one of 'auto', 'tcp', 'cma', 'moriio'",
        "LoadFailurePolicy": "one of 'fail', 'recompute'",
        "PollCqMode": "one of 'polling', 'event'",
        "Literal['rdma', 'xgmi']": "one of 'rdma', 'xgmi'",
        "Optional[str]": "a string or null",
        "Optional[int]": "an integer or null",
        "str": "a string",
        "int": "an integer",
        "float": "a number",
        "bool": "true or false",
    }
    return names.get(annotation, annotation)


def parse_kv_transfer_config(text: str | None) -> KVTransferConfig | None:
    """Parse the ``--kv-transfer-config`` argument; ``None``/empty means colocated."""
    if text is None or not text.strip():
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"kv-transfer-config: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    return KVTransferConfig.from_dict(data)
