"""The relay: checks a request, plans a P/D pair, runs the prefill leg, then hands back the decode leg.

Failures before the client has seen a byte re-plan the whole pair (a fresh
prefill on a different instance; stale ``kv_transfer_params`` are never
reused). A client disconnect cancels whichever leg is running, so the
engines abort. Whenever a prefill was sent but no decode leg took it over
(a retry onto another pair, the client gone, the decode engine unreachable
or refusing before its first byte, the proxy shutting down), the prefill is
abandoned (:meth:`~atom_kv.proxy.relay.pair_legs.PairLegs.abandon_prefill`): its
producer ranks get a release (:mod:`atom_kv.proxy.relay.release`), so its blocks are free at once.

A decode engine that answers an error with ``X-KV-Transfer-Failure: prefill``
could not read the prefill's KV (cannot connect, handshake refused, read
failed, lease expired): the failure is charged to the prefill instance, not
to the decode engine, and the pair is re-planned only when another pair
exists, a different prefill or decode instance (:mod:`atom_kv.proxy.relay.kv_path`);
the same pair again would fail the same way, after a fresh prefill.

Three pair paths: sequential (prefill, then decode) and first-token (the
prefill's token goes to the client while the decode leg is on its way) live
here; the concurrent path (both legs at once) in :mod:`atom_kv.proxy.relay.concurrent`.
Local prefill (``--local-prefill-max-tokens``) has no pair: when the chosen decode rank already
caches all but a few of the prompt's tokens (the KV index), the request goes to it alone.
Before any pick the prompt's token ids are looked up once when a policy or local prefill routes
on them (:mod:`atom_kv.proxy.routing.token_ids`).
The legs themselves go out through :class:`~atom_kv.proxy.relay.pair_legs.PairLegs`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from atom_kv.proxy.admission.queue import AdmissionQueue, Refused
from atom_kv.proxy.fleet.breaker import RequestOutcomes
from atom_kv.proxy.fleet.health import UpstreamHealth
from atom_kv.proxy.fleet.registry import ROLE_NAMES, Instance, Registry, Role
from atom_kv.proxy.http.upstream import UpstreamConnectTimeout, UpstreamError, UpstreamTimeout
from atom_kv.proxy.observability.metrics import ProxyMetrics
from atom_kv.proxy.observability.spans import RequestSpans
from atom_kv.proxy.relay.attempt import PairRequest, RelayResult, Retryable, abandon_reason
from atom_kv.proxy.relay.concurrent import ConcurrentPairs
from atom_kv.proxy.relay.errors import ProxyError
from atom_kv.proxy.relay.first_token import FirstTokenStream, first_token_events, forwardable
from atom_kv.proxy.relay.kv_path import another_pair
from atom_kv.proxy.relay.pair_legs import PairLegs
from atom_kv.proxy.relay.stream import ResponseStream
from atom_kv.proxy.relay.validation import requested_max_tokens
from atom_kv.proxy.routing.pick import Charge, LoadLedger, Pick
from atom_kv.proxy.routing.hf_tokenizer import HfTokenizer
from atom_kv.proxy.routing.policies import Policy, RouteContext, estimate_prompt_tokens, prompt_text
from atom_kv.proxy.routing.token_ids import PromptTokenIds
from atom_kv.proxy.settings import ProxySettings

if TYPE_CHECKING:
    from atom_kv.proxy.kv_events.index import KvIndex
    from atom_kv.proxy.observability.otel import RequestTrace

__all__ = ["Relay", "RelayResult"]

logger = logging.getLogger(__name__)


class Relay:
    """Runs requests through P then D: picks the pair, re-plans it after a retryable failure and
    chooses its path. Owns the :class:`~atom_kv.proxy.relay.pair_legs.PairLegs` (the upstream pool,
    the releaser), the :class:`~atom_kv.proxy.relay.concurrent.ConcurrentPairs` (its background tasks)
    and the :class:`~atom_kv.proxy.routing.pick.LoadLedger` its legs' charges come from; finds each prompt's
    token ids (:class:`~atom_kv.proxy.routing.token_ids.PromptTokenIds`) when a policy or local prefill
    routes on them, keyed once per request in ``kv_index``."""

    def __init__(self, settings: ProxySettings, registry: Registry, policies: dict[str, Policy],
                 health: UpstreamHealth, metrics: ProxyMetrics, *, kv_index: "KvIndex | None" = None,
                 tokenizer: HfTokenizer | None = None) -> None:
        self.settings = settings
        self.registry = registry
        self.policies = policies
        self.health = health
        self.metrics = metrics
        self.legs = PairLegs(settings, health, metrics)
        self.concurrent = ConcurrentPairs(self.legs, settings, health, metrics)
        self.charges = LoadLedger(metrics, log_interval_s=settings.log_summary_interval_s)
        self.admission = AdmissionQueue(registry, metrics, cap=settings.max_concurrent_per_engine,
                                        size=settings.queue_size, timeout_s=settings.queue_timeout)
        if settings.max_concurrent_per_engine:
            self.charges.on_release = self.admission.wake  # a released charge may free a pair for the queue
        self._models_rr = 0
        self._request_keys = itertools.count(1)
        self.kv_index = kv_index
        self.token_ids = PromptTokenIds(self._engine_token_ids, tokenizer,
                                        lambda source: metrics.child(metrics.route_token_ids, source).inc())
        self._wants_token_ids = settings.wants_token_ids or any(p.uses_token_ids for p in policies.values())

    async def start(self) -> None:
        await self.legs.start()

    async def close(self) -> None:
        await self.concurrent.close()
        await self.legs.close()

    # ------------------------------------------------------------------ routing
    def _pick(self, role: Role, exclude: set[tuple[str, str]], ctx: RouteContext, tokens: int) -> Charge | None:
        """Route one leg of ``role``: the charge its holder releases when the leg ends (None: no instance,
        or none under ``--max-concurrent-per-engine``)."""
        now = time.monotonic()
        live = self.registry.routable(role, now)  # the registry's own list: nothing below changes it
        if self.admission.cap:  # --max-concurrent-per-engine: only engines under their cap
            live = self.admission.under_cap(live)
        healthy = self.registry.closed_circuits(role, live, now)
        if not healthy:
            if not live:
                return None
            healthy = [self._least_recently_failed(role, live, exclude)]
        fresh = [i for i in healthy if i.key not in exclude] if exclude else healthy
        inst, rank = self.policies[role].choose(fresh or healthy, ctx)
        inst.breaker.on_dispatch(now)
        self.metrics.routed(role, inst.base_url, rank)
        return self.charges.take(inst, rank, self.policies[role].charged_tokens(inst, rank, ctx, tokens))

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
        token_ids, keys = None, None
        if self._wants_token_ids:
            token_ids = await self.token_ids.of(body, request_id, auth)
            if token_ids is not None:
                tokens = max(1, len(token_ids))
                keys = self.kv_index.prompt_keys(token_ids) if self.kv_index is not None else None
        req = PairRequest(path, body, request_id, auth, RouteContext(text, tokens, token_ids, keys), max_tokens,
                            RequestSpans(self.metrics, received, trace), RequestOutcomes(next(self._request_keys)))
        try:
            return await self._attempts(req, tokens)
        finally:
            self.health.settle(req.outcomes)  # its suspect failures: the instance's, or the request's

    async def _attempts(self, req: PairRequest, tokens: int) -> RelayResult:
        """Plan a pair and run it, re-planning after a retryable failure (``max_retries``)."""
        request_id = req.request_id
        exclude: dict[str, set[tuple[str, str]]] = {"P": set(), "D": set()}
        last_error: ProxyError | None = None
        rejected: list[Retryable] = []
        for attempt in range(self.settings.max_retries + 1):
            if attempt:
                self.metrics.retries.inc()
                await asyncio.sleep(self.settings.retry_backoff_s * (2 ** (attempt - 1)))
            if self.admission.cap:  # --max-concurrent-per-engine: wait for a pair under its caps, then pick it at once
                try:
                    await self.admission.admit(request_id)
                except Refused as refused:
                    raise ProxyError(refused.status, str(refused), retry_after=refused.retry_after) from None
            held = self._decode_held(req)  # before the decode pick records its prediction
            d = self._pick("D", exclude["D"], req.ctx, tokens)
            if d is None:
                raise last_error or self._no_instance("D")
            try:
                with d:  # until a non-streamed answer is read; a stream takes it over (hand_over)
                    if held is not None and self._prefills_locally(req, d, held):
                        return await self._run_local(req, d)
                    p = self._pick("P", exclude["P"], req.ctx, tokens)
                    if p is None:
                        raise last_error or self._no_instance("P")
                    return await self._run_pair(req, p, d)
            except Retryable as exc:
                exclude[exc.inst.role].add(exc.inst.key)
                last_error = exc.error
                logger.warning("[%s] attempt %d failed: %s", request_id, attempt + 1, exc.error.logged)
                if exc.kind in ("rejected", "too_large") and self._request_failure(exc, rejected):
                    break
                if exc.kind == "kv_transfer" and not self._pair_left(exclude, d.inst.key, request_id):
                    break
        assert last_error is not None
        raise last_error

    def _decode_held(self, req: PairRequest) -> dict | None:
        """With local prefill on: how much of the prompt each (instance, DP rank) caches now (None: off, or
        no token ids)."""
        if not self.settings.local_prefill_max_tokens or req.ctx.prompt_keys is None or self.kv_index is None:
            return None
        return self.kv_index.longest_prefix(req.ctx.prompt_keys)

    def _prefills_locally(self, req: PairRequest, d: Pick, held: dict) -> bool:
        """Whether the decode rank ``d`` caches all but at most ``--local-prefill-max-tokens`` of the prompt."""
        assert req.ctx.token_ids is not None
        uncached = len(req.ctx.token_ids) - held.get((d.inst.key, d.rank), 0)
        return uncached <= self.settings.local_prefill_max_tokens

    async def _run_local(self, req: PairRequest, d: Charge) -> RelayResult:
        """The request on the decode engine alone: no prefill leg, no KV moved (its caller's block holds ``d``
        until a stream takes it over)."""
        await self.legs.check_context(req, d, d)
        resp = await self.legs.open_local(req, d)
        self.metrics.local_prefills.inc()
        logger.debug("[%s] local prefill on %s rank %d", req.request_id, d.inst.base_url, d.rank)
        return await self.legs.respond(resp, req, d, None)

    async def _engine_token_ids(self, body: dict[str, Any], request_id: str, auth: str | None) -> list[int] | None:
        """The prompt's ids from a live engine's ``/tokenize`` (decode engines first; at most two asked)."""
        now = time.monotonic()
        asked = [i for i in (*self.registry.live("D", now), *self.registry.live("P", now)) if i.tokenize is not False]
        if not asked:
            return None
        return await self.legs.prompt_token_ids(body, request_id, auth, asked[:2])

    def _pair_left(self, exclude: dict[str, set[tuple[str, str]]], decode: tuple[str, str], request_id: str) -> bool:
        """After a failure of the pair's KV path: whether another pair is left to try (the decode
        instance is excluded too, so the next pair differs in its prefill, its decode or both)."""
        exclude["D"].add(decode)
        if another_pair(self.registry, exclude):
            return True
        logger.warning("[%s] not retried: the decode-to-prefill KV path failed and no other prefill or decode "
                       "instance is left to pair with", request_id)
        return False

    @staticmethod
    def _request_failure(exc: Retryable, rejected: list[Retryable]) -> bool:
        """Whether this failure is the request's own: it failed the same way on another instance
        of the same pool. Then it is not retried (and the breakers, told when the request ends,
        charge no instance for it)."""
        same = [e for e in rejected if e.inst.role == exc.inst.role and e.kind == exc.kind and e.status == exc.status
                and e.inst.key != exc.inst.key]
        rejected.append(exc)
        return bool(same)

    async def _run_pair(self, req: PairRequest, p: Charge, d: Charge) -> RelayResult:
        """One attempt on one pair. Holds the prefill charge ``p`` until its leg ends (its caller's block
        holds ``d``, which an answer's stream takes over) and owns the abandon hook."""
        if self.concurrent.applies(p, d):
            return await self.concurrent.run(req, p, d)
        transfer_id = os.urandom(16).hex()  # one id for both legs, known before the prefill answers
        stage = "check"
        prefill_kv: dict[str, Any] | None = None
        try:
            with p:
                await self.legs.check_context(req, p, d)
                stage = "prefill"
                prefill_kv, prompt_tokens, answer = await self.legs.prefill(req, p, d, transfer_id)
            used = prefill_kv.get("transfer_id")
            if isinstance(used, str) and used:
                transfer_id = used  # the producer's own id if it did not adopt ours
            stage = "decode"
            early = self._first_token_events(req, d, prefill_kv, answer)
            if early is not None:
                stage = "handed_off"  # the decode leg's own task abandons the prefill if it fails
                opening = d.hand_over()  # the task opening the decode leg holds it
                result = RelayResult(200, "text/event-stream", spans=req.spans, stream=FirstTokenStream(
                    early, self._decode_after_first_token(req, p, opening, prefill_kv, transfer_id, prompt_tokens),
                    req.request_id, holds=opening))
                req.spans.ready()
                self.metrics.first_tokens_forwarded.inc()
                return result
            resp = await self.legs.open_decode(req, p, d, prefill_kv, transfer_id)
            stage = "handed_off"  # the decode engine owns the prefill's KV from here on
            return await self.legs.respond(resp, req, d, prompt_tokens, lambda: self.legs.abandon_prefill(
                transfer_id, p, "client_stalled", prefill_kv))
        except BaseException as exc:
            if stage in ("prefill", "decode"):
                self.legs.abandon_prefill(transfer_id, p, abandon_reason(stage, exc), prefill_kv)
            raise

    # ------------------------------------------------------------------ first-token forwarding
    def _first_token_events(self, req: PairRequest, d: Pick, prefill_kv: dict[str, Any],
                            answer: dict[str, Any]) -> bytes | None:
        """The client's first event(s) when this pair and request forward the prefill's token, else None."""
        if not self.settings.first_token_forwarding or not forwardable(req.body, d.inst.features, prefill_kv):
            return None
        return first_token_events(answer, chat=req.path.endswith("/chat/completions"), prefill_kv=prefill_kv,
                                  max_text_bytes=self.settings.max_first_token_text_bytes)

    async def _decode_after_first_token(self, req: PairRequest, p: Pick, d: Charge, prefill_kv: dict[str, Any],
                                        transfer_id: str, prompt_tokens: int | None) -> ResponseStream:
        """The decode leg of a request whose first token is out. Runs as the first-token stream's
        opening task, which holds ``d``; each attempt's block holds its decode charge until the
        stream takes it over. The client has seen a byte, so the pair is not re-planned; a decode
        engine that cannot be reached is replaced by another one reading the same prefill (it never
        saw the request, so the blocks are still held), up to ``max_retries``. Any other failure
        abandons the prefill and ends the stream with an error."""
        exclude: set[tuple[str, str]] = set()
        for attempt in range(self.settings.max_retries + 1):
            with d:
                try:
                    resp = await self.legs.open_decode(req, p, d, prefill_kv, transfer_id, first_token_sent=True)
                except Retryable as exc:
                    exclude.add(d.inst.key)
                    nxt = (self._pick("D", exclude, req.ctx, d.tokens)
                           if exc.kind == "unreachable" and attempt < self.settings.max_retries else None)
                    if nxt is None or nxt.inst.key in exclude:
                        if nxt is not None:
                            nxt.release()
                        self.legs.abandon_prefill(transfer_id, p, abandon_reason("decode", exc), prefill_kv)
                        raise
                    self.metrics.retries.inc()
                    logger.warning("[%s] decode leg failed after the first token (%s); trying %s", req.request_id,
                                   exc.error.logged, nxt.inst.base_url)
                    d = nxt  # held by the next attempt's block; this block gives the failed one back
                    continue
                except BaseException as exc:
                    self.legs.abandon_prefill(transfer_id, p, abandon_reason("decode", exc), prefill_kv)
                    raise
                return await self.legs.forwarded_decode_stream(resp, req, p, d, prefill_kv, transfer_id,
                                                               prompt_tokens)
        raise AssertionError("unreachable: the last attempt returns or raises")

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
            status, answer_headers, data = await self.legs.pool.fetch(inst.host, inst.http_port, b"GET", b"/v1/models",
                                                                 headers=headers,
                                                                 total_timeout=self.settings.models_timeout)
        except UpstreamConnectTimeout:
            raise self.legs.failures.error(502, inst, "could not be reached (connect timed out)",
                                           f"decode instance {inst.base_url} unreachable: connect timed out",
                                           request_id) from None
        except UpstreamTimeout:
            raise self.legs.failures.error(504, inst, "timed out", f"decode instance {inst.base_url} timed out",
                                           request_id) from None
        except UpstreamError as exc:
            self.health.failed(inst, "connection", exc)
            raise self.legs.failures.error(502, inst, "could not be reached",
                                           f"decode instance {inst.base_url} unreachable: {exc}",
                                           request_id) from None
        return RelayResult(status, answer_headers.get("content-type", "application/json"), body=data)
