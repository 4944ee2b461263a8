"""OpenAI-compatible HTTP front end (aiohttp) of the reference engine.

The asyncio loop never touches the model: requests go to the
:class:`EngineCore` loop thread, and outputs come back through an
:class:`OutputRouter` (``call_soon_threadsafe`` into per-request queues).
A client that disconnects gets its request aborted, which frees its blocks.

A malformed body or field is a 400 naming it (:mod:`.request_body`,
:mod:`.openai_protocol`); a request that fails inside the engine is a 500 in
the OpenAI error shape (an error event, then ``[DONE]``, once its stream has
begun); an unexpected exception in a handler is a 500 in that shape too,
logged once with its traceback, and the engine goes on serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, Optional

from aiohttp import web

from atom_kv.logfmt import REQUEST_ID
from atom_kv.openai_errors import KV_TRANSFER_FAILURE_HEADER, error_body
from atom_kv.reference.dp import DataParallelEngine
from atom_kv.reference.first_token import FEATURE as FIRST_TOKEN
from atom_kv.reference.first_token import first_token_sent, with_first_token_text
from atom_kv.reference.metrics import EngineMetrics
from atom_kv.reference.openai_protocol import (
    GenerateParams,
    chunk_body,
    completion_body,
    now_s,
    parse_request,
    parse_tokenize,
    usage,
)
from atom_kv.reference.request import Request, RequestError, RequestOutput
from atom_kv.reference.request_body import ClientGone, read_json_body
from atom_kv.reference.tokenizer import ByteTokenizer, IncrementalDetokenizer
from atom_kv.server_timing import HEADER as SERVER_TIMING
from atom_kv.server_timing import format_server_timing
from atom_kv.wire import KV_FEATURE_RENDEZVOUS

__all__ = ["OutputRouter", "OpenAIServer"]

log = logging.getLogger(__name__)

_POLL_S = 0.5  # how often a waiting handler checks whether its client went away
_MAX_REQUEST_ID_CHARS = 128  # a client's X-Request-Id longer than this (or not printable ASCII) is not used


class OutputRouter:
    """Hands engine outputs (from the loop thread) to per-request asyncio queues."""

    def __init__(self) -> None:
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}

    def register(self, rid: str) -> "asyncio.Queue[RequestOutput]":
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[rid] = q
        return q

    def unregister(self, rid: str) -> None:
        self._queues.pop(rid, None)

    def deliver(self, out: RequestOutput) -> None:
        """Called from the engine thread."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._put, out)
        except RuntimeError:  # loop closed while shutting down
            pass

    def _put(self, out: RequestOutput) -> None:
        q = self._queues.get(out.request_id)
        if q is not None:
            q.put_nowait(out)


def _json(body: Any, status: int = 200, headers: Optional[dict[str, str]] = None) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, content_type="application/json", headers=headers)


def _error(message: str, status: int, param: Optional[str] = None,
           headers: Optional[dict[str, str]] = None) -> web.Response:
    return _json(error_body(status, message, param), status=status, headers=headers)


def _with_side(headers: dict[str, str], out: RequestOutput) -> dict[str, str]:
    """``headers``, plus the header naming the prefill side when it caused the error."""
    if out.error_side is None:
        return headers
    return {**headers, KV_TRANSFER_FAILURE_HEADER: out.error_side}


def _timed(headers: dict[str, str], req: Request) -> dict[str, str]:
    """``headers`` plus ``Server-Timing`` with the request's spans to its first token (the engine
    thread set them before it delivered the output that got us here)."""
    spans = req.spans()
    return {**headers, SERVER_TIMING: format_server_timing(spans)} if spans else headers


def _client_request_id(request: web.Request) -> Optional[str]:
    """The client's ``X-Request-Id`` when it is printable ASCII of at most 128 characters (it is
    echoed in a header and logged), else None (the engine names the request itself)."""
    value = request.headers.get("X-Request-Id")
    if value and len(value) <= _MAX_REQUEST_ID_CHARS and value.isascii() and value.isprintable():
        return value
    return None


def _events_of(core: Any) -> Optional[dict[str, str]]:
    """Where a DP rank's KV events are published (None: not published)."""
    endpoint, replay = core.kv_events_endpoints
    if endpoint is None:
        return None
    return {"endpoint": endpoint, "replay_endpoint": replay} if replay else {"endpoint": endpoint}


