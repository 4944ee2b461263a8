"""The relay: plans a P/D pair, runs the prefill leg, then streams the decode leg back.

Failures before the client has seen a byte re-plan the whole pair (a fresh
prefill on a different instance; stale ``kv_transfer_params`` are never reused).
A client disconnect cancels whichever leg is running, so the engines abort.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import aiohttp
import msgspec

from atom_kv.proxy.errors import ProxyError, UpstreamResponseError, sse_error_event
from atom_kv.proxy.legs import decode_request, prefill_request, wants_stream_usage
from atom_kv.proxy.metrics import ProxyMetrics
from atom_kv.proxy.policies import Policy, RouteContext, estimate_prompt_tokens, prompt_text
from atom_kv.proxy.registry import ROLE_NAMES, Instance, Registry, Role
from atom_kv.proxy.settings import ProxySettings
from atom_kv.proxy.sse import UsageRewriter, patch_usage

logger = logging.getLogger(__name__)

_json_decoder = msgspec.json.Decoder()
_json_encoder = msgspec.json.Encoder()


class _Retryable(Exception):
    """An upstream failure worth re-planning the pair for."""

    def __init__(self, error: ProxyError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass
class Pick:
    """One leg's routing decision and what was charged for it."""

    inst: Instance
    rank: int
    tokens: int
    credited: bool = False

    def credit(self) -> None:
        if not self.credited:
            self.credited = True
            self.inst.credit(self.rank, self.tokens)


@dataclass
class RelayResult:
    """What the HTTP layer turns into a response: a body, or a byte stream."""

    status: int
    content_type: str
    body: bytes | None = None
    stream: AsyncIterator[bytes] | None = None


