"""Request rewrites for the two legs (pure functions, no I/O).

Both legs carry the same ``transfer_id``, minted by the proxy before the
prefill is sent (vLLM's MoRIIO engines require it on both legs; atom-kv's
producer adopts it), and every key vLLM's toy P/D proxies set.

The proxy owns ``kv_transfer_params`` on both legs: whatever the client sent
under that key is dropped, and the legs' params are built only from the
registry and the prefill's answer (a client must never point a decode
engine's handshake at a port of its choosing).
"""

from __future__ import annotations

from typing import Any

from atom_kv.proxy.fleet.registry import Instance

#: the body field ATOM's routers inject to name the DP rank (``_get_data_parallel_rank``)
DP_RANK_FIELD = "data_parallel_rank"


def _set_dp_rank(req: dict[str, Any], target: Instance, rank: int) -> None:
    """Name the DP rank the proxy picked in the body, for engines that read the field;
    never leave a client's own value for an engine that would not expect it."""
    if target.takes_dp_rank_field:
        req[DP_RANK_FIELD] = rank
    else:
        req.pop(DP_RANK_FIELD, None)


def prefill_request(body: dict[str, Any], decode: Instance, decode_rank: int, transfer_id: str,
                    prefill: Instance | None = None, prefill_rank: int = 0) -> dict[str, Any]:
    """The prefill leg: one token, no streaming, and where the KV will be read from
    (with ``prefill``, the DP rank it runs on, for engines that take the body field)."""
    req = dict(body)
    if prefill is not None:
        _set_dp_rank(req, prefill, prefill_rank)
    req["stream"] = False
    req.pop("stream_options", None)
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    min_tokens = req.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 1:
        req["min_tokens"] = 1
    kv: dict[str, Any] = dict(
        do_remote_decode=True,
        do_remote_prefill=False,
        remote_engine_id=decode.engine_id,
        remote_block_ids=None,
        remote_host=decode.host,
        remote_port=decode.http_port,
        remote_tp_size=decode.tp_size,
        remote_dp_size=decode.dp_size,
        remote_dp_rank=decode_rank,
        transfer_id=transfer_id,
    )
    if decode.handshake_port is not None:
        kv["remote_handshake_port"] = decode.handshake_port
    if decode.notify_port is not None:
        kv["remote_notify_port"] = decode.notify_port
    req["kv_transfer_params"] = kv
    return req


def decode_request(
    body: dict[str, Any], prefill_kv: dict[str, Any], prefill: Instance, prefill_rank: int, transfer_id: str,
    decode: Instance | None = None, decode_rank: int = 0,
) -> dict[str, Any]:
    """The decode leg: the original request plus every key the prefill returned
    (with ``decode``, the DP rank it runs on, for engines that take the body field).

    ``transfer_id`` is the one the prefill used (its answer's, else ours)."""
    req = dict(body)
    if decode is not None:
        _set_dp_rank(req, decode, decode_rank)
    kv: dict[str, Any] = dict(prefill_kv)  # never the client's
    kv["do_remote_prefill"] = True
    kv["do_remote_decode"] = False
    kv["transfer_id"] = transfer_id
    kv.setdefault("remote_engine_id", prefill.engine_id)
    kv.setdefault("remote_tp_size", prefill_kv.get("tp_size", prefill.tp_size))
    kv.setdefault("remote_dp_rank", prefill_kv.get("dp_rank", prefill_rank))
    kv.setdefault("remote_dp_size", prefill.dp_size)
    kv.setdefault("remote_host", prefill.host)
    kv.setdefault("remote_port", prefill.http_port)
    if prefill.handshake_port is not None:
        kv.setdefault("remote_handshake_port", prefill.handshake_port)
    if prefill.notify_port is not None:
        kv.setdefault("remote_notify_port", prefill.notify_port)
    req["kv_transfer_params"] = kv
    return req


def local_request(body: dict[str, Any], decode: Instance, decode_rank: int) -> dict[str, Any]:
    """A request the decode engine serves alone (local prefill): the client's request without any
    ``kv_transfer_params`` (never the client's), so the engine computes the prompt its cache lacks."""
    req = dict(body)
    req.pop("kv_transfer_params", None)
    _set_dp_rank(req, decode, decode_rank)
    return req


def wants_stream_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))