@web.middleware
async def _request_id_in_logs(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every line logged while a request is served carries its ``X-Request-Id`` (``--log-format json``)."""
    token = REQUEST_ID.set(_client_request_id(request))
    try:
        return await handler(request)
    finally:
        REQUEST_ID.reset(token)


@web.middleware
async def _json_http_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error answers in the OpenAI error shape, not HTML: unknown paths (404), wrong methods
    (405), aiohttp's own refusals, and a handler's unexpected exception (a 500, logged with its
    traceback: a bug, not the client's mistake; the engine goes on)."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return _error(f"method {request.method} is not allowed on {request.path}; use {allowed}", 405,
                      headers={"Allow": allowed})
    except web.HTTPNotFound:
        return _error(f"no such endpoint: {request.method} {request.path}", 404)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.reason, exc.status)
    except Exception:
        log.exception("%s %s failed inside the engine's HTTP handler", request.method, request.path)
        return _error("internal error in the engine's HTTP handler; the engine log has the details", 500)


class OpenAIServer:
    """Owns the aiohttp application: OpenAI routes, vLLM's ``/tokenize``, ``/health`` and ``/metrics``."""

    def __init__(self, engine: DataParallelEngine, router: OutputRouter, *, default_max_tokens: int = 16) -> None:
        self.engine = engine
        self.router = router
        self.tokenizer = ByteTokenizer()
        self.model_id = engine.args.model_id
        self.default_max_tokens = default_max_tokens
        self.metrics = EngineMetrics(engine)
        self.app = web.Application(client_max_size=64 * 2**20, middlewares=[_request_id_in_logs, _json_http_errors])
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/tokenize", self.tokenize)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics_handler)
        self.app.on_startup.append(self._on_startup)

    async def _on_startup(self, app: web.Application) -> None:
        self.router.loop = asyncio.get_running_loop()

    # ------------------------------------------------------------------ simple routes
    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [{
            "id": self.model_id, "object": "model", "created": now_s(), "owned_by": "atom-kv",
            "root": self.model_id, "max_model_len": self.engine.args.max_model_len}]})

    async def health(self, request: web.Request) -> web.Response:
        snaps = self.engine.snapshots()

        def total(key: str) -> int:
            return sum(s[key] for s in snaps)

        body = {
            "status": "error" if self.engine.fatal else "ok",
            "role": self.engine.role,
            "engine_id": self.engine.engine_id,
            "tp_size": self.engine.args.tp,
            "dp_size": self.engine.dp_size,
            "kv_features": [FIRST_TOKEN, KV_FEATURE_RENDEZVOUS] if self.engine.role != "colocated" else [],
            "kv_blocks": {"total": total("kv_total"), "free": total("kv_free"), "held": total("kv_held"),
                          "cached": total("kv_cached")},
            "requests": {"running": total("running"), "waiting": total("waiting"),
                         "waiting_remote_kv": total("waiting_remote")},
            "dp_ranks": [{
                "dp_rank": rank,
                "engine_id": self.engine.cores[rank].engine_id,
                "kv_blocks": {"total": s["kv_total"], "free": s["kv_free"], "held": s["kv_held"],
                              "cached": s["kv_cached"]},
                "kv_events": _events_of(self.engine.cores[rank]),
                "requests": {"running": s["running"], "waiting": s["waiting"],
                             "waiting_remote_kv": s["waiting_remote"]},
                "load": {"requests": s["load_requests"], "prompt_tokens": s["load_prompt_tokens"]},
            } for rank, s in enumerate(snaps)],
        }
        body["kv_routes"] = [
            {"dp_rank": dp_rank, "rank": rank, **report.as_dict()}
            for dp_rank, core in enumerate(self.engine.cores)
            for rank, report in sorted(list(core.worker_routes.items()))
        ]
        if self.engine.fatal:
            body["error"] = self.engine.fatal
        return _json(body, status=503 if self.engine.fatal else 200)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize``: what a prompt costs here, before spending a prefill on it."""
        try:
            body = await read_json_body(request)
            params = parse_tokenize(body, self.tokenizer, served_model=self.model_id)
        except RequestError as exc:
            return _error(exc.message, exc.status, exc.param)
        except ClientGone as exc:
            log.info("POST /tokenize: %s", exc)
            return web.Response(status=499)  # nobody reads it
        return _json({"count": len(params.prompt_ids), "max_model_len": self.engine.args.max_model_len,
                      "tokens": params.prompt_ids})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    # ------------------------------------------------------------------ generation
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        arrival = time.monotonic()
        client_rid = _client_request_id(request)
        suffix = uuid.uuid4().hex[:12]
        rid = f"{client_rid}-{suffix}" if client_rid else f"{'chatcmpl' if chat else 'cmpl'}-{suffix}"
        headers = {"X-Request-Id": client_rid or rid}
        if client_rid is None:
            REQUEST_ID.set(rid)  # the engine named it: its lines carry that name (the middleware resets it)
        try:
            body = await read_json_body(request)
        except RequestError as exc:
            return _error(exc.message, exc.status, exc.param, headers=headers)
        except ClientGone as exc:
            log.info("request %s: %s", rid, exc)
            return web.Response(status=499)  # nobody reads it
        try:
            params = parse_request(body, self.tokenizer, chat=chat, default_max_tokens=self.default_max_tokens,
                                   served_model=self.model_id)
            rank = self.engine.rank_for(body, request.headers)
        except RequestError as exc:
            self.engine.reject(body.get("kv_transfer_params") if isinstance(body, dict) else None)
            return _error(exc.message, exc.status, exc.param, headers=headers)
        req = Request(request_id=rid, prompt_ids=params.prompt_ids, max_tokens=params.max_tokens,
                      temperature=params.temperature, seed=params.seed,
                      kv_transfer_params=params.kv_transfer_params, stop=params.stop,
                      stop_token_ids=params.stop_token_ids, arrival_time=arrival)
        queue = self.router.register(rid)
        finished = False
        try:
            try:
                self.engine.submit(req, rank)
            except RequestError as exc:
                finished = True
                log.info("request %s rejected: %s", rid, exc.message)
                self.engine.reject(params.kv_transfer_params, rank)
                return _error(exc.message, exc.status, exc.param, headers=headers)
            log.debug("request %s: %d prompt tokens, max_tokens %d, stream=%s, dp rank %d", rid,
                      len(params.prompt_ids), params.max_tokens, params.stream, rank)
            if params.stream:
                resp, finished = await self._stream(request, queue, req, params, chat, headers)
                return resp
            resp, finished = await self._collect(request, queue, req, params, chat, headers)
            return resp
        except ClientGone:
            log.info("request %s: client disconnected", rid)
            return web.Response(status=499)  # nobody reads it
        finally:
            self.router.unregister(rid)
            if not finished:
                self.engine.abort(rid)
            self.engine.finish(rid)

    async def _next(self, request: web.Request, queue: "asyncio.Queue[RequestOutput]") -> RequestOutput:
        while True:
            try:
                return await asyncio.wait_for(queue.get(), _POLL_S)
            except asyncio.TimeoutError:
                transport = request.transport
                if transport is None or transport.is_closing():
                    raise ClientGone() from None

    async def _collect(self, request: web.Request, queue: "asyncio.Queue[RequestOutput]", req: Request,
                       params: GenerateParams, chat: bool, headers: dict[str, str]) -> tuple[web.Response, bool]:
        rid = req.request_id
        token_ids: list[int] = []
        while True:
            out = await self._next(request, queue)
            if out.error:
                return _error(out.error, out.error_status, headers=_with_side(headers, out)), True
            token_ids += out.new_token_ids
            if out.finished:
                body = completion_body(
                    rid=rid, model=self.model_id, chat=chat, text=self.tokenizer.decode(token_ids),
                    finish_reason=out.finish_reason, prompt_tokens=len(params.prompt_ids),
                    completion_tokens=out.num_output_tokens, created=now_s(),
                    kv_transfer_params=with_first_token_text(out.kv_transfer_params), stop_reason=out.stop_reason,
                    cached_tokens=out.num_cached_tokens)
                return _json(body, headers=_timed(headers, req)), True

    async def _stream(self, request: web.Request, queue: "asyncio.Queue[RequestOutput]", req: Request,
                      params: GenerateParams, chat: bool,
                      headers: dict[str, str]) -> tuple[web.StreamResponse, bool]:
        rid = req.request_id
        created = now_s()
        out = await self._next(request, queue)
        if out.error:  # failed before the first token: a plain HTTP error
            return _error(out.error, out.error_status, headers=_with_side(headers, out)), True
        resp = web.StreamResponse(headers={**_timed(headers, req), "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
        except ConnectionError as exc:  # gone between the last check and the first token
            raise ClientGone() from exc

        async def send(obj: Any) -> None:
            try:
                await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            except (ConnectionResetError, ConnectionError) as exc:
                raise ClientGone() from exc

        try:
            await self._stream_body(resp, queue, request, out, rid, params, chat, created, send)
        except ClientGone:
            log.info("request %s: client disconnected mid-stream", rid)
            return resp, False
        return resp, True

    async def _stream_body(self, resp: web.StreamResponse, queue: "asyncio.Queue[RequestOutput]",
                           request: web.Request, out: RequestOutput, rid: str, params: GenerateParams,
                           chat: bool, created: int, send: Any) -> None:
        detok = IncrementalDetokenizer()
        # the proxy streamed the first token (and the chat role chunk) already: leave them out
        skip = 1 if first_token_sent(params.kv_transfer_params) else 0
        if chat and not skip:
            await send(chunk_body(rid=rid, model=self.model_id, chat=True, created=created, text="", finish_reason=None,
                                  role=True))
        while True:
            if out.error:
                await send(error_body(out.error_status, out.error))
                break
            ids = out.new_token_ids
            if skip:
                for t in ids[:skip]:
                    detok.push(t)  # its text is already out
                ids, skip = ids[skip:], max(0, skip - len(ids))
            text = "".join(detok.push(t) for t in ids)
            if out.finished:
                text += detok.flush()
            if text:
                await send(chunk_body(rid=rid, model=self.model_id, chat=chat, created=created, text=text,
                                      finish_reason=None))
            if out.finished:
                final = chunk_body(rid=rid, model=self.model_id, chat=chat, created=created,
                                   text=None if chat else "", finish_reason=out.finish_reason,
                                   stop_reason=out.stop_reason)
                if out.kv_transfer_params is not None:
                    final["kv_transfer_params"] = out.kv_transfer_params
                await send(final)
                if params.include_usage:
                    await send({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                "created": created, "model": self.model_id, "choices": [],
                                "usage": usage(len(params.prompt_ids), out.num_output_tokens,
                                               out.num_cached_tokens)})
                break
            out = await self._next(request, queue)
        try:
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass
