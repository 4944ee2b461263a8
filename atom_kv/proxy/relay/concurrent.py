"""The concurrent pair path: both legs sent at once, the decode stream's hand-off, the prefill collected after.

Taken when both engines take part in the rendezvous (:meth:`ConcurrentPairs.applies`): the
decode leg names the prefill's ranks and the transfer, not its blocks, and learns them from the
prefill's ranks once they are computed. A decode stream whose head comes first goes to the client
at once; the prefill's own answer is then collected in the background by a task this object owns.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from atom_kv.proxy.fleet.health import UpstreamHealth
from atom_kv.proxy.http.upstream import UpstreamResponse
from atom_kv.proxy.observability.metrics import ProxyMetrics
from atom_kv.proxy.relay.attempt import PairRequest, RelayResult, Retryable, abandon_reason, close_legs
from atom_kv.proxy.relay.first_token import FirstTokenStream, forwardable_request, promised_first_events
from atom_kv.proxy.relay.pair_legs import PairLegs
from atom_kv.proxy.relay.stream import ResponseStream
from atom_kv.proxy.routing.pick import Charge, Pick
from atom_kv.proxy.settings import ProxySettings
from atom_kv.wire import KV_FEATURE_FIRST_TOKEN, KV_FEATURE_RENDEZVOUS

__all__ = ["ConcurrentPairs"]

logger = logging.getLogger(__name__)


class ConcurrentPairs:
    """Runs pairs whose legs go out together; owns the background tasks that collect the prefill
    answers of pairs whose decode stream already went to the client (cancelled by :meth:`close`)."""

    def __init__(self, legs: PairLegs, settings: ProxySettings, health: UpstreamHealth,
                 metrics: ProxyMetrics) -> None:
        self.legs = legs
        self.settings = settings
        self.health = health
        self.metrics = metrics
        self._background: set[asyncio.Task[None]] = set()  # prefill legs whose decode stream is out

    async def close(self) -> None:
        background, self._background = self._background, set()
        for task in background:
            task.cancel()
        if background:
            await asyncio.gather(*background, return_exceptions=True)

    def applies(self, p: Pick, d: Pick) -> bool:
        """Whether this pair's legs go out together: both engines take part in the rendezvous, the
        proxy knows where the prefill's ranks listen (the decode leg names them), and the prefill
        rank has little queued ahead of this request (else the decode would hold its blocks while
        the prefill waits, to save a few milliseconds on a long wait)."""
        if not (self.settings.concurrent_dispatch and KV_FEATURE_RENDEZVOUS in p.inst.features
                and KV_FEATURE_RENDEZVOUS in d.inst.features and bool(p.inst.engine_id)
                and p.inst.handshake_port is not None and p.inst.source != "moriio"):
            return False
        queued = p.inst.outstanding_tokens[p.rank] if p.rank < len(p.inst.outstanding_tokens) else 0
        if queued - p.tokens > self.settings.concurrent_max_queued_tokens:
            self.metrics.concurrent_skipped.inc()
            return False
        return True

    async def run(self, req: PairRequest, p: Charge, d: Charge) -> RelayResult:
        """One attempt on one pair with both legs sent at once: the decode leg names the prefill's
        ranks and the transfer, not its blocks (``remote_blocks_pending``); the decode engine admits
        and allocates while the prefill computes, then learns the blocks from the prefill's ranks,
        with the prefill's first token, which a decode engine announcing ``first_token`` streams at
        once and continues from (else it computes the first token itself).

        Holds the prefill charge ``p`` until the prefill leg is sent, then gives it to that leg's
        task (released when the leg ends, here or in the background); the caller's block holds ``d``,
        which an answer's stream takes over. Owns both legs until one fails (the other is then closed) and the
        abandon hook: any end before the decode engine owns the KV releases the prefill's blocks,
        which also ends the decode's wait at once. A decode stream whose head comes first goes to
        the client at once: the decode engine only answers once it learned the blocks, so the
        prefill has lent them and its own answer is a formality, collected in the background
        (:meth:`_collect_prefill`) and never a reason to release a transfer that is being read."""
        transfer_id = os.urandom(16).hex()
        stage = "check"
        prefill_kv: dict[str, Any] | None = None
        legs: list[asyncio.Future[Any]] = []
        forward = self._forwards_concurrently(req, p, d)
        try:
            with p:
                await self.legs.check_context(req, p, d)
                stage = "prefill"
                prefill_leg = asyncio.ensure_future(self.legs.prefill(req, p, d, transfer_id))
                p.hand_over().release_when_done(prefill_leg)
            decode_leg = asyncio.ensure_future(self.legs.open_decode(req, p, d, {}, transfer_id, pending=True,
                                                                 first_token_sent=forward))
            legs = [prefill_leg, decode_leg]
            await asyncio.wait(legs, return_when=asyncio.FIRST_COMPLETED)
            if forward:
                if decode_leg.done() and decode_leg.exception() is not None:
                    stage = "decode"
                    decode_leg.result()  # raises: the decode engine refused the request
                prefill_kv, prompt_tokens, answer = await prefill_leg
                self._check_adopted(prefill_kv, p, transfer_id, req)
                early = promised_first_events(answer, req.path.endswith("/chat/completions"), prefill_kv,
                                              self.settings.max_first_token_text_bytes)
                if early is None:
                    self.health.failed(p.inst, "bad_response", request=req.outcomes)
                    raise Retryable(self.legs.failures.error(
                        502, p.inst, "answered without a usable choice",
                        f"prefill instance {p.inst.base_url} answered without a usable choice", req.request_id),
                        p.inst, "bad_response")
                stage = "handed_off"  # the decode leg's own task abandons the prefill if it fails
                opening = d.hand_over()  # the task opening the decode stream holds it
                result = RelayResult(200, "text/event-stream", spans=req.spans, stream=FirstTokenStream(
                    early, self._decode_after_prefill(req, p, opening, decode_leg, prefill_kv, transfer_id,
                                                      prompt_tokens), req.request_id, holds=opening))
                req.spans.ready()
                self.metrics.first_tokens_forwarded.inc()
                self.metrics.concurrent_dispatches.inc()
                return result
            if decode_leg.done():
                stage = "decode"
                resp = decode_leg.result()  # raises: the decode engine refused the request
                if not prefill_leg.done() and resp.header("content-type").startswith("text/event-stream"):
                    stage = "handed_off"  # the decode engine owns the KV; the prefill leg ends on its own
                    self._collect_prefill(prefill_leg, p, req, transfer_id)
                    result = await self.legs.respond(resp, req, d, None, lambda: self.legs.abandon_prefill(
                        transfer_id, p, "client_stalled", None))
                    self.metrics.concurrent_dispatches.inc()
                    return result
                stage = "prefill"
            prefill_kv, prompt_tokens, _ = await prefill_leg
            self._check_adopted(prefill_kv, p, transfer_id, req)
            stage = "decode"
            resp = await decode_leg
            stage = "handed_off"  # the decode engine owns the prefill's KV from here on
            result = await self.legs.respond(resp, req, d, prompt_tokens, lambda: self.legs.abandon_prefill(
                transfer_id, p, "client_stalled", prefill_kv))
            self.metrics.concurrent_dispatches.inc()
            return result
        except BaseException as exc:
            if stage != "handed_off":
                await close_legs(legs)
            if stage in ("prefill", "decode"):
                self.legs.abandon_prefill(transfer_id, p, abandon_reason(stage, exc), prefill_kv)
            raise

    def _forwards_concurrently(self, req: PairRequest, p: Pick, d: Pick) -> bool:
        """Whether a concurrent pair's client gets the first token from the prefill's answer: the
        request allows it, the decode engine continues from the prefill's token and the prefill
        engine gives it (both announce ``first_token``). The decode leg is then told up front to
        leave that token out of its stream."""
        return (self.settings.first_token_forwarding and KV_FEATURE_FIRST_TOKEN in p.inst.features
                and forwardable_request(req.body, d.inst.features))

    def _check_adopted(self, prefill_kv: dict[str, Any], p: Pick, transfer_id: str, req: PairRequest) -> None:
        used = prefill_kv.get("transfer_id")
        if used != transfer_id:  # the decode waits on ours: it would never learn the blocks
            raise Retryable(self.legs.failures.error(
                502, p.inst, "did not adopt the proxy's transfer id",
                f"prefill instance {p.inst.base_url} did not adopt transfer id {transfer_id} "
                f"(answered {str(used)[:160]!r})", req.request_id), p.inst, "bad_response")

    async def _decode_after_prefill(
        self, req: PairRequest, p: Pick, d: Charge, decode_leg: "asyncio.Future[UpstreamResponse]",
        prefill_kv: dict[str, Any], transfer_id: str, prompt_tokens: int | None,
    ) -> ResponseStream:
        """The decode leg (sent with the prefill leg) of a request whose first token is out. Runs as
        the first-token stream's opening task, which holds ``d`` until the stream takes it over; owns
        the abandon until then. Any failure abandons the prefill and ends the client's stream with an
        error event."""
        with d:
            try:
                resp = await decode_leg
            except BaseException as exc:
                self.legs.abandon_prefill(transfer_id, p, abandon_reason("decode", exc), prefill_kv)
                raise
            return await self.legs.forwarded_decode_stream(resp, req, p, d, prefill_kv, transfer_id, prompt_tokens)

    def _collect_prefill(self, leg: "asyncio.Future[Any]", p: Pick, req: PairRequest, transfer_id: str) -> None:
        """The prefill leg of a pair whose decode stream already went to the client: its answer is
        awaited in the background (a task the relay owns, cancelled on close) for the instance's
        health and the log (the leg's own end gives its charge back); it releases nothing (the
        decode reads the KV)."""
        async def collect() -> None:
            try:
                await leg
            except asyncio.CancelledError:
                leg.cancel()
                raise
            except Exception as exc:
                err = exc.error.logged if isinstance(exc, Retryable) else str(exc) or type(exc).__name__
                logger.warning("[%s] prefill leg of transfer %s failed after its decode stream began: %s",
                               req.request_id, transfer_id, err)

        task = asyncio.ensure_future(collect())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
