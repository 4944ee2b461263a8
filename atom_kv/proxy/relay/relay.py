"""The relay: checks a request, plans a P/D pair, runs the prefill leg, then hands back the decode leg.

Failures before the client has seen a byte re-plan the whole pair (a fresh
prefill on a different instance; stale ``kv_transfer_params`` are never
reused). A client disconnect cancels whichever leg is running, so the
engines abort. Whenever a prefill was sent but no decode leg took it over
(a retry onto another pair, the client gone, the decode engine unreachable
or refusing before its first byte, the proxy shutting down), the prefill is
abandoned from one place (:meth:`Relay._run_pair`): its producer ranks get a
release (:mod:`atom_kv.proxy.relay.release`), so its blocks are free at once.

A decode engine that answers an error with ``X-KV-Transfer-Failure: prefill``
could not read the prefill's KV (handshake refused, read failed, lease
expired): the failure is charged to the prefill instance, not to the decode
engine, and the pair is re-planned with a different prefill.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import msgspec

from atom_kv.openai_errors import KV_TRANSFER_FAILURE_HEADER
from atom_kv.proxy.fleet.breaker import RequestOutcomes
from atom_kv.proxy.relay.errors import ProxyError, UpstreamResponseError
from atom_kv.proxy.relay.first_token import (
    FirstTokenStream, bounded_first_token, first_token_events, forwardable, forwardable_request,
    promised_first_events,
)
from atom_kv.proxy.fleet.health import UpstreamHealth
from atom_kv.proxy.relay.legs import decode_request, prefill_request, wants_stream_usage
from atom_kv.proxy.observability.metrics import ProxyMetrics
from atom_kv.proxy.routing.pick import Pick
from atom_kv.proxy.routing.policies import (
    Policy, RouteContext, estimate_prompt_tokens, prompt_text, token_id_prompt_lengths,
)
from atom_kv.proxy.fleet.registry import ROLE_NAMES, Instance, Registry, Role
from atom_kv.proxy.relay.release import ProducerAddress, Releaser
from atom_kv.proxy.settings import ProxySettings
from atom_kv.proxy.observability.spans import RequestSpans
from atom_kv.proxy.http.sse import EventFramer, patch_usage
from atom_kv.proxy.relay.stream import DecodeStream, ResponseStream
from atom_kv.proxy.http.upstream import (
    AnswerLimits, UpstreamConnectTimeout, UpstreamError, UpstreamPool, UpstreamResponse, UpstreamTimeout,
    UpstreamTooLarge,
)
from atom_kv.proxy.relay.validation import context_length_error, could_overflow, requested_max_tokens
from atom_kv.server_timing import HEADER as SERVER_TIMING
from atom_kv.wire import KV_FEATURE_FIRST_TOKEN, KV_FEATURE_RENDEZVOUS

if TYPE_CHECKING:
    from atom_kv.proxy.observability.otel import RequestTrace

logger = logging.getLogger(__name__)

_json_decoder = msgspec.json.Decoder()
_json_encoder = msgspec.json.Encoder()
_KV_FAILURE = KV_TRANSFER_FAILURE_HEADER.lower()
_SERVER_TIMING = SERVER_TIMING.lower()


class _Retryable(Exception):
    """An upstream failure worth re-planning the pair for (``inst`` is excluded next time)."""

    def __init__(self, error: ProxyError, inst: Instance, kind: str, status: int = 0) -> None:
        super().__init__(error.message)
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
class _Request:
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


def _abandon_reason(stage: str, exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "client_gone"
    if stage == "prefill":
        return "prefill_failed"
    if isinstance(exc, _Retryable) and exc.kind == "kv_transfer":
        return "kv_transfer_failed"
    if isinstance(exc, UpstreamResponseError) or (isinstance(exc, _Retryable) and exc.kind == "rejected"):
        return "decode_rejected"
    return "decode_unreachable"


async def _close_legs(legs: list["asyncio.Future[Any]"]) -> None:
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


class Relay:
    """Owns the upstream connections and runs requests through P then D.

    Everything it sends upstream (the two legs, ``/v1/models``, ``/tokenize``)
    goes through one :class:`~atom_kv.proxy.http.upstream.UpstreamPool` (a lean
    pooled HTTP/1.1 client)."""

    def __init__(self, settings: ProxySettings, registry: Registry, policies: dict[str, Policy],
                 health: UpstreamHealth, metrics: ProxyMetrics) -> None:
        self.settings = settings
        self.registry = registry
        self.policies = policies
        self.health = health
        self.metrics = metrics
        self._pool: UpstreamPool | None = None
        self.releaser = (Releaser(metrics, token=settings.registration_token,
                                  log_interval_s=settings.log_summary_interval_s)
                         if settings.release_prefills else None)
        self._models_rr = 0
        self._request_keys = itertools.count(1)
        self._uses_text = any(p.uses_text for p in policies.values())
        self._background: set[asyncio.Task[None]] = set()  # prefill legs whose decode stream is out

    async def start(self) -> None:
        if self._pool is None:
            # idle connections close after 4 s, below uvicorn's 5 s keep-alive (vLLM's server):
            # never reuse a connection the engine is closing
            settings = self.settings
            self._pool = UpstreamPool(connect_timeout=settings.connect_timeout, keepalive_s=4.0,
                                      limit=settings.max_upstream_connections,
                                      limits=AnswerLimits(settings.max_upstream_head_bytes,
                                                          settings.max_upstream_body_bytes,
                                                          settings.max_server_timing_bytes))

    async def close(self) -> None:
        background, self._background = self._background, set()
        for task in background:
            task.cancel()
        if background:
            await asyncio.gather(*background, return_exceptions=True)
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()
        if self.releaser is not None:
            await self.releaser.close()  # releases queued by requests cancelled at shutdown still go out

    @property
    def pool(self) -> UpstreamPool:
        if self._pool is None:
            raise ProxyError(503, "proxy is not started")
        return self._pool

    # ------------------------------------------------------------------ routing
    def _pick(self, role: Role, exclude: set[tuple[str, str]], ctx: RouteContext, tokens: int) -> Pick | None:
        now = time.monotonic()
        live = self.registry.live(role, now)
        healthy = [i for i in live if i.breaker.allows(now)]
        if not healthy:
            if not live:
                return None
            healthy = [self._least_recently_failed(role, live, exclude)]
        fresh = [i for i in healthy if i.key not in exclude] if exclude else healthy
        inst, rank = self.policies[role].choose(fresh or healthy, ctx)
        inst.breaker.on_dispatch(now)
        inst.charge(rank, tokens)
        self.metrics.routed(role, inst.base_url, rank)
        return Pick(inst, rank, tokens)

    def _least_recently_failed(self, role: Role, live: list[Instance], exclude: set[tuple[str, str]]) -> Instance:
        """Every circuit of ``role`` is open: refusing every client helps nobody, so the leg goes to
        the instance that failed least recently (one this request has not failed on, if any)."""
        fresh = [i for i in live if i.key not in exclude] or live
        self.metrics.circuit_fallbacks.labels(ROLE_NAMES[role]).inc()
        return min(fresh, key=lambda i: i.breaker.last_failure)

    def _no_instance(self, role: Role) -> ProxyError:
        name = ROLE_NAMES[role]
        known = self.registry.known(role)
        live = self.registry.live(role)
        if not known:
            return ProxyError(503, f"no {name} instance is registered")
        if not live:
            return ProxyError(503, f"none of the {len(known)} {name} instance(s) is reachable (down, silent or "
                                   "not yet probed); see /instances")
        return ProxyError(503, f"all {len(live)} {name} instance(s) are unhealthy (circuit open)")

    # ------------------------------------------------------------------ relay
    async def relay(self, path: str, body: dict[str, Any], request_id: str, auth: str | None,
                    received: float | None = None, trace: RequestTrace | None = None) -> RelayResult:
        """Run one completion request; raises ProxyError / UpstreamResponseError for error replies.
        ``received``: when the request arrived (``time.perf_counter()``), where its spans start;
        ``trace``: its OpenTelemetry trace (``--otlp-traces-endpoint``), which the caller finishes."""
        max_tokens = requested_max_tokens(body)  # before anything is spent
        text = prompt_text(body)
        tokens = estimate_prompt_tokens(body, text)
        req = _Request(path, body, request_id, auth, RouteContext(text, tokens), max_tokens,
                       RequestSpans(self.metrics, received, trace), RequestOutcomes(next(self._request_keys)))
        try:
            return await self._attempts(req, tokens)
        finally:
            self.health.settle(req.outcomes)  # its suspect failures: the instance's, or the request's

    async def _attempts(self, req: _Request, tokens: int) -> RelayResult:
        """Plan a pair and run it, re-planning after a retryable failure (``max_retries``)."""
        request_id = req.request_id
        exclude: dict[str, set[tuple[str, str]]] = {"P": set(), "D": set()}
        last_error: ProxyError | None = None
        rejected: list[_Retryable] = []
        for attempt in range(self.settings.max_retries + 1):
            if attempt:
                self.metrics.retries.inc()
                await asyncio.sleep(self.settings.retry_backoff_s * (2 ** (attempt - 1)))
            d = self._pick("D", exclude["D"], req.ctx, tokens)
            if d is None:
                raise last_error or self._no_instance("D")
            p = self._pick("P", exclude["P"], req.ctx, tokens)
            if p is None:
                d.credit()
                raise last_error or self._no_instance("P")
            try:
                return await self._run_pair(req, p, d)
            except _Retryable as exc:
                exclude[exc.inst.role].add(exc.inst.key)
                last_error = exc.error
                logger.warning("[%s] attempt %d failed: %s", request_id, attempt + 1, exc.error.message)
                if exc.kind in ("rejected", "too_large") and self._request_failure(exc, rejected):
                    break
        assert last_error is not None
        raise last_error

    @staticmethod
    def _request_failure(exc: _Retryable, rejected: list[_Retryable]) -> bool:
        """Whether this failure is the request's own: it failed the same way on another instance
        of the same pool. Then it is not retried (and the breakers, told when the request ends,
        charge no instance for it)."""
        same = [e for e in rejected if e.inst.role == exc.inst.role and e.kind == exc.kind and e.status == exc.status
                and e.inst.key != exc.inst.key]
        rejected.append(exc)
        return bool(same)

    def _concurrent(self, p: Pick, d: Pick) -> bool:
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

    async def _run_pair(self, req: _Request, p: Pick, d: Pick) -> RelayResult:
        """One attempt on one pair. Owns both picks' credits and the abandon hook."""
        if self._concurrent(p, d):
            return await self._run_pair_concurrent(req, p, d)
        transfer_id = os.urandom(16).hex()  # one id for both legs, known before the prefill answers
        stage = "check"
        result: RelayResult | None = None
        prefill_kv: dict[str, Any] | None = None
        try:
            await self._check_context(req, p, d)
            stage = "prefill"
            try:
                prefill_kv, prompt_tokens, answer = await self._prefill(req, p, d, transfer_id)
            finally:
                p.credit()
            used = prefill_kv.get("transfer_id")
            if isinstance(used, str) and used:
                transfer_id = used  # the producer's own id if it did not adopt ours
            stage = "decode"
            early = self._first_token_events(req, d, prefill_kv, answer)
            if early is not None:
                stage = "handed_off"  # the decode leg's own task abandons the prefill if it fails
                result = RelayResult(200, "text/event-stream", spans=req.spans, stream=FirstTokenStream(
                    early, self._decode_after_first_token(req, p, d, prefill_kv, transfer_id, prompt_tokens),
                    req.request_id))
                req.spans.ready()
                self.metrics.first_tokens_forwarded.inc()
                return result
            resp = await self._open_decode(req, p, d, prefill_kv, transfer_id)
            stage = "handed_off"  # the decode engine owns the prefill's KV from here on
            result = await self._respond(resp, req, d, prompt_tokens, lambda: self._abandon_prefill(
                transfer_id, p, "client_stalled", prefill_kv))
            return result
        except BaseException as exc:
            if stage in ("prefill", "decode"):
                self._abandon_prefill(transfer_id, p, _abandon_reason(stage, exc), prefill_kv)
            raise
        finally:
            p.credit()
            if result is None or result.stream is None:
                d.credit()

    async def _run_pair_concurrent(self, req: _Request, p: Pick, d: Pick) -> RelayResult:
        """One attempt on one pair with both legs sent at once: the decode leg names the prefill's
        ranks and the transfer, not its blocks (``remote_blocks_pending``); the decode engine admits
        and allocates while the prefill computes, then learns the blocks from the prefill's ranks,
        with the prefill's first token, which a decode engine announcing ``first_token`` streams at
        once and continues from (else it computes the first token itself).

        Owns both picks' credits, both legs until one fails (the other is then closed) and the
        abandon hook: any end before the decode engine owns the KV releases the prefill's blocks,
        which also ends the decode's wait at once. A decode stream whose head comes first goes to
        the client at once: the decode engine only answers once it learned the blocks, so the
        prefill has lent them and its own answer is a formality, collected in the background
        (:meth:`_collect_prefill`) and never a reason to release a transfer that is being read."""
        transfer_id = os.urandom(16).hex()
        stage = "check"
        result: RelayResult | None = None
        prefill_kv: dict[str, Any] | None = None
        legs: list[asyncio.Future[Any]] = []
        forward = self._forwards_concurrently(req, p, d)
        try:
            await self._check_context(req, p, d)
            stage = "prefill"
            prefill_leg = asyncio.ensure_future(self._prefill(req, p, d, transfer_id))
            decode_leg = asyncio.ensure_future(self._open_decode(req, p, d, {}, transfer_id, pending=True,
                                                                 first_token_sent=forward))
            legs = [prefill_leg, decode_leg]
            await asyncio.wait(legs, return_when=asyncio.FIRST_COMPLETED)
            if forward:
                if decode_leg.done() and decode_leg.exception() is not None:
                    stage = "decode"
                    decode_leg.result()  # raises: the decode engine refused the request
                try:
                    prefill_kv, prompt_tokens, answer = await prefill_leg
                finally:
                    p.credit()
                self._check_adopted(prefill_kv, p, transfer_id)
                early = promised_first_events(answer, req.path.endswith("/chat/completions"), prefill_kv,
                                              self.settings.max_first_token_text_bytes)
                if early is None:
                    self.health.failed(p.inst, "bad_response", request=req.outcomes)
                    raise _Retryable(ProxyError(502, f"prefill instance {p.inst.base_url} answered without a "
                                                     "usable choice"), p.inst, "bad_response")
                stage = "handed_off"  # the decode leg's own task abandons the prefill if it fails
                result = RelayResult(200, "text/event-stream", spans=req.spans, stream=FirstTokenStream(
                    early, self._decode_after_concurrent_prefill(req, p, d, decode_leg, prefill_kv, transfer_id,
                                                                  prompt_tokens), req.request_id))
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
                    result = await self._respond(resp, req, d, None, lambda: self._abandon_prefill(
                        transfer_id, p, "client_stalled", None))
                    self.metrics.concurrent_dispatches.inc()
                    return result
                stage = "prefill"
            try:
                prefill_kv, prompt_tokens, _ = await prefill_leg
            finally:
                p.credit()
            self._check_adopted(prefill_kv, p, transfer_id)
            stage = "decode"
            resp = await decode_leg
            stage = "handed_off"  # the decode engine owns the prefill's KV from here on
            result = await self._respond(resp, req, d, prompt_tokens, lambda: self._abandon_prefill(
                transfer_id, p, "client_stalled", prefill_kv))
            self.metrics.concurrent_dispatches.inc()
            return result
        except BaseException as exc:
            if stage != "handed_off":
                await _close_legs(legs)
            if stage in ("prefill", "decode"):
                self._abandon_prefill(transfer_id, p, _abandon_reason(stage, exc), prefill_kv)
            raise
        finally:
            if stage != "handed_off" or prefill_kv is not None:
                p.credit()
            if result is None or result.stream is None:
                d.credit()

    def _forwards_concurrently(self, req: _Request, p: Pick, d: Pick) -> bool:
        """Whether a concurrent pair's client gets the first token from the prefill's answer: the
        request allows it, the decode engine continues from the prefill's token and the prefill
        engine gives it (both announce ``first_token``). The decode leg is then told up front to
        leave that token out of its stream."""
        return (self.settings.first_token_forwarding and KV_FEATURE_FIRST_TOKEN in p.inst.features
                and forwardable_request(req.body, d.inst.features))

    @staticmethod
    def _check_adopted(prefill_kv: dict[str, Any], p: Pick, transfer_id: str) -> None:
        used = prefill_kv.get("transfer_id")
        if used != transfer_id:  # the decode waits on ours: it would never learn the blocks
            raise _Retryable(ProxyError(502, f"prefill instance {p.inst.base_url} did not adopt transfer id "
                                             f"{transfer_id} (answered {str(used)[:160]!r})"),
                             p.inst, "bad_response")

    async def _decode_after_concurrent_prefill(
        self, req: _Request, p: Pick, d: Pick, decode_leg: "asyncio.Future[UpstreamResponse]",
        prefill_kv: dict[str, Any], transfer_id: str, prompt_tokens: int | None,
    ) -> ResponseStream:
        """The decode leg (sent with the prefill leg) of a request whose first token is out: owns the
        abandon and the decode pick's credit until its stream takes them over. Any failure abandons
        the prefill and ends the client's stream with an error event."""
        try:
            resp = await decode_leg
        except BaseException as exc:
            self._abandon_prefill(transfer_id, p, _abandon_reason("decode", exc), prefill_kv)
            d.credit()
            raise
        return await self._forwarded_decode_stream(resp, req, p, d, prefill_kv, transfer_id, prompt_tokens)

    async def _forwarded_decode_stream(self, resp: UpstreamResponse, req: _Request, p: Pick, d: Pick,
                                       prefill_kv: dict[str, Any], transfer_id: str,
                                       prompt_tokens: int | None) -> ResponseStream:
        """The decode answer of a request whose first token is out, as the stream that follows it
        (the decode pick's credit goes with the stream, or back here if there is none)."""
        try:
            result = await self._respond(resp, req, d, prompt_tokens, lambda: self._abandon_prefill(
                transfer_id, p, "client_stalled", prefill_kv))
        except BaseException:
            d.credit()
            raise
        if result.stream is None:
            d.credit()
            raise ProxyError(502, f"decode instance {d.inst.base_url} answered a streamed request without a stream")
        return result.stream

    def _collect_prefill(self, leg: "asyncio.Future[Any]", p: Pick, req: _Request, transfer_id: str) -> None:
        """The prefill leg of a pair whose decode stream already went to the client: its answer is
        awaited in the background (a task the relay owns, cancelled on close) for the pick's
        credit, the instance's health and the log; it releases nothing (the decode reads the KV)."""
        async def collect() -> None:
            try:
                await leg
            except asyncio.CancelledError:
                leg.cancel()
                raise
            except Exception as exc:
                err = exc.error.message if isinstance(exc, _Retryable) else str(exc) or type(exc).__name__
                logger.warning("[%s] prefill leg of transfer %s failed after its decode stream began: %s",
                               req.request_id, transfer_id, err)
            finally:
                p.credit()

        task = asyncio.ensure_future(collect())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _abandon_prefill(self, transfer_id: str, prefill: Pick, reason: str,
                         prefill_kv: dict[str, Any] | None) -> None:
        """The proxy abandoned the prefill of ``transfer_id`` on ``prefill``: no decode
        leg will read its KV. Counted, and every producer rank is told to release
        the blocks (where they listen: the prefill's answer when it came, else the
        instance's registration and the DP rank this proxy chose)."""
        self.metrics.abandoned_prefills.labels(reason).inc()
        inst = prefill.inst
        logger.debug("abandoned prefill of transfer %s on %s (%s)", transfer_id, inst.base_url, reason)
        if self.releaser is None or inst.source == "moriio":  # vLLM's MoRIIO engines speak another protocol
            return
        address = ProducerAddress.of(prefill_kv, inst, prefill.rank)
        if address is None:
            self.metrics.releases.labels("no_address").inc()
            return
        self.releaser.release(transfer_id, address, reason)

    def _headers(self, request_id: str, rank: int, auth: str | None) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id, "X-data-parallel-rank": str(rank)}
        if auth:
            headers["Authorization"] = auth
        return headers

    def _leg_head(self, req: _Request, inst: Instance, rank: int, length: int) -> bytes:
        """The request head of one leg (the request id is a checked token; the client's
        Authorization came through the HTTP parser, so it holds no line break)."""
        head = (b"POST %b HTTP/1.1\r\nhost: %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"x-request-id: %b\r\nx-data-parallel-rank: %d\r\n"
                % (req.path.encode("latin-1"), self.pool.host_header(inst.host, inst.http_port), length,
                   req.request_id.encode("latin-1"), rank))
        if req.auth:
            head += b"authorization: " + req.auth.encode("latin-1") + b"\r\n"
        if req.spans.trace is not None:  # traceparent (and tracestate) for the engine's own tracing
            head += req.spans.trace.leg(inst.role, inst.base_url, rank)
        return head + b"\r\n"

    # ------------------------------------------------------------------ checks before the prefill
    async def _check_context(self, req: _Request, p: Pick, d: Pick) -> None:
        """Refuse (400) a prompt plus completion that cannot fit the engines' ``max_model_len``."""
        limits = [n for n in (p.inst.max_model_len, d.inst.max_model_len) if n]
        if not limits:
            return
        limit = min(limits)
        exact = token_id_prompt_lengths(req.body)
        if exact is not None:
            n = max(exact)
        elif could_overflow(len(req.ctx.text), req.max_tokens, limit):
            counted = await self._count_tokens(req, (p.inst, d.inst))
            if counted is None:
                return
            n = counted
        else:
            return
        error = context_length_error(limit, n, req.max_tokens)
        if error is not None:
            raise error

    async def _count_tokens(self, req: _Request, instances: tuple[Instance, ...]) -> int | None:
        """The prompt's token count from an engine's ``POST /tokenize`` (None: no engine can tell)."""
        payload: dict[str, Any] = {}
        if isinstance(req.body.get("model"), str):
            payload["model"] = req.body["model"]
        if "messages" in req.body and "prompt" not in req.body:
            payload["messages"] = req.body["messages"]
        else:
            payload["prompt"] = req.body.get("prompt")
        data = _json_encoder.encode(payload)
        for inst in instances:
            if inst.tokenize is False:
                continue
            try:
                status, _, raw = await self.pool.fetch(inst.host, inst.http_port, b"POST", b"/tokenize", body=data,
                                                       headers=self._headers(req.request_id, 0, req.auth),
                                                       total_timeout=self.settings.tokenize_timeout)
            except UpstreamError as exc:
                logger.debug("[%s] /tokenize on %s failed: %s", req.request_id, inst.base_url, exc)
                continue
            if status in (404, 405):
                inst.tokenize = False
                continue
            if status != 200:
                continue
            try:
                answer = _json_decoder.decode(raw)
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
                continue
            count = answer.get("count") if isinstance(answer, dict) else None
            if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
                inst.tokenize = True
                return count
        return None

    # ------------------------------------------------------------------ legs
    async def _error_status(self, resp: UpstreamResponse, pick: Pick, leg: str, req: _Request) -> None:
        """Turn a non-200 upstream answer into a passthrough (4xx) or a retryable 502 (5xx)."""
        body = await resp.read()
        ctype = resp.header("content-type", "application/json")
        if resp.status < 500:
            self.health.succeeded(pick.inst, req.outcomes)
            raise UpstreamResponseError(resp.status, body, ctype)
        # a gateway error is the instance's (or its host's); a 500 may be the request's own doing
        self.health.failed(pick.inst, "5xx", request=req.outcomes, suspect=resp.status not in (502, 503, 504))
        text = body[:300].decode("utf-8", "replace")
        raise _Retryable(ProxyError(502, f"{leg} instance {pick.inst.base_url} answered {resp.status}: {text}"),
                         pick.inst, "rejected", resp.status)

    def _transport_error(self, exc: UpstreamError, pick: Pick, leg: str, req: _Request) -> Exception:
        base = pick.inst.base_url
        if isinstance(exc, UpstreamTooLarge):  # a request can ask for a huge answer: judged like a 500
            self.health.failed(pick.inst, "too_large", request=req.outcomes, suspect=True)
            return _Retryable(ProxyError(502, f"{leg} instance {base}: {exc}"), pick.inst, "too_large")
        if isinstance(exc, UpstreamConnectTimeout):
            self.health.failed(pick.inst, "connect", request=req.outcomes)
            self.health.mark_down(pick.inst, "connect timed out")
            return _Retryable(ProxyError(502, f"{leg} instance {base} unreachable: {exc}"),
                              pick.inst, "unreachable")
        if isinstance(exc, UpstreamTimeout):
            self.health.failed(pick.inst, "timeout", request=req.outcomes)
            return ProxyError(504, f"{leg} instance {base} timed out")
        self.health.failed(pick.inst, "connection", exc, request=req.outcomes)
        detail = str(exc) or type(exc).__name__
        return _Retryable(ProxyError(502, f"{leg} instance {base} unreachable: {detail}"), pick.inst, "unreachable")

    async def _prefill(self, req: _Request, p: Pick, d: Pick,
                       transfer_id: str) -> tuple[dict[str, Any], int | None, dict[str, Any]]:
        payload = _json_encoder.encode(prefill_request(req.body, d.inst, d.rank, transfer_id, p.inst, p.rank))
        started = time.perf_counter()
        req.spans.prefill_sent()
        try:
            resp = await self.pool.request(p.inst.host, p.inst.http_port,
                                           self._leg_head(req, p.inst, p.rank, len(payload)), payload,
                                           whole=True, total_timeout=self.settings.prefill_timeout)
            if resp.status != 200:
                await self._error_status(resp, p, "prefill", req)
            raw = await resp.read()
        except UpstreamError as exc:
            raise self._transport_error(exc, p, "prefill", req) from None
        self.metrics.prefill_duration.observe(time.perf_counter() - started)
        req.spans.prefill_answered(resp.header(_SERVER_TIMING))
        try:
            answer = _json_decoder.decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            self.health.failed(p.inst, "bad_response", request=req.outcomes)
            raise _Retryable(ProxyError(502, f"prefill instance {p.inst.base_url} returned invalid JSON"),
                             p.inst, "bad_response") from None
        kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(kv, dict):
            self.health.failed(p.inst, "bad_response", request=req.outcomes)
            raise _Retryable(ProxyError(502, f"prefill instance {p.inst.base_url} returned no kv_transfer_params"),
                             p.inst, "bad_response")
        self.health.succeeded(p.inst, req.outcomes)
        if not bounded_first_token(kv, self.settings.max_first_token_text_bytes):
            self.metrics.first_tokens_dropped.inc()
            logger.debug("[%s] prefill %s: first token out of bounds, dropped", req.request_id, p.inst.base_url)
        usage = answer.get("usage")
        prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        logger.debug("[%s] prefill done on %s rank %d", req.request_id, p.inst.base_url, p.rank)
        return kv, prompt_tokens if isinstance(prompt_tokens, int) else None, answer

    # ------------------------------------------------------------------ first-token forwarding
    def _first_token_events(self, req: _Request, d: Pick, prefill_kv: dict[str, Any],
                            answer: dict[str, Any]) -> bytes | None:
        """The client's first event(s) when this pair and request forward the prefill's token, else None."""
        if not self.settings.first_token_forwarding or not forwardable(req.body, d.inst.features, prefill_kv):
            return None
        return first_token_events(answer, chat=req.path.endswith("/chat/completions"), prefill_kv=prefill_kv,
                                  max_text_bytes=self.settings.max_first_token_text_bytes)

    async def _decode_after_first_token(self, req: _Request, p: Pick, d: Pick, prefill_kv: dict[str, Any],
                                        transfer_id: str, prompt_tokens: int | None) -> ResponseStream:
        """The decode leg of a request whose first token is out: owns the abandon and the decode
        pick's credit until its stream takes them over. The client has seen a byte, so the pair
        is not re-planned; a decode engine that cannot be reached is replaced by another one
        reading the same prefill (it never saw the request, so the blocks are still held), up to
        ``max_retries``. Any other failure abandons the prefill and ends the stream with an error."""
        exclude: set[tuple[str, str]] = set()
        for attempt in range(self.settings.max_retries + 1):
            try:
                resp = await self._open_decode(req, p, d, prefill_kv, transfer_id, first_token_sent=True)
                break
            except _Retryable as exc:
                d.credit()
                exclude.add(d.inst.key)
                nxt = (self._pick("D", exclude, req.ctx, d.tokens)
                       if exc.kind == "unreachable" and attempt < self.settings.max_retries else None)
                if nxt is None or nxt.inst.key in exclude:
                    if nxt is not None:
                        nxt.credit()
                    self._abandon_prefill(transfer_id, p, _abandon_reason("decode", exc), prefill_kv)
                    raise
                self.metrics.retries.inc()
                logger.warning("[%s] decode leg failed after the first token (%s); trying %s", req.request_id,
                               exc.error.message, nxt.inst.base_url)
                d = nxt
            except BaseException as exc:
                self._abandon_prefill(transfer_id, p, _abandon_reason("decode", exc), prefill_kv)
                d.credit()
                raise
        return await self._forwarded_decode_stream(resp, req, p, d, prefill_kv, transfer_id, prompt_tokens)

    async def _open_decode(self, req: _Request, p: Pick, d: Pick, prefill_kv: dict[str, Any],
                           transfer_id: str, first_token_sent: bool = False, pending: bool = False) -> UpstreamResponse:
        """The decode leg up to its answer's head; ``pending``: sent with the prefill leg, without the blocks."""
        if pending:
            prefill_kv = {"remote_blocks_pending": True}
            if self.settings.first_token_forwarding and KV_FEATURE_FIRST_TOKEN in d.inst.features:
                prefill_kv["first_token_pending"] = True  # the rendezvous brings it; the decode streams it
        body = decode_request(req.body, prefill_kv, p.inst, p.rank, transfer_id, d.inst, d.rank)
        if first_token_sent:
            body["kv_transfer_params"]["first_token_sent"] = True
        elif not self.settings.first_token_forwarding:
            body["kv_transfer_params"].pop("first_token_ids", None)  # the decode engine computes it again
        payload = _json_encoder.encode(body)
        req.spans.decode_sent(after_prefill=not pending)
        try:
            resp = await self.pool.request(d.inst.host, d.inst.http_port,
                                           self._leg_head(req, d.inst, d.rank, len(payload)), payload,
                                           read_timeout=self.settings.decode_timeout)
        except UpstreamError as exc:
            raise self._transport_error(exc, d, "decode", req) from None
        if resp.status != 200:
            try:
                if resp.header(_KV_FAILURE).lower() == "prefill":
                    await self._prefill_side_failure(resp, p, d, req)
                await self._error_status(resp, d, "decode", req)
            except UpstreamError as exc:
                raise self._transport_error(exc, d, "decode", req) from None
            finally:
                resp.close()
        req.outcomes.served.add(d.inst.key)  # its stream's end tells the breaker; this request was served
        req.spans.decode_answered(resp.header(_SERVER_TIMING))
        return resp

    async def _prefill_side_failure(self, resp: UpstreamResponse, p: Pick, d: Pick, req: _Request) -> None:
        """The decode engine could not read the prefill's KV: charge the prefill
        instance (the decode engine answered as it should) and re-plan the pair."""
        body = await resp.read()
        self.health.succeeded(d.inst, req.outcomes)
        self.health.failed(p.inst, "kv_transfer", request=req.outcomes)
        text = body[:300].decode("utf-8", "replace")
        raise _Retryable(ProxyError(502, f"decode instance {d.inst.base_url} could not read the KV of prefill "
                                         f"instance {p.inst.base_url}: {text}"), p.inst, "kv_transfer")

    async def _respond(self, resp: UpstreamResponse, req: _Request, d: Pick,
                       prompt_tokens: int | None, on_release: Callable[[], None] | None = None) -> RelayResult:
        ctype = resp.header("content-type", "application/json")
        if not ctype.startswith("text/event-stream"):
            try:
                data = await resp.read()
            except UpstreamError as exc:
                err = self._transport_error(exc, d, "decode", req)
                raise (err.error if isinstance(err, _Retryable) else err) from None
            finally:
                resp.close()
            if not data:
                self.health.failed(d.inst, "bad_response", request=req.outcomes)
                raise ProxyError(502, f"decode instance {d.inst.base_url} returned an empty response")
            self.health.succeeded(d.inst, req.outcomes)
            if prompt_tokens is not None and ctype.startswith("application/json"):
                data = self._patch_json_usage(data, prompt_tokens)
            return RelayResult(resp.status, ctype, body=data, spans=req.spans)
        framer = EventFramer(prompt_tokens if prompt_tokens is not None and wants_stream_usage(req.body) else None,
                             self.settings.max_upstream_body_bytes)
        return RelayResult(resp.status, ctype, stream=DecodeStream(resp, req.request_id, d, self.health, framer,
                                                                   self.settings.sse_split_max, on_release),
                           spans=req.spans)

    @staticmethod
    def _patch_json_usage(data: bytes, prompt_tokens: int) -> bytes:
        try:
            obj = _json_decoder.decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return data
        return _json_encoder.encode(obj) if patch_usage(obj, prompt_tokens) else data

    # ------------------------------------------------------------------ /v1/models
    async def models(self, request_id: str, auth: str | None) -> RelayResult:
        now = time.monotonic()
        known = self.registry.live("D", now)
        live = [i for i in known if i.breaker.allows(now)] or (
            [self._least_recently_failed("D", known, set())] if known else [])
        if not live:
            raise self._no_instance("D")
        inst = live[self._models_rr % len(live)]
        self._models_rr += 1
        headers = {"x-request-id": request_id}
        if auth:
            headers["authorization"] = auth
        try:
            status, answer_headers, data = await self.pool.fetch(inst.host, inst.http_port, b"GET", b"/v1/models",
                                                                 headers=headers,
                                                                 total_timeout=self.settings.models_timeout)
        except UpstreamConnectTimeout:
            raise ProxyError(502, f"decode instance {inst.base_url} unreachable: connect timed out") from None
        except UpstreamTimeout:
            raise ProxyError(504, f"decode instance {inst.base_url} timed out") from None
        except UpstreamError as exc:
            self.health.failed(inst, "connection", exc)
            raise ProxyError(502, f"decode instance {inst.base_url} unreachable: {exc}") from None
        return RelayResult(status, answer_headers.get("content-type", "application/json"), body=data)
