"""The proxy's releases: telling a prefill engine that the KV of a prefill it
abandoned will never be read, so its blocks come back now instead of at the
end of their lease.

:class:`ProducerAddress` says where a prefill's producer ranks listen: from
the prefill's answer (``kv_transfer_params``) when it answered, else from the
instance's registration and the rank the proxy chose. :class:`Releaser` sends
one :class:`~atom_kv.wire.Release` to every producer rank from the proxy's
event loop (ZeroMQ asyncio DEALER sockets, LRU-cached, never waiting:
a message that cannot be queued at once is dropped and counted; the lease
remains the backstop). With ``--registration-token`` (the engines'
``auth_token``: one cluster secret) every release is signed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Optional, cast

import msgspec
import zmq
import zmq.asyncio

from atom_kv import wire
from atom_kv._lru import BoundedDict
from atom_kv._ratelimit import RateLimitedLog
from atom_kv.auth import PURPOSE_RELEASE, sign_struct
from atom_kv.config import NonEmptyStr, NonNegativeInt, PeerPort, PositiveInt
from atom_kv.proxy.fleet.registry import Instance
from atom_kv.proxy.observability.metrics import ProxyMetrics
from atom_kv.wire import Release, handshake_port

__all__ = ["ProducerAddress", "Releaser"]

logger = logging.getLogger(__name__)

#: most producer ranks one release goes to
MAX_RANKS = 1024
#: releases queued per producer rank while its connection is not up
SEND_HWM = 64


@dataclass(frozen=True)
class ProducerAddress:
    """Where the producer ranks of one prefill listen (``port`` is the base handshake port)."""

    host: str
    port: int
    tp_size: int
    dp_rank: int
    pp_size: int = 1
    dp_size: int = 1

    def targets(self) -> list[tuple[str, int]]:
        """Every TP rank of every pipeline stage of the DP rank (ATOM's port layout)."""
        return [(self.host, handshake_port(self.port, self.dp_rank, self.tp_size, r, pp_rank=s, dp_size=self.dp_size))
                for s in range(self.pp_size) for r in range(self.tp_size)]

    @classmethod
    def of(cls, prefill_kv: Optional[dict[str, Any]], inst: Instance, dp_rank: int) -> Optional["ProducerAddress"]:
        """From the prefill's answer when it has the keys, else from the registration;
        None when neither says where the handshake port is (or it is out of range)."""
        kv = prefill_kv or {}
        host = _get(kv, ("remote_host",), NonEmptyStr) or inst.host
        port = _get(kv, ("remote_handshake_port", "remote_port"), PeerPort) or inst.handshake_port
        tp = _get(kv, ("remote_tp_size", "tp_size"), PositiveInt) or inst.tp_size
        dp = _get(kv, ("remote_dp_rank", "dp_rank"), NonNegativeInt)
        dp = dp_rank if dp is None else dp
        pp = _get(kv, ("remote_pp_size",), PositiveInt) or 1
        dp_size = max(_get(kv, ("remote_dp_size",), PositiveInt) or inst.dp_size, dp + 1)
        if not host or not port or not 1 <= tp * pp <= MAX_RANKS or \
                handshake_port(port, dp, tp, tp - 1, pp_rank=pp - 1, dp_size=dp_size) > 65535:
            return None
        return cls(host, port, tp, dp, pp, dp_size)


def _get(kv: dict[str, Any], keys: tuple[str, ...], type_: Any) -> Any:
    for key in keys:
        if kv.get(key) is not None:
            try:
                return msgspec.convert(kv[key], type_)
            except msgspec.ValidationError:
                return None
    return None


class Releaser:
    """Owns the proxy's ZeroMQ context and DEALER sockets (at most ``max_sockets``,
    least recently used closed first) and the counters of releases. Runs on the
    proxy's event loop; :meth:`release` never blocks."""

    def __init__(self, metrics: ProxyMetrics, *, token: Optional[str], max_sockets: int = 256,
                 log_interval_s: float = 10.0) -> None:
        self._metrics = metrics
        self._token = token
        self._ctx: Optional[zmq.asyncio.Context] = None
        self._socks: BoundedDict[tuple[str, int], zmq.asyncio.Socket] = BoundedDict(
            max_sockets, on_evict=lambda _key, sock: sock.close(linger=0))
        self.warnings = RateLimitedLog(logger, "undelivered releases", interval_s=log_interval_s)

    def release(self, transfer_id: str, address: ProducerAddress, reason: str) -> int:
        """Queue a release of ``transfer_id`` to every producer rank at ``address``;
        returns how many ranks it was queued for."""
        msg = Release(transfer_id=transfer_id, reason=reason, sender="proxy")
        if self._token is not None:
            msg = sign_struct(self._token, PURPOSE_RELEASE, msg)  # one signature serves every rank
        data = wire.encode(msg)
        queued = 0
        for host, port in address.targets():
            try:
                # zmq.asyncio's send returns a Future (pyzmq types it as an Awaitable), resolved at once
                sent = cast("asyncio.Future[Any]", self._socket(host, port).send(data, zmq.NOBLOCK))
                if (failure := sent.exception()) is not None:
                    raise failure
            except (zmq.ZMQError, ValueError) as exc:
                self._metrics.releases.labels("dropped").inc()
                self.warnings.event("dropped", f"release of transfer {transfer_id} to {host}:{port} dropped: {exc} "
                                               "(the prefill's lease frees the blocks)")
                continue
            queued += 1
        if queued:
            self._metrics.releases.labels("sent").inc(queued)
            logger.debug("released transfer %s at %s:%d (%d rank%s, %s)", transfer_id, address.host, address.port,
                         address.tp_size, "" if address.tp_size == 1 else "s", reason)
        return queued

    def _socket(self, host: str, port: int) -> zmq.asyncio.Socket:
        key = (host, port)
        sock = self._socks.get(key)
        if sock is not None:
            self._socks.touch(key)
            return sock
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        endpoint = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.RCVHWM, 1)  # nothing is read back
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"cannot connect to {endpoint}: {exc}") from None
        self._socks[key] = sock
        return sock

    async def close(self, linger_ms: int = 500) -> None:
        """Let queued releases go out (at most ``linger_ms``), then close everything."""
        for sock in self._socks.values():
            sock.close(linger=linger_ms)
        self._socks.clear()
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            await asyncio.to_thread(ctx.term)  # blocks until sent or lingered out: off the loop
