"""Fake HTTP engines for exercising the proxy (tests and ``python -m atom_kv.bench proxy``).

A :class:`FakeEngine` is a real aiohttp server on 127.0.0.1 that answers like
an ATOM engine in P/D mode: a prefill request (``do_remote_decode``) gets a
one-token completion whose top-level ``kv_transfer_params`` names fake KV
blocks; a decode request streams or returns generated text. It records what it
receives, and can be told to be slow, fail (4xx/5xx), hang, or drop a stream.
It moves no KV cache: it stands in for an engine, not for one.

``python -m atom_kv.proxy.testing --discovery tcp://127.0.0.1:36367 ...`` runs
a prefill and a decode fake in one process and registers them with a proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import msgspec
import zmq
from aiohttp import web
from multidict import CIMultiDict

from atom_kv.wire import HelloPing, RegisterPing, encode

logger = logging.getLogger(__name__)

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()


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
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.Response(body=_enc.encode(body), status=status, content_type="application/json")


class FakeEngine:
    """A fake ATOM-style OpenAI server for one role ("P" or "D"); see the module doc."""

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
    ) -> None:
        if role not in ("P", "D"):
            raise ValueError(f"role: must be 'P' or 'D', got {role!r}")
        self.role = role
        self.engine_id = engine_id or f"fake-{role}-{id(self):x}"
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.handshake_port = handshake_port
        self.model = model
        self.delay_s = delay_s
        self.token_delay_s = token_delay_s
        self.default_tokens = default_tokens
        self.prompt_tokens_override = prompt_tokens_override
        # failure knobs
        self.fail_status: int | None = None
        self.fail_count: int | None = None  # None: every request fails while fail_status is set
        self.hang = False
        self.drop_after_chunks: int | None = None
        self.empty_response = False  # answer 200 with no body (non-stream) or no events (stream)
        # records
        self.record = True
        self.received: list[Received] = []
        self.cancelled: list[str] = []
        self.completed: list[str] = []
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
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=4096, shutdown_timeout=0.5)
        await site.start()
        server = site._server
        assert server is not None and server.sockets
        self.port = server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # ------------------------------------------------------------- pings
    def register_ping(self, *, token: str | None = None, transfer_mode: str = "read", index: str = "0") -> bytes:
        """ATOM's registration ping for this engine."""
        return encode(RegisterPing(
            role=self.role, index=index, request_address=self.request_address, handshake_port=self.handshake_port,
            dp_size=self.dp_size, tp_size=self.tp_size, transfer_mode=transfer_mode, engine_id=self.engine_id,
            auth_token=token, model=self.model,
        ))

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
        """Wait (on an event, not a spin) until ``predicate()`` holds."""
        assert self._changed is not None
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 0.2))
            except asyncio.TimeoutError:
                pass
        return True

    # ------------------------------------------------------------- handlers
    async def _models(self, request: web.Request) -> web.Response:
        body = {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "atom-kv"}]}
        return web.Response(body=_enc.encode(body), content_type="application/json")

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
        except msgspec.DecodeError:
            return _vllm_error(400, "invalid JSON")
        if self.record:
            peer = request.transport.get_extra_info("peername") if request.transport is not None else None
            self.received.append(Received(request.path, CIMultiDict(request.headers), body, request_id,
                                          tuple(peer[:2]) if peer else None))
        self._notify()
        try:
            if self._should_fail():
                assert self.fail_status is not None
                return _vllm_error(self.fail_status, f"fake engine failure {self.fail_status}")
            if self.hang:
                await asyncio.sleep(3600)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            kv = body.get("kv_transfer_params") or {}
            if self.empty_response:
                ctype = "text/event-stream" if body.get("stream") else "application/json"
                resp = web.Response(body=b"", headers={"Content-Type": ctype})
            elif kv.get("do_remote_decode"):
                resp = self._prefill_response(request, body, chat)
            elif body.get("stream"):
                resp = await self._stream(request, body, chat)
            else:
                resp = web.Response(body=_enc.encode(self._full_response(body, chat, self._n_tokens(body))),
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
        answer["kv_transfer_params"] = {
            "remote_block_ids": [0, 1, 2],
            "remote_engine_id": self.engine_id,
            "remote_host": "127.0.0.1",
            "remote_port": self.port,
            "remote_handshake_port": self.handshake_port,
            "tp_size": self.tp_size,
            "dp_rank": dp_rank,
            "transfer_id": f"{self.engine_id}-{next(self._transfer_ids)}",
        }
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
        for i in range(n):
            if self.drop_after_chunks is not None and i >= self.drop_after_chunks:
                assert request.transport is not None
                request.transport.abort()  # the client sees the stream end mid-way
                return resp
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            await resp.write(self._chunk(body, chat, i, n))
        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            usage = {"id": "cmpl-stream", "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": 0, "model": body.get("model") or self.model, "choices": [],
                     "usage": self._usage(body, n)}
            await resp.write(b"data: " + _enc.encode(usage) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class FakePinger:
    """Sends registration pings for fake engines from a named thread every ``interval_s``."""

    def __init__(self, endpoint: str, pings: list[bytes], interval_s: float = 1.0) -> None:
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
                    sock.send(ping)
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
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    for ping in pings:
        sock.send(ping)
    sock.close()
    ctx.term()


async def _serve(args: argparse.Namespace) -> None:
    engines = [
        FakeEngine("P", delay_s=args.prefill_delay, dp_size=args.dp_size),
        FakeEngine("D", token_delay_s=args.token_delay, default_tokens=args.tokens, dp_size=args.dp_size),
    ]
    for engine in engines:
        engine.record = False
    await engines[0].start(port=args.prefill_port)
    await engines[1].start(port=args.decode_port)
    pinger = FakePinger(args.discovery, [e.register_ping() for e in engines], args.ping_interval).start()
    print(f"ready prefill={engines[0].base_url} decode={engines[1].base_url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    pinger.close()
    for engine in engines:
        await engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a fake prefill and a fake decode engine (for proxy benchmarks).")
    parser.add_argument("--discovery", required=True, help="proxy discovery endpoint, e.g. tcp://127.0.0.1:36367")
    parser.add_argument("--prefill-port", type=int, default=0)
    parser.add_argument("--decode-port", type=int, default=0)
    parser.add_argument("--prefill-delay", type=float, default=0.005)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--ping-interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