class Relay:
    """Owns the pooled upstream HTTP session and runs requests through P then D."""

    def __init__(self, settings: ProxySettings, registry: Registry, policy: Policy, metrics: ProxyMetrics) -> None:
        self.settings = settings
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        self._models_rr = 0
        self._prefill_timeout = aiohttp.ClientTimeout(
            total=settings.prefill_timeout, connect=settings.connect_timeout
        )
        self._decode_timeout = aiohttp.ClientTimeout(
            total=None, connect=settings.connect_timeout, sock_read=settings.decode_timeout
        )
        self._models_timeout = aiohttp.ClientTimeout(total=settings.models_timeout, connect=settings.connect_timeout)

    async def start(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self.settings.max_upstream_connections, limit_per_host=0, keepalive_timeout=30.0
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, connect=self.settings.connect_timeout),
                cookie_jar=aiohttp.DummyCookieJar(),  # never carry one client's upstream cookies to another
            )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise ProxyError(503, "proxy is not started")
        return self._session

    # ------------------------------------------------------------------ routing
    def _pick(self, role: Role, exclude: set[tuple[str, str]], ctx: RouteContext, tokens: int) -> Pick | None:
        now = time.monotonic()
        live = self.registry.live(role, now)
        if not live:
            return None
        healthy = [i for i in live if i.breaker.allows(now)]
        fresh = [i for i in healthy if i.key not in exclude]
        candidates = fresh or healthy
        if not candidates:
            return None
        inst, rank = self.policy.choose(role, candidates, ctx)
        inst.breaker.on_dispatch(now)
        inst.charge(rank, tokens)
        return Pick(inst, rank, tokens)

    def _no_instance(self, role: Role) -> ProxyError:
        live = self.registry.live(role)
        name = ROLE_NAMES[role]
        if not live:
            return ProxyError(503, f"no live {name} instance is registered")
        return ProxyError(503, f"all {len(live)} {name} instance(s) are unhealthy (circuit open)")

    def _failed(self, pick: Pick, kind: str) -> None:
        name = ROLE_NAMES[pick.inst.role]
        self.metrics.upstream_failures.labels(name, kind).inc()
        if pick.inst.breaker.record_failure(time.monotonic()):
            self.metrics.circuit_opened.labels(name).inc()
            logger.warning(
                "circuit opened for %s instance %s after %d consecutive failures",
                name, pick.inst.base_url, pick.inst.breaker.failures,
            )

    # ------------------------------------------------------------------ relay
    async def relay(self, path: str, body: dict[str, Any], request_id: str, auth: str | None) -> RelayResult:
        """Run one completion request; raises ProxyError / UpstreamResponseError for error replies."""
        tokens = estimate_prompt_tokens(body)
        prefix = prompt_text(body)[: self.settings.prefix_chars] if self.policy.uses_prefix else ""
        ctx = RouteContext(prefix=prefix, prompt_tokens=tokens)
        exclude_p: set[tuple[str, str]] = set()
        exclude_d: set[tuple[str, str]] = set()
        last_error: ProxyError | None = None
        for attempt in range(self.settings.max_retries + 1):
            if attempt:
                self.metrics.retries.inc()
                await asyncio.sleep(self.settings.retry_backoff_s * (2 ** (attempt - 1)))
            d = self._pick("D", exclude_d, ctx, tokens)
            if d is None:
                raise last_error or self._no_instance("D")
            p = self._pick("P", exclude_p, ctx, tokens)
            if p is None:
                d.credit()
                raise last_error or self._no_instance("P")
            handed_off = False
            try:
                try:
                    prefill_kv, prompt_tokens = await self._prefill(path, body, request_id, auth, p, d)
                except _Retryable as exc:
                    exclude_p.add(p.inst.key)
                    last_error = exc.error
                    logger.warning("[%s] prefill attempt %d failed: %s", request_id, attempt + 1, exc.error.message)
                    continue
                finally:
                    p.credit()
                try:
                    resp = await self._open_decode(path, body, request_id, auth, p, d, prefill_kv)
                except _Retryable as exc:
                    exclude_d.add(d.inst.key)
                    last_error = exc.error
                    logger.warning("[%s] decode attempt %d failed: %s", request_id, attempt + 1, exc.error.message)
                    continue
                handed_off = True
                return await self._respond(resp, body, request_id, d, prompt_tokens)
            finally:
                if not handed_off:
                    d.credit()
        assert last_error is not None
        raise last_error

    def _headers(self, request_id: str, rank: int, auth: str | None) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id, "X-data-parallel-rank": str(rank)}
        if auth:
            headers["Authorization"] = auth
        return headers

    async def _error_status(self, resp: aiohttp.ClientResponse, pick: Pick, leg: str) -> None:
        """Turn a non-200 upstream answer into a passthrough (4xx) or a retryable 502 (5xx)."""
        body = await resp.read()
        ctype = resp.headers.get("Content-Type", "application/json")
        if resp.status < 500:
            pick.inst.breaker.record_success()
            raise UpstreamResponseError(resp.status, body, ctype)
        self._failed(pick, "5xx")
        text = body[:300].decode("utf-8", "replace")
        raise _Retryable(ProxyError(502, f"{leg} instance {pick.inst.base_url} answered {resp.status}: {text}"))

    def _transport_error(self, exc: BaseException, pick: Pick, leg: str) -> Exception:
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            self._failed(pick, "connect")
            return _Retryable(ProxyError(502, f"{leg} instance {pick.inst.base_url} unreachable: connect timed out"))
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
            self._failed(pick, "timeout")
            return ProxyError(504, f"{leg} instance {pick.inst.base_url} timed out")
        self._failed(pick, "connection")
        detail = str(exc) or type(exc).__name__
        return _Retryable(ProxyError(502, f"{leg} instance {pick.inst.base_url} unreachable: {detail}"))

    async def _prefill(
        self, path: str, body: dict[str, Any], request_id: str, auth: str | None, p: Pick, d: Pick
    ) -> tuple[dict[str, Any], int | None]:
        payload = _json_encoder.encode(prefill_request(body, d.inst, d.rank))
        started = time.perf_counter()
        try:
            async with self.session.post(
                p.inst.url(path), data=payload, headers=self._headers(request_id, p.rank, auth),
                timeout=self._prefill_timeout,
            ) as resp:
                if resp.status != 200:
                    await self._error_status(resp, p, "prefill")
                raw = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self._transport_error(exc, p, "prefill") from None
        self.metrics.prefill_duration.observe(time.perf_counter() - started)
        try:
            answer = _json_decoder.decode(raw)
        except msgspec.DecodeError:
            self._failed(p, "bad_response")
            raise _Retryable(ProxyError(502, f"prefill instance {p.inst.base_url} returned invalid JSON")) from None
        kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(kv, dict):
            self._failed(p, "bad_response")
            raise _Retryable(
                ProxyError(502, f"prefill instance {p.inst.base_url} returned no kv_transfer_params")
            )
        p.inst.breaker.record_success()
        usage = answer.get("usage")
        prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        logger.debug("[%s] prefill done on %s rank %d", request_id, p.inst.base_url, p.rank)
        return kv, prompt_tokens if isinstance(prompt_tokens, int) else None

    async def _open_decode(
        self, path: str, body: dict[str, Any], request_id: str, auth: str | None, p: Pick, d: Pick,
        prefill_kv: dict[str, Any],
    ) -> aiohttp.ClientResponse:
        payload = _json_encoder.encode(decode_request(body, prefill_kv, p.inst, p.rank))
        try:
            resp = await self.session.post(
                d.inst.url(path), data=payload, headers=self._headers(request_id, d.rank, auth),
                timeout=self._decode_timeout,
            )
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self._transport_error(exc, d, "decode") from None
        if resp.status != 200:
            try:
                await self._error_status(resp, d, "decode")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise self._transport_error(exc, d, "decode") from None
            finally:
                resp.release()
        return resp

    async def _respond(
        self, resp: aiohttp.ClientResponse, body: dict[str, Any], request_id: str, d: Pick,
        prompt_tokens: int | None,
    ) -> RelayResult:
        ctype = resp.headers.get("Content-Type", "application/json")
        if not ctype.startswith("text/event-stream"):
            try:
                try:
                    data = await resp.read()
                    resp.release()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    raise self._transport_error(exc, d, "decode") from None
                finally:
                    if not resp.closed:
                        resp.close()
                d.inst.breaker.record_success()
            except _Retryable as exc:
                raise exc.error from None
            finally:
                d.credit()
            if not data:
                self._failed(d, "bad_response")
                raise ProxyError(502, f"decode instance {d.inst.base_url} returned an empty response")
            if prompt_tokens is not None and ctype.startswith("application/json"):
                data = self._patch_json_usage(data, prompt_tokens)
            return RelayResult(resp.status, ctype, body=data)
        rewriter = UsageRewriter(prompt_tokens) if prompt_tokens is not None and wants_stream_usage(body) else None
        return RelayResult(resp.status, ctype, stream=DecodeStream(self, resp, request_id, d, rewriter))

    @staticmethod
    def _patch_json_usage(data: bytes, prompt_tokens: int) -> bytes:
        try:
            obj = _json_decoder.decode(data)
        except msgspec.DecodeError:
            return data
        return _json_encoder.encode(obj) if patch_usage(obj, prompt_tokens) else data

    async def models(self, request_id: str, auth: str | None) -> RelayResult:
        now = time.monotonic()
        live = [i for i in self.registry.live("D", now) if i.breaker.allows(now)]
        if not live:
            raise self._no_instance("D")
        inst = live[self._models_rr % len(live)]
        self._models_rr += 1
        headers = {"X-Request-Id": request_id}
        if auth:
            headers["Authorization"] = auth
        try:
            async with self.session.get(inst.url("/v1/models"), headers=headers, timeout=self._models_timeout) as resp:
                data = await resp.read()
                return RelayResult(resp.status, resp.headers.get("Content-Type", "application/json"), body=data)
        except aiohttp.ConnectionTimeoutError:
            raise ProxyError(502, f"decode instance {inst.base_url} unreachable: connect timed out") from None
        except (asyncio.TimeoutError, TimeoutError):
            raise ProxyError(504, f"decode instance {inst.base_url} timed out") from None
        except aiohttp.ClientError as exc:
            raise ProxyError(502, f"decode instance {inst.base_url} unreachable: {exc}") from None


