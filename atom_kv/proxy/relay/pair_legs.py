"""One pair's two legs on the wire: the prefill leg, the decode leg up to its head, the answer to the client.

:class:`PairLegs` owns the upstream connection pool and the releaser. Every pair path
(:mod:`~atom_kv.proxy.relay.relay`, :mod:`~atom_kv.proxy.relay.concurrent`) sends its legs
through it; an upstream failure comes back as a :class:`~atom_kv.proxy.relay.attempt.Retryable`
(re-plan the pair), a :class:`~atom_kv.proxy.relay.errors.ProxyError` or a 4xx passthrough, with
the instance's health told first. A prefill that no decode leg will read is abandoned here
(:meth:`PairLegs.abandon_prefill`): its producer ranks get a release.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any, Callable, Optional, Sequence

import msgspec

from atom_kv.openai_errors import KV_TRANSFER_FAILURE_HEADER
from atom_kv.proxy.fleet.health import UpstreamHealth
from atom_kv.proxy.fleet.registry import Instance
from atom_kv.proxy.http.sse import EventFramer, patch_usage
from atom_kv.proxy.http.upstream import (
    AnswerLimits, UpstreamConnectTimeout, UpstreamError, UpstreamPool, UpstreamResponse, UpstreamTimeout,
    UpstreamTooLarge,
)
from atom_kv.proxy.observability.metrics import ProxyMetrics
from atom_kv.proxy.relay.attempt import PairRequest, RelayResult, Retryable
from atom_kv.proxy.relay.errors import EngineFailures, ProxyError, UpstreamResponseError, engine_text
from atom_kv.proxy.relay.first_token import bounded_first_token
from atom_kv.proxy.relay.kv_path import KV_PATH_FAILED
from atom_kv.proxy.relay.legs import decode_request, local_request, prefill_request, wants_stream_usage
from atom_kv.proxy.relay.release import ProducerAddress, Releaser
from atom_kv.proxy.relay.stream import DecodeStream, ResponseStream
from atom_kv.proxy.relay.validation import context_length_error, could_overflow
from atom_kv.proxy.routing.pick import Charge, Pick
from atom_kv.proxy.routing.policies import token_id_prompt_lengths
from atom_kv.proxy.settings import ProxySettings
from atom_kv.server_timing import HEADER as SERVER_TIMING
from atom_kv.wire import KV_FEATURE_FIRST_TOKEN

__all__ = ["PairLegs"]

logger = logging.getLogger(__name__)

_json_decoder = msgspec.json.Decoder()
_json_encoder = msgspec.json.Encoder()


class TokenizeAnswer(msgspec.Struct):
    """An engine's ``POST /tokenize`` answer (vLLM's shape; other keys are ignored)."""

    count: Annotated[int, msgspec.Meta(ge=0)]
    tokens: Optional[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]]] = None


_tokenize_decoder = msgspec.json.Decoder(TokenizeAnswer)
_KV_FAILURE = KV_TRANSFER_FAILURE_HEADER.lower()
_SERVER_TIMING = SERVER_TIMING.lower()


class PairLegs:
    """Owns the upstream pool (one lean pooled HTTP/1.1 client for both legs, ``/tokenize`` and
    ``/v1/models``) and the releaser; sends legs, reads their answers and abandons prefills."""

    def __init__(self, settings: ProxySettings, health: UpstreamHealth, metrics: ProxyMetrics) -> None:
        self.settings = settings
        self.health = health
        self.metrics = metrics
        self.failures = EngineFailures(settings.expose_upstream_errors)  # words clients hear of engine failures
        self._pool: UpstreamPool | None = None
        self.releaser = (Releaser(metrics, token=settings.registration_token,
                                  log_interval_s=settings.log_summary_interval_s)
                         if settings.release_prefills else None)

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

    async def forwarded_decode_stream(self, resp: UpstreamResponse, req: PairRequest, p: Pick, d: Charge,
                                       prefill_kv: dict[str, Any], transfer_id: str,
                                       prompt_tokens: int | None) -> ResponseStream:
        """The decode answer of a request whose first token is out, as the stream that follows it
        (which takes the decode charge over; without a stream, the caller's block keeps it)."""
        result = await self.respond(resp, req, d, prompt_tokens, lambda: self.abandon_prefill(
            transfer_id, p, "client_stalled", prefill_kv))
        if result.stream is None:
            raise self.failures.error(
                502, d.inst, "answered a streamed request without a stream",
                f"decode instance {d.inst.base_url} answered a streamed request without a stream", req.request_id)
        return result.stream

    def abandon_prefill(self, transfer_id: str, prefill: Pick, reason: str,
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

    def _leg_head(self, req: PairRequest, inst: Instance, rank: int, length: int) -> bytes:
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
    async def check_context(self, req: PairRequest, p: Pick, d: Pick) -> None:
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

    async def _count_tokens(self, req: PairRequest, instances: tuple[Instance, ...]) -> int | None:
        """The prompt's token count: the ids the relay already has, else an engine's ``POST /tokenize``
        (None: no engine can tell)."""
        if req.ctx.token_ids is not None:
            return len(req.ctx.token_ids)
        answer = await self._tokenize(req.body, req.request_id, req.auth, instances)
        return None if answer is None else answer.count

    async def prompt_token_ids(self, body: dict[str, Any], request_id: str, auth: str | None,
                               instances: Sequence[Instance]) -> list[int] | None:
        """The prompt's token ids from the first of ``instances`` whose ``/tokenize`` gives them (None: none)."""
        answer = await self._tokenize(body, request_id, auth, instances)
        return None if answer is None else answer.tokens

    async def _tokenize(self, body: dict[str, Any], request_id: str, auth: str | None,
                        instances: Sequence[Instance]) -> TokenizeAnswer | None:
        """The first good ``POST /tokenize`` answer of ``instances`` (each bounded by ``--tokenize-timeout``)."""
        payload: dict[str, Any] = {}
        if isinstance(body.get("model"), str):
            payload["model"] = body["model"]
        if "messages" in body and "prompt" not in body:
            payload["messages"] = body["messages"]
        else:
            payload["prompt"] = body.get("prompt")
        data = _json_encoder.encode(payload)
        for inst in instances:
            if inst.tokenize is False:
                continue
            try:
                status, _, raw = await self.pool.fetch(inst.host, inst.http_port, b"POST", b"/tokenize", body=data,
                                                       headers=self._headers(request_id, 0, auth),
                                                       total_timeout=self.settings.tokenize_timeout)
            except UpstreamError as exc:
                logger.debug("[%s] /tokenize on %s failed: %s", request_id, inst.base_url, exc)
                continue
            if status in (404, 405):
                inst.tokenize = False
                continue
            if status != 200:
                continue
            try:
                answer = _tokenize_decoder.decode(raw)
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
                self.metrics.bad_tokenize_answers.inc()
                logger.debug("[%s] /tokenize on %s: unreadable answer (%s)", request_id, inst.base_url, exc)
                continue
            inst.tokenize = True
            return answer
        return None

    # ------------------------------------------------------------------ legs
    async def _error_status(self, resp: UpstreamResponse, pick: Pick, leg: str, req: PairRequest) -> None:
        """Turn a non-200 upstream answer into a passthrough (4xx) or a retryable 502 (5xx)."""
        body = await resp.read()
        ctype = resp.header("content-type", "application/json")
        if resp.status < 500:
            self.health.succeeded(pick.inst, req.outcomes)
            raise UpstreamResponseError(resp.status, body, ctype)
        # a gateway error is the instance's (or its host's); a 500 may be the request's own doing
        self.health.failed(pick.inst, "5xx", request=req.outcomes, suspect=resp.status not in (502, 503, 504))
        detail = f"{leg} instance {pick.inst.base_url} answered {resp.status}: {engine_text(body)}"
        raise Retryable(self.failures.error(502, pick.inst, f"answered {resp.status}", detail, req.request_id),
                        pick.inst, "rejected", resp.status)

    def _transport_error(self, exc: UpstreamError, pick: Pick, leg: str, req: PairRequest) -> Exception:
        base, inst, rid = pick.inst.base_url, pick.inst, req.request_id
        if isinstance(exc, UpstreamTooLarge):  # a request can ask for a huge answer: judged like a 500
            self.health.failed(inst, "too_large", request=req.outcomes, suspect=True)
            # the message is the proxy's own (it names the flag): the client may read it
            return Retryable(self.failures.error(502, inst, f"sent too much: {exc}", f"{leg} instance {base}: {exc}",
                                                 rid), inst, "too_large")
        if isinstance(exc, UpstreamConnectTimeout):
            self.health.failed(inst, "connect", request=req.outcomes)
            self.health.mark_down(inst, "connect timed out")
            return Retryable(self.failures.error(502, inst, "could not be reached (connect timed out)",
                                                 f"{leg} instance {base} unreachable: {exc}", rid),
                             inst, "unreachable")
        if isinstance(exc, UpstreamTimeout):
            self.health.failed(inst, "timeout", request=req.outcomes)
            return self.failures.error(504, inst, "timed out", f"{leg} instance {base} timed out", rid)
        self.health.failed(inst, "connection", exc, request=req.outcomes)
        detail = str(exc) or type(exc).__name__
        return Retryable(self.failures.error(502, inst, "could not be reached",
                                             f"{leg} instance {base} unreachable: {detail}", rid),
                         inst, "unreachable")

    async def prefill(self, req: PairRequest, p: Pick, d: Pick,
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
            raise Retryable(self.failures.error(502, p.inst, "returned invalid JSON",
                                                f"prefill instance {p.inst.base_url} returned invalid JSON",
                                                req.request_id), p.inst, "bad_response") from None
        kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(kv, dict):
            self.health.failed(p.inst, "bad_response", request=req.outcomes)
            raise Retryable(self.failures.error(502, p.inst, "returned no kv_transfer_params",
                                                f"prefill instance {p.inst.base_url} returned no kv_transfer_params",
                                                req.request_id), p.inst, "bad_response")
        self.health.succeeded(p.inst, req.outcomes)
        if not bounded_first_token(kv, self.settings.max_first_token_text_bytes):
            self.metrics.first_tokens_dropped.inc()
            logger.debug("[%s] prefill %s: first token out of bounds, dropped", req.request_id, p.inst.base_url)
        usage = answer.get("usage")
        prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        logger.debug("[%s] prefill done on %s rank %d", req.request_id, p.inst.base_url, p.rank)
        return kv, prompt_tokens if isinstance(prompt_tokens, int) else None, answer

    async def open_decode(self, req: PairRequest, p: Pick, d: Pick, prefill_kv: dict[str, Any],
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
        return await self._send_decode(req, d, payload, prefill=p)

    async def open_local(self, req: PairRequest, d: Pick) -> UpstreamResponse:
        """A request for the decode engine alone (local prefill), up to its answer's head."""
        payload = _json_encoder.encode(local_request(req.body, d.inst, d.rank))
        req.spans.decode_sent(after_prefill=False)
        return await self._send_decode(req, d, payload)

    async def _send_decode(self, req: PairRequest, d: Pick, payload: bytes,
                           prefill: Pick | None = None) -> UpstreamResponse:
        """Send ``payload`` to the decode engine and read its answer's head: an error status raises (charged to
        ``prefill`` when the decode says its KV could not be read from there), a 200 is returned."""
        try:
            resp = await self.pool.request(d.inst.host, d.inst.http_port,
                                           self._leg_head(req, d.inst, d.rank, len(payload)), payload,
                                           read_timeout=self.settings.decode_timeout)
        except UpstreamError as exc:
            raise self._transport_error(exc, d, "decode", req) from None
        if resp.status != 200:
            try:
                if prefill is not None and resp.header(_KV_FAILURE).lower() == "prefill":
                    await self._prefill_side_failure(resp, prefill, d, req)
                await self._error_status(resp, d, "decode", req)
            except UpstreamError as exc:
                raise self._transport_error(exc, d, "decode", req) from None
            finally:
                resp.close()
        req.outcomes.served.add(d.inst.key)  # its stream's end tells the breaker; this request was served
        req.spans.decode_answered(resp.header(_SERVER_TIMING))
        return resp

    async def _prefill_side_failure(self, resp: UpstreamResponse, p: Pick, d: Pick, req: PairRequest) -> None:
        """The decode engine could not read the prefill's KV: charge the prefill
        instance (the decode engine answered as it should) and re-plan the pair."""
        body = await resp.read()
        self.health.succeeded(d.inst, req.outcomes)
        self.health.failed(p.inst, "kv_transfer", request=req.outcomes)
        detail = (f"decode instance {d.inst.base_url} could not read the KV of prefill instance {p.inst.base_url}: "
                  f"{engine_text(body)}")
        raise Retryable(self.failures.error(502, p.inst, "could not hand its KV cache to the decode engine", detail,
                                            req.request_id, prefix=KV_PATH_FAILED), p.inst, "kv_transfer")

    async def respond(self, resp: UpstreamResponse, req: PairRequest, d: Charge,
                       prompt_tokens: int | None, on_release: Callable[[], None] | None = None) -> RelayResult:
        """The decode leg's answer for the client: read whole (the caller's block holds ``d`` meanwhile),
        or a :class:`~atom_kv.proxy.relay.stream.DecodeStream`, which takes ``d`` over."""
        ctype = resp.header("content-type", "application/json")
        if not ctype.startswith("text/event-stream"):
            try:
                data = await resp.read()
            except UpstreamError as exc:
                err = self._transport_error(exc, d, "decode", req)
                raise (err.error if isinstance(err, Retryable) else err) from None
            finally:
                resp.close()
            if not data:
                self.health.failed(d.inst, "bad_response", request=req.outcomes)
                raise self.failures.error(502, d.inst, "returned an empty response",
                                          f"decode instance {d.inst.base_url} returned an empty response",
                                          req.request_id)
            self.health.succeeded(d.inst, req.outcomes)
            if prompt_tokens is not None and ctype.startswith("application/json"):
                data = self._patch_json_usage(data, prompt_tokens)
            return RelayResult(resp.status, ctype, body=data, spans=req.spans)
        framer = EventFramer(prompt_tokens if prompt_tokens is not None and wants_stream_usage(req.body) else None,
                             self.settings.max_upstream_body_bytes)
        stream = DecodeStream(resp, req.request_id, d.hand_over(), self.health, framer, self.settings.sse_split_max,
                              on_release, failures=self.failures)
        return RelayResult(resp.status, ctype, stream=stream, spans=req.spans)

    @staticmethod
    def _patch_json_usage(data: bytes, prompt_tokens: int) -> bytes:
        try:
            obj = _json_decoder.decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return data
        return _json_encoder.encode(obj) if patch_usage(obj, prompt_tokens) else data
