"""One attempt's shared pieces: the request as the pair paths see it, the retryable failure, the result.

Every pair path (:mod:`~atom_kv.proxy.relay.relay`'s sequential and first-token paths,
:mod:`~atom_kv.proxy.relay.concurrent`) takes a :class:`PairRequest`, raises
:class:`Retryable` for a failure worth re-planning the pair for and answers a :class:`RelayResult`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from atom_kv.proxy.fleet.breaker import RequestOutcomes
from atom_kv.proxy.fleet.registry import Instance
from atom_kv.proxy.http.upstream import UpstreamResponse
from atom_kv.proxy.observability.spans import RequestSpans
from atom_kv.proxy.relay.errors import ProxyError, UpstreamResponseError
from atom_kv.proxy.relay.stream import ResponseStream
from atom_kv.proxy.routing.policies import RouteContext

__all__ = ["PairRequest", "RelayResult", "Retryable", "abandon_reason", "close_legs"]


class Retryable(Exception):
    """An upstream failure worth re-planning the pair for (``inst`` is excluded next time)."""

    def __init__(self, error: ProxyError, inst: Instance, kind: str, status: int = 0) -> None:
        super().__init__(error.logged)  # the log's account; the client gets ``error.message``
        self.error = error
        self.inst = inst
        self.kind = kind  # "unreachable", "rejected", "too_large", "bad_response" or "kv_transfer"
        self.status = status  # the upstream's status, for "rejected"


@dataclass
class RelayResult:
    """What the HTTP layer turns into a response: a body, or an opaque event stream."""

    status: int
    content_type: str
    body: bytes | None = None
    stream: ResponseStream | None = None
    spans: RequestSpans | None = None


@dataclass(frozen=True)
class PairRequest:
    """One client request as every leg of its attempts sees it (immutable; the outcomes fill in)."""

    path: str
    body: dict[str, Any]
    request_id: str
    auth: str | None
    ctx: RouteContext
    max_tokens: int | None
    spans: RequestSpans
    # what the breaker learns from this request: its key (counted once per instance streak), its suspect
    # failures and the instances that served it, judged when it ends (atom_kv.proxy.fleet.breaker)
    outcomes: RequestOutcomes


def abandon_reason(stage: str, exc: BaseException) -> str:
    """The metrics label of an abandoned prefill, from the stage it was in and what ended it."""
    if isinstance(exc, asyncio.CancelledError):
        return "client_gone"
    if stage == "prefill":
        return "prefill_failed"
    if isinstance(exc, Retryable) and exc.kind == "kv_transfer":
        return "kv_transfer_failed"
    if isinstance(exc, UpstreamResponseError) or (isinstance(exc, Retryable) and exc.kind == "rejected"):
        return "decode_rejected"
    return "decode_unreachable"


async def close_legs(legs: list["asyncio.Future[Any]"]) -> None:
    """End the legs of an attempt that failed: cancel those still running (their connections
    close), close an answer already in hand, and collect every outcome (none is left unretrieved)."""
    for leg in legs:
        if not leg.done():
            leg.cancel()
    if legs:
        await asyncio.gather(*legs, return_exceptions=True)
    for leg in legs:
        if not leg.cancelled() and leg.exception() is None and isinstance(leg.result(), UpstreamResponse):
            leg.result().close()