class DecodeStream:
    """The decode leg's body as an async iterator the HTTP layer streams out.

    Ends with a ``data: {"error": ...}`` event plus ``data: [DONE]`` if the
    upstream fails mid-way. ``aclose()`` before the end (the client went away)
    drops the upstream connection so the decode engine aborts the request; it
    is safe to call whether or not iteration ever started, and more than once.
    """

    def __init__(
        self, relay: "Relay", resp: aiohttp.ClientResponse, request_id: str, d: Pick,
        rewriter: UsageRewriter | None,
    ) -> None:
        self._relay = relay
        self._resp = resp
        self._chunks = resp.content.iter_any()
        self._request_id = request_id
        self._d = d
        self._rewriter = rewriter
        self._done = False
        self._sent_any = False

    def __aiter__(self) -> "DecodeStream":
        return self

    async def __anext__(self) -> bytes:
        while not self._done:
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                tail = self._rewriter.flush() if self._rewriter is not None else b""
                if not tail and not self._sent_any:
                    self._relay._failed(self._d, "bad_response")
                    self._finish(ok=False)
                    return sse_error_event(502, f"decode instance {self._d.inst.base_url} sent an empty stream")
                self._d.inst.breaker.record_success()
                self._finish(ok=True)
                if tail:
                    return tail
                break
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                err = self._relay._transport_error(exc, self._d, "decode")
                error = err.error if isinstance(err, _Retryable) else err
                assert isinstance(error, ProxyError)
                logger.warning("[%s] decode stream failed mid-way: %s", self._request_id, error.message)
                self._finish(ok=False)
                return sse_error_event(error.status, f"decode stream interrupted: {error.message}")
            except BaseException:
                await self.aclose()
                raise
            if self._rewriter is not None:
                chunk = self._rewriter.feed(chunk)
            if chunk:
                self._sent_any = True
                return chunk
        raise StopAsyncIteration

    def _finish(self, ok: bool) -> None:
        if self._done:
            return
        self._done = True
        if ok:
            self._resp.release()
        else:
            self._resp.close()
        self._d.credit()

    async def aclose(self) -> None:
        if self._done:
            return
        self._done = True
        self._resp.close()
        self._d.credit()
        self._relay.metrics.client_disconnects.inc()
        logger.info("[%s] client disconnected mid-stream; decode leg cancelled", self._request_id)
