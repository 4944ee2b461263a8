"""Fake HTTP engines for exercising the proxy (tests and ``python -m atom_kv.bench proxy``).

A :class:`FakeEngine` is a real aiohttp server on 127.0.0.1 that answers like
an engine in P/D mode: a prefill request (``do_remote_decode``) gets a
one-token completion whose top-level ``kv_transfer_params`` names fake KV
blocks (and adopts the proxy's ``transfer_id``, as atom-kv's producer does);
a decode request streams or returns generated text. It serves ``/health``
(role, engine id, TP size), ``/v1/models`` (with ``max_model_len``) and
vLLM's ``/tokenize``. It records what it receives, and can be told to be
slow, fail (4xx/5xx), hang, drop a stream, or send several SSE events per
write. With ``prefix_cache_blocks`` it keeps an LRU of prompt blocks and
counts how many prompt characters would have been prefix-cache hits.
It moves no KV cache: it stands in for an engine, not for one.

``python -m atom_kv.testing.fake_engine`` runs fake prefill and decode
engines in one process (registering them with a proxy's discovery port when
``--discovery`` is given) and prints ``ready prefill=URL[,URL] decode=URL[,URL]``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import logging
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Union

import msgspec
import zmq
from aiohttp import web
from multidict import CIMultiDict

from atom_kv._cli import OneLineParser
from atom_kv.auth import PURPOSE_REGISTER, sign_fields
from atom_kv.openai_errors import error_bytes
from atom_kv.wire import HelloPing, RegisterPing, encode

logger = logging.getLogger(__name__)

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()

CACHE_BLOCK_CHARS = 16  # prefix-cache simulation: characters per "KV block"


@dataclass
class Received:
    """One request as the fake engine saw it."""

    path: str
    headers: Mapping[str, str]  # case-insensitive
    body: dict[str, Any]
    request_id: str
    peer: tuple[str, int] | None = None  # the client's (host, port): same port = connection reused
    at: float = field(default_factory=time.monotonic)

    @property
    def kv(self) -> dict[str, Any]:
        kv = self.body.get("kv_transfer_params")
        return kv if isinstance(kv, dict) else {}


def _vllm_error(status: int, message: str) -> web.Response:
    return web.Response(body=error_bytes(status, message), status=status, content_type="application/json")


def _prompt_text(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt)
    return "\n".join(str(m.get("content", "")) for m in body.get("messages", []) if isinstance(m, dict))


class PrefixCacheModel:
    """An LRU of prompt blocks (chained block hashes, like a paged prefix cache)."""

    def __init__(self, capacity_blocks: int, block_chars: int = CACHE_BLOCK_CHARS) -> None:
        self.capacity = capacity_blocks
        self.block_chars = block_chars
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.hit_chars = 0
        self.prompt_chars = 0
        self.requests = 0

    def access(self, text: str) -> int:
        """Account one prompt; returns the characters that were already cached."""
        self.requests += 1
        self.prompt_chars += len(text)
        key = 0
        hit = 0
        missed = False
        bc = self.block_chars
        for start in range(0, len(text) - len(text) % bc, bc):
            key = hash((key, text[start:start + bc]))
            if not missed and key in self._blocks:
                hit += bc
                self._blocks.move_to_end(key)
            else:
                missed = True
                self._blocks[key] = None
                if len(self._blocks) > self.capacity:
                    self._blocks.popitem(last=False)
        self.hit_chars += hit
        return hit

    def reset(self) -> None:
        self._blocks.clear()
        self.hit_chars = self.prompt_chars = self.requests = 0


class FakeEngine:
    """A fake OpenAI server for one role ("P" or "D"); see the module doc."""

    def __init__(
        self,
        role: str,
        *,
        engine_id: str | None = None,
        tp_size: int = 1,
        dp_size: int = 1,
        handshake_port: int = 40000,
        model: str = "fake-model",
        delay_s: float = 0.0,
        token_delay_s: float = 0.0,
        default_tokens: int = 16,
        prompt_tokens_override: int | None = None,
        max_model_len: int = 32768,
        prefix_cache_blocks: int = 0,
        kv_features: tuple[str, ...] = (),
    ) -> None:
        if role not in ("P", "D"):
            raise ValueError(f"role: must be 'P' or 'D', got {role!r}")
        self.role: Literal["P", "D"] = "P" if role == "P" else "D"
        self.engine_id = engine_id or f"fake-{role}-{id(self):x}"
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.handshake_port = handshake_port
        self.model = model
        self.delay_s = delay_s
        self.token_delay_s = token_delay_s
        self.default_tokens = default_tokens
        self.prompt_tokens_override = prompt_tokens_override
        self.max_model_len = max_model_len
        self.prefix_cache = PrefixCacheModel(prefix_cache_blocks) if prefix_cache_blocks else None
        self.kv_features = list(kv_features)  # what its /health announces (the proxy picks a mode per pair)
        # failure and behaviour knobs
        self.fail_status: int | None = None
        self.fail_count: int | None = None  # None: every request fails while fail_status is set
        self.fail_prompt: str | None = None  # a prompt containing this always gets a 500 (a "poison" request)
        self.hang = False
        self.gate: asyncio.Event | None = None  # set: each completion waits for it before it answers
        self.drop_after_chunks: int | None = None
        self.empty_response = False  # answer 200 with no body (non-stream) or no events (stream)
        self.health_status = 200
        self.tokenize_enabled = True
        self.adopt_transfer_id = True  # a prefill keeps the proxy's transfer_id (atom-kv's producer does)
        self.events_per_write = 1  # >1: several SSE events in one write, then token_delay_s
        # a prefill's answer: these in its kv_transfer_params (a broken or hostile engine), and padding
        self.first_token_ids: Any = None  # None: no first_token_ids key
        self.first_token_text: Any = None  # None: no first_token_text key
        self.answer_padding = 0  # bytes of filler in the prefill's answer
        # records
        self.record = True
        self.received: list[Received] = []
        self.cancelled: list[str] = []
        self.completed: list[str] = []
        self.health_checks = 0
        self.active = 0  # completion requests in its handler now, and the most there ever were at once
        self.max_active = 0
        self.tokenize_calls = 0
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._changed: asyncio.Event | None = None
        self._transfer_ids = itertools.count()

    # ------------------------------------------------------------- lifecycle
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def request_address(self) -> str:
        return f"{self.base_url}/v1/completions"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> "FakeEngine":
        self._changed = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/fake/stats", self._stats)
        app.router.add_post("/fake/reset", self._reset)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=4096, shutdown_timeout=0.5)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the one site's (host, port)
        return self

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # ------------------------------------------------------------- pings
    def register_fields(self, *, transfer_mode: str = "read", index: str = "0") -> dict[str, Any]:
        return msgspec.to_builtins(RegisterPing(
            role=self.role, index=index, request_address=self.request_address,
            handshake_port=self.handshake_port, dp_size=self.dp_size, tp_size=self.tp_size,
            transfer_mode=transfer_mode, engine_id=self.engine_id, model=self.model,
        ))

    def register_ping(self, *, token: str | None = None, transfer_mode: str = "read", index: str = "0") -> bytes:
        """ATOM's registration ping for this engine; signed (fresh ts and nonce) when ``token`` is given."""
        fields = self.register_fields(transfer_mode=transfer_mode, index=index)
        if token is not None:
            fields = sign_fields(token, PURPOSE_REGISTER, fields)
        return msgspec.msgpack.encode(fields)

    def moriio_ping(self, *, transfer_mode: str = "READ", notify_port: int = 41000) -> bytes:
        """vLLM MoRIIO's registration ping for this engine (it spells the mode "READ"/"WRITE")."""
        return msgspec.msgpack.encode({
            "type": self.role, "http_address": f"127.0.0.1:{self.port}",
            "zmq_address": f"host:127.0.0.1,handshake:{self.handshake_port},notify:{notify_port}",
            "dp_size": self.dp_size, "tp_size": self.tp_size, "transfer_mode": transfer_mode,
        })

    # ------------------------------------------------------------- waiting
    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def wait_until(self, predicate: Any, timeout: float = 3.0) -> bool:
        """Wait (on this engine's change event, not a spin) until ``predicate()`` holds."""
        return await wait_engines([self], predicate, timeout)

    # ------------------------------------------------------------- handlers
    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        body: dict[str, Any] = {"status": "ok" if self.health_status == 200 else "error",
                                "role": "prefill" if self.role == "P" else "decode", "engine_id": self.engine_id,
                                "tp_size": self.tp_size}
        if self.kv_features:
            body["kv_features"] = self.kv_features
        return web.Response(body=_enc.encode(body), status=self.health_status, content_type="application/json")

    async def _models(self, request: web.Request) -> web.Response:
        body = {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "atom-kv",
                                            "max_model_len": self.max_model_len}]}
        return web.Response(body=_enc.encode(body), content_type="application/json")

    async def _tokenize(self, request: web.Request) -> web.Response:
        if not self.tokenize_enabled:
            return _vllm_error(404, "Not Found")
        self.tokenize_calls += 1
        try:
            body = _dec.decode(await request.read())
        except (msgspec.DecodeError, UnicodeDecodeError):
            return _vllm_error(400, "invalid JSON")
        n = self._prompt_tokens(body)
        answer = {"count": n, "max_model_len": self.max_model_len, "tokens": self._prompt_token_ids(body, n)}
        return web.Response(body=_enc.encode(answer), content_type="application/json")

    async def _stats(self, request: web.Request) -> web.Response:
        cache = self.prefix_cache
        stats = {"requests": len(self.received) if self.record else None,
                 "cache_requests": cache.requests if cache else 0,
                 "hit_chars": cache.hit_chars if cache else 0, "prompt_chars": cache.prompt_chars if cache else 0}
        return web.Response(body=_enc.encode(stats), content_type="application/json")

    async def _reset(self, request: web.Request) -> web.Response:
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
        self.received.clear()
        return web.Response(body=b"{}", content_type="application/json")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    def _should_fail(self) -> bool:
        if self.fail_status is None:
            return False
        if self.fail_count is None:
            return True
        if self.fail_count > 0:
            self.fail_count -= 1
            return True
        return False

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        request_id = request.headers.get("X-Request-Id", "")
        try:
            body = _dec.decode(await request.read())
        except (msgspec.DecodeError, UnicodeDecodeError):
            return _vllm_error(400, "invalid JSON")
        if self.record:
            peer = request.transport.get_extra_info("peername") if request.transport is not None else None
            self.received.append(Received(request.path, CIMultiDict(request.headers), body, request_id,
                                          tuple(peer[:2]) if peer else None))
        self._notify()
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self._should_fail():
                assert self.fail_status is not None
                return _vllm_error(self.fail_status, f"fake engine failure {self.fail_status}")
            if self.fail_prompt is not None and self.fail_prompt in _prompt_text(body):
                return _vllm_error(500, "fake engine failure: this prompt always fails")
            if self.hang:
                await asyncio.sleep(3600)
            if self.gate is not None:
                await self.gate.wait()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            kv = body.get("kv_transfer_params") or {}
            if self.prefix_cache is not None and (self.role == "P" or not kv.get("do_remote_prefill")):
                self.prefix_cache.access(_prompt_text(body))
            if self.empty_response:
                ctype = "text/event-stream" if body.get("stream") else "application/json"
                resp: web.StreamResponse = web.Response(body=b"", headers={"Content-Type": ctype})
            elif kv.get("do_remote_decode"):
                resp = self._prefill_response(request, body, chat)
            elif body.get("stream"):
                resp = await self._stream(request, body, chat)
            else:
                n = self._n_tokens(body)
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s * n)  # as long as streaming it would take
                resp = web.Response(body=_enc.encode(self._full_response(body, chat, n)),
                                    content_type="application/json")
            if self.record:
                self.completed.append(request_id)
            self._notify()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            if self.record:
                self.cancelled.append(request_id)
            self._notify()
            raise
        finally:
            self.active -= 1

    def _n_tokens(self, body: dict[str, Any]) -> int:
        n = body.get("max_tokens") or body.get("max_completion_tokens") or self.default_tokens
        return max(1, int(n))

    def _prompt_tokens(self, body: dict[str, Any]) -> int:
        if self.prompt_tokens_override is not None:
            return self.prompt_tokens_override
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            return len(prompt)
        if isinstance(prompt, str):
            return max(1, len(prompt) // 4)
        text = "".join(str(m.get("content", "")) for m in body.get("messages", []) if isinstance(m, dict))
        return max(1, len(text) // 4)

    @staticmethod
    def _prompt_token_ids(body: dict[str, Any], n: int) -> list[int]:
        """``n`` made-up token ids that follow the prompt's content (one per 4 bytes of text), so two prompts
        share leading ids exactly when they share leading text (a token-id prompt is its own ids)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)[:n]
        if isinstance(prompt, str):
            text = prompt
        else:
            text = "".join(str(m.get("content", "")) for m in body.get("messages", []) if isinstance(m, dict))
        data = text.encode("utf-8", "surrogatepass")
        ids = [int.from_bytes(data[4 * i:4 * i + 4], "little") for i in range(len(data) // 4)]
        return (ids + [0] * n)[:n]

    def _usage(self, body: dict[str, Any], n: int) -> dict[str, int]:
        p = self._prompt_tokens(body)
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    def _full_response(self, body: dict[str, Any], chat: bool, n: int) -> dict[str, Any]:
        text = "".join(f" t{i}" for i in range(n))
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
            obj = "text_completion"
        return {
            "id": f"cmpl-{self.role}-{len(self.received)}", "object": obj, "created": int(time.time()),
            "model": body.get("model") or self.model, "choices": [choice], "usage": self._usage(body, n),
        }

    def _prefill_response(self, request: web.Request, body: dict[str, Any], chat: bool) -> web.Response:
        answer = self._full_response(body, chat, 1)
        dp_rank = int(request.headers.get("X-data-parallel-rank", "0"))
        incoming = (body.get("kv_transfer_params") or {}).get("transfer_id")
        if self.adopt_transfer_id and isinstance(incoming, str) and incoming:
            transfer_id = incoming
        else:
            transfer_id = f"{self.engine_id}-{next(self._transfer_ids)}"
        answer["kv_transfer_params"] = {
            "remote_block_ids": [0, 1, 2],
            "remote_engine_id": self.engine_id,
            "remote_host": "127.0.0.1",
            "remote_port": self.port,
            "remote_handshake_port": self.handshake_port,
            "tp_size": self.tp_size,
            "dp_rank": dp_rank,
            "transfer_id": transfer_id,
        }
        if self.first_token_ids is not None:
            answer["kv_transfer_params"]["first_token_ids"] = self.first_token_ids
        if self.first_token_text is not None:
            answer["kv_transfer_params"]["first_token_text"] = self.first_token_text
        if self.answer_padding:
            answer["padding"] = "x" * self.answer_padding
        return web.Response(body=_enc.encode(answer), content_type="application/json")

    def _chunk(self, body: dict[str, Any], chat: bool, i: int, n: int) -> bytes:
        last = i == n - 1
        if chat:
            delta: dict[str, Any] = {"content": f" t{i}"}
            if i == 0:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": "length" if last else None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": "length" if last else None}
            obj = "text_completion"
        chunk = {"id": "cmpl-stream", "object": obj, "created": 0, "model": body.get("model") or self.model,
                 "choices": [choice]}
        return b"data: " + _enc.encode(chunk) + b"\n\n"

    async def _stream(self, request: web.Request, body: dict[str, Any], chat: bool) -> web.StreamResponse:
        n = self._n_tokens(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        per_write = max(1, self.events_per_write)
        for start in range(0, n, per_write):
            if self.drop_after_chunks is not None and start >= self.drop_after_chunks:
                assert request.transport is not None
                request.transport.abort()  # the client sees the stream end mid-way
                return resp
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            await resp.write(b"".join(self._chunk(body, chat, i, n) for i in range(start, min(n, start + per_write))))
        tail = b""
        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            usage: dict[str, Any] = {
                "id": "cmpl-stream", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 0, "model": body.get("model") or self.model, "choices": [], "usage": self._usage(body, n)}
            tail = b"data: " + _enc.encode(usage) + b"\n\n"
        await resp.write(tail + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def wait_engines(engines: list[FakeEngine], predicate: Callable[[], bool], timeout: float = 3.0) -> bool:
    """Wait until ``predicate()`` holds, re-checking whenever any of ``engines`` records something."""
    events = [e._changed for e in engines if e._changed is not None]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        for event in events:
            event.clear()
        if predicate():
            return True
        waits = [asyncio.ensure_future(event.wait()) for event in events]
        try:
            await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
    return True


PingSource = Union[bytes, Callable[[], bytes]]


class FakePinger:
    """Sends registration pings for fake engines from a named thread every ``interval_s``.

    A ping given as a callable is rebuilt for every send (signed pings need a fresh nonce)."""

    def __init__(self, endpoint: str, pings: list[PingSource], interval_s: float = 1.0) -> None:
        self.endpoint = endpoint
        self.pings = pings
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-engine-pinger", daemon=True)

    def start(self) -> "FakePinger":
        self._thread.start()
        return self

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            sock.send(encode(HelloPing()))
            while True:
                for ping in self.pings:
                    sock.send(ping() if callable(ping) else ping)
                if self._stop.wait(self.interval_s):
                    break
        finally:
            sock.close(0)
            ctx.term()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 1.0)


def send_pings(endpoint: str, pings: list[bytes]) -> None:
    """Send each ping once from a fresh DEALER socket (blocking briefly until delivered)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(endpoint)
    for ping in pings:
        sock.send(ping)
    sock.close()
    ctx.term()


async def _serve(args: argparse.Namespace) -> None:
    engines = [FakeEngine("P", delay_s=args.prefill_delay, dp_size=args.dp_size, max_model_len=args.max_model_len,
                          prefix_cache_blocks=args.prefix_cache_blocks)
               for _ in range(args.prefills)]
    engines += [FakeEngine("D", token_delay_s=args.token_delay, default_tokens=args.tokens, dp_size=args.dp_size,
                           max_model_len=args.max_model_len)
                for _ in range(args.decodes)]
    for engine in engines:
        engine.record = False
        engine.hang = engine.role == "D" and args.hang_decode
        engine.fail_prompt = args.fail_prompt
        engine.fail_status = args.fail_status
        await engine.start(port=args.prefill_port if engine.role == "P" and args.prefills == 1 else
                           args.decode_port if engine.role == "D" and args.decodes == 1 else 0)
    pinger = None
    if args.discovery:
        token = args.auth_token
        pings: list[PingSource] = [functools.partial(e.register_ping, token=token) if token else e.register_ping()
                                   for e in engines]
        pinger = FakePinger(args.discovery, pings, args.ping_interval).start()
    prefills = ",".join(e.base_url for e in engines if e.role == "P")
    decodes = ",".join(e.base_url for e in engines if e.role == "D")
    print(f"ready prefill={prefills} decode={decodes}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if pinger is not None:
        pinger.close()
    for engine in engines:
        await engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description="Run fake prefill and decode engines (for proxy tests and benches).")
    parser.add_argument("--discovery", default=None,
                        help="proxy discovery endpoint to ping, e.g. tcp://127.0.0.1:36367 (default: no pings)")
    parser.add_argument("--auth-token", default=None,
                        help="sign the pings with this token (the proxy's --registration-token)")
    parser.add_argument("--prefills", type=int, default=1)
    parser.add_argument("--decodes", type=int, default=1)
    parser.add_argument("--prefill-port", type=int, default=0)
    parser.add_argument("--decode-port", type=int, default=0)
    parser.add_argument("--prefill-delay", type=float, default=0.005)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--prefix-cache-blocks", type=int, default=0,
                        help="prefill engines model a prefix cache of this many 16-character blocks")
    parser.add_argument("--hang-decode", action="store_true", help="decode engines never answer")
    parser.add_argument("--ping-interval", type=float, default=1.0)
    parser.add_argument("--fail-prompt", default=None,
                        help="every engine answers 500 to a prompt containing this (a request's own failure)")
    parser.add_argument("--fail-status", type=int, default=None,
                        help="every engine answers every completion with this status (a broken engine)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
