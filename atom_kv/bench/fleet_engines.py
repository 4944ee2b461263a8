"""A fleet of fake engines in one process, each on its own loopback address, for ``bench fleet``.

``python -m atom_kv.bench.fleet_engines --prefills P --decodes D --discovery tcp://127.0.0.1:PORT
--token-file PATH`` serves P + D fake engines, engine k on ``127.0.x.y`` (x, y from k; 127.0.0.0/8 is
all loopback on Linux, nothing to set up), from one asyncio loop with one listener per engine, and
prints ``ready prefill=URL,... decode=URL,...`` once they all listen. Each engine:

- answers ``GET /health`` (role, engine id, its load as the reference engine reports it), ``GET
  /v1/models`` and ``POST /v1/completions``: a prefill request (``do_remote_decode``) gets a one-token
  answer with ``kv_transfer_params``; a decode request streams ``max_tokens`` SSE events;
- registers with the proxy the way atom-kv's engines do: a signed :class:`~atom_kv.wire.RegisterPing`
  (``answers`` set, the answers read and dropped) every ``--ping-interval`` seconds, from a DEALER socket
  of its own whose source address is the engine's, the engines' pings spread evenly over the interval;
- with ``--kv-events``, publishes vLLM-wire KV events on a PUB socket of its own (announced in its ping):
  ``--kv-rate`` batches a second, each storing ``--kv-blocks`` new 16-token blocks and removing as many
  old ones past ``--kv-held`` blocks (a steady state).

How it differs from a real engine: no model, no KV cache, no handshake or block reads (the decode
never contacts the prefill), no queueing (every request is answered at once, a decode's events in one
write), and one process for the whole fleet: the load generator's and the proxy's costs are what is
measured, not an engine's.

Commands on stdin, one a line: ``add P`` / ``add D`` starts one more engine and pings at once (its
first ping's time is the clock's ``time.monotonic()``, shared by every process on the host); when that
engine gets its first completion request it prints ``first-request ROLE URL PING_T REQUEST_T``. The
pings and events run on one named thread (``fleet-pinger``) that waits on its stop event between sends.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, cast

import httptools
import msgspec
import zmq

from atom_kv._cli import OneLineParser
from atom_kv.auth import PURPOSE_REGISTER, sign_fields
from atom_kv.proxy.fleet.static import Role, as_role
from atom_kv.proxy.kv_events.wire import BlockRemoved, BlockStored, EventBatch, encode_seq
from atom_kv.wire import RegisterPing

logger = logging.getLogger(__name__)

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()
_pack = msgspec.msgpack.Encoder()
BLOCK = 16  # tokens a KV block
MAX_BODY = 1 << 20  # a request body past this is refused (the load generator sends a few hundred bytes)


def address(k: int) -> str:
    """Engine ``k``'s loopback address: 127.0.1.1, 127.0.1.2, ... (250 a /24, 127.0.0.x left alone)."""
    if k >= 250 * 254:
        raise ValueError(f"engine {k}: at most {250 * 254} engines have an address of their own")
    return f"127.0.{1 + k // 250}.{1 + k % 250}"


@dataclass
class Engine:
    """One fake engine: its role, address, port, and what it has served."""

    role: Role
    host: str
    engine_id: str
    port: int = 0
    requests: int = 0
    active: int = 0
    first_ping: Optional[float] = None  # monotonic; set by the pinger thread
    watch_first: bool = False  # an engine added by command: report its first request
    events_port: int = 0
    _ids: Any = field(default_factory=lambda: itertools.count())

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def health(self) -> bytes:
        return _enc.encode({"status": "ok", "role": "prefill" if self.role == "P" else "decode",
                            "engine_id": self.engine_id, "tp_size": 1, "dp_size": 1,
                            "requests": {"running": self.active, "waiting": 0}})

    def ping_fields(self, kv_events: bool) -> dict[str, Any]:
        return msgspec.to_builtins(RegisterPing(
            role=self.role, index="0", request_address=f"{self.url}/v1/completions",
            handshake_port=40000, engine_id=self.engine_id, model="fake-model", answers=True,
            kv_events=f"tcp://{self.host}:{self.events_port}" if kv_events else None))


_EVENT = (b'data: {"id":"cmpl-s","object":"text_completion","created":0,"model":"fake-model",'
          b'"choices":[{"index":0,"text":" t%d","logprobs":null,"finish_reason":%s}]}\n\n')
_MODELS = _enc.encode({"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "atom-kv",
                                                   "max_model_len": 32768}]})


def _head(status: int, ctype: bytes, length: Optional[int]) -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 413: b"Payload Too Large"}.get(status, b"Error")
    size = b"Transfer-Encoding: chunked\r\n" if length is None else b"Content-Length: %d\r\n" % length
    return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\n%s\r\n" % (status, reason, ctype, size)


class _Conn(asyncio.Protocol):
    """One HTTP/1.1 connection to one engine (keep-alive, one request at a time, parsed by httptools)."""

    def __init__(self, fleet: "Fleet", engine: Engine) -> None:
        self.fleet = fleet
        self.engine = engine
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Optional[asyncio.Transport] = None
        self.url = b""
        self.body: list[bytes] = []
        self.size = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream connection's transport: asyncio types connection_made() for every kind of protocol
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._send(400, b"application/json", b'{"error": "bad request"}')
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size <= MAX_BODY:
            self.body.append(body)

    def on_message_complete(self) -> None:
        url, body, size = self.url, b"".join(self.body), self.size
        self.url, self.body, self.size = b"", [], 0
        method = self.parser.get_method()
        if size > MAX_BODY:
            self._send(413, b"application/json", b'{"error": "body too large"}')
        elif method == b"GET" and url == b"/health":
            self._send(200, b"application/json", self.engine.health())
        elif method == b"GET" and url == b"/v1/models":
            self._send(200, b"application/json", _MODELS)
        elif method == b"POST" and url == b"/v1/completions":
            self._complete(body)
        else:
            self._send(404, b"application/json", b'{"error": "not found"}')

    def _send(self, status: int, ctype: bytes, payload: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_head(status, ctype, len(payload)) + payload)

    def _complete(self, raw: bytes) -> None:
        engine = self.engine
        try:
            body = _dec.decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError):
            self._send(400, b"application/json", b'{"error": "invalid JSON"}')
            return
        engine.requests += 1
        if engine.requests == 1 and engine.watch_first:
            self.fleet.report_first(engine, time.monotonic())
        kv = body.get("kv_transfer_params") if isinstance(body, dict) else None
        kv = kv if isinstance(kv, dict) else {}
        if kv.get("do_remote_decode"):
            transfer_id = kv.get("transfer_id") or f"{engine.engine_id}-{next(engine._ids)}"
            answer = {"id": "cmpl-p", "object": "text_completion", "created": 0, "model": "fake-model",
                      "choices": [{"index": 0, "text": " t0", "logprobs": None, "finish_reason": "length"}],
                      "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
                      "kv_transfer_params": {"remote_block_ids": [0, 1, 2], "remote_engine_id": engine.engine_id,
                                             "remote_host": engine.host, "remote_port": engine.port,
                                             "remote_handshake_port": 40000, "tp_size": 1, "dp_rank": 0,
                                             "transfer_id": transfer_id}}
            self._send(200, b"application/json", _enc.encode(answer))
            return
        n = max(1, int(body.get("max_tokens") or 16)) if isinstance(body, dict) else 16
        if not (isinstance(body, dict) and body.get("stream")):
            answer = {"id": "cmpl-d", "object": "text_completion", "created": 0, "model": "fake-model",
                      "choices": [{"index": 0, "text": "".join(f" t{i}" for i in range(n)), "logprobs": None,
                                   "finish_reason": "length"}]}
            self._send(200, b"application/json", _enc.encode(answer))
            return
        events = b"".join(self.fleet.event(i, n) for i in range(n)) + b"data: [DONE]\n\n"
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_head(200, b"text/event-stream", None) + b"%x\r\n%s\r\n0\r\n\r\n" % (len(events), events))


class Pinger:
    """Owns the pinger thread: every engine's DEALER (and, with KV events, PUB) socket, its schedule of pings
    and event batches, and the ZeroMQ context. Engines are handed over through :meth:`add` (a queue the
    thread drains), so only the thread touches the sockets."""

    def __init__(self, endpoint: str, token: str, interval_s: float, kv: Optional["KvSpec"]) -> None:
        self.endpoint = endpoint
        self.token = token
        self.interval_s = interval_s
        self.kv = kv
        self._ctx = zmq.Context()
        self._ctx.set(zmq.MAX_SOCKETS, 65536)  # two per engine (DEALER, PUB): libzmq's default 1,023 is 500 engines
        self._new: list[tuple[Engine, bool, Optional[zmq.Socket]]] = []  # (engine, ping now, its PUB)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-pinger", daemon=True)

    def bind_events(self, engine: Engine) -> zmq.Socket:
        """A PUB socket on the engine's address (called before the engine is added; the thread owns it after)."""
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 10_000)
        engine.events_port = pub.bind_to_random_port(f"tcp://{engine.host}")
        return pub

    def add(self, engine: Engine, pub: Optional[zmq.Socket], now: bool) -> None:
        with self._lock:
            self._new.append((engine, now, pub))
        self._wake.set()

    def start(self) -> "Pinger":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10.0)
        self._ctx.term()

    def _run(self) -> None:
        socks: list[zmq.Socket] = []
        try:
            self._loop(socks)
        finally:
            for sock in socks:
                sock.close(0)

    def _loop(self, socks: list[zmq.Socket]) -> None:
        due: list[tuple[float, int, int]] = []  # (when, kind 0 ping / 1 events, slot)
        slots: list[tuple[Engine, zmq.Socket, Optional[zmq.Socket], "_Chains"]] = []
        order = itertools.count()
        while not self._stop.is_set():
            with self._lock:
                new, self._new = self._new, []
            start = time.monotonic()
            for engine, now, pub in new:
                dealer = self._ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(f"tcp://{engine.host}:0;{self.endpoint.removeprefix('tcp://')}")
                socks.append(dealer)
                if pub is not None:
                    socks.append(pub)
                slot = len(slots)
                slots.append((engine, dealer, pub, _Chains(slot)))
                # spread: the k-th engine of a batch pings k/len of an interval later (now: at once)
                offset = 0.0 if now else self.interval_s * (next(order) % 997) / 997
                heapq.heappush(due, (start + offset, 0, slot))
                if pub is not None and self.kv is not None:
                    heapq.heappush(due, (start + offset + 1.0 / self.kv.rate, 1, slot))
            wait = (due[0][0] - time.monotonic()) if due else 1.0
            if wait > 0:
                self._wake.wait(min(wait, 1.0))
                self._wake.clear()
                continue
            when, kind, slot = heapq.heappop(due)
            engine, dealer, pub, chains = slots[slot]
            if kind == 0:
                self._ping(engine, dealer)
                heapq.heappush(due, (when + self.interval_s, 0, slot))
            else:
                assert pub is not None and self.kv is not None
                pub.send_multipart(chains.batch(self.kv), zmq.NOBLOCK)
                heapq.heappush(due, (when + 1.0 / self.kv.rate, 1, slot))

    def _ping(self, engine: Engine, dealer: zmq.Socket) -> None:
        while True:  # answers to earlier pings: read and dropped (an engine logs a refusal; ours are registered)
            try:
                dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        ping = _pack.encode(sign_fields(self.token, PURPOSE_REGISTER, engine.ping_fields(self.kv is not None)))
        if engine.first_ping is None:
            engine.first_ping = time.monotonic()
        try:
            dealer.send(ping, zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected yet: the next interval's ping goes


@dataclass(frozen=True)
class KvSpec:
    """What each engine publishes: ``rate`` batches a second of ``blocks`` new blocks, ``held`` kept."""

    rate: float
    blocks: int
    held: int


class _Chains:
    """One engine's event stream: each batch a new chain (a request's prompt, no parent: nothing depends on
    an event the proxy missed before it subscribed), the oldest blocks removed past ``held``."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.seq = 0
        self.next_hash = (slot + 1) << 32
        self.stored: list[int | bytes] = []

    def batch(self, kv: KvSpec) -> list[bytes]:
        hashes: list[int | bytes] = list(range(self.next_hash, self.next_hash + kv.blocks))
        self.next_hash += kv.blocks
        base = self.slot * 100_003 + self.seq * 7919
        tokens = [(base + i) % 150_000 for i in range(kv.blocks * BLOCK)]
        events: list[Any] = [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens,
                                         block_size=BLOCK)]
        self.stored.extend(hashes)
        if len(self.stored) > kv.held:
            cut = len(self.stored) - kv.held
            events.append(BlockRemoved(block_hashes=self.stored[:cut]))
            del self.stored[:cut]
        frames = [b"", encode_seq(self.seq), _pack.encode(EventBatch(ts=time.time(), events=events,
                                                                      data_parallel_rank=0))]
        self.seq += 1
        return frames


class Fleet:
    """Owns the engines, their listeners and the :class:`Pinger`."""

    def __init__(self, pinger: Pinger) -> None:
        self.pinger = pinger
        self.engines: list[Engine] = []
        self.servers: list[asyncio.AbstractServer] = []

    @staticmethod
    def event(i: int, n: int) -> bytes:
        """The ``i``-th of ``n`` SSE events of a decode stream."""
        return _EVENT % (i, b'"length"' if i == n - 1 else b"null")

    async def add(self, role: Role, *, now: bool = False, watch: bool = False) -> Engine:
        k = len(self.engines)
        engine = Engine(role, address(k), f"fleet-{role}-{k}", watch_first=watch)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Conn(self, engine), engine.host, 0, backlog=1024)
        engine.port = server.sockets[0].getsockname()[1]
        self.engines.append(engine)
        self.servers.append(server)
        pub = self.pinger.bind_events(engine) if self.pinger.kv is not None else None
        self.pinger.add(engine, pub, now)
        return engine

    def report_first(self, engine: Engine, at: float) -> None:
        print(f"first-request {engine.role} {engine.url} {engine.first_ping!r} {at!r}", flush=True)

    async def close(self) -> None:
        for server in self.servers:
            server.close()
        for server in self.servers:
            await server.wait_closed()


async def _commands(fleet: Fleet, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while not stop.is_set():
        line = (await reader.readline()).decode().split()
        if not line:
            if reader.at_eof():
                stop.set()  # the bench is gone
            continue
        role = as_role(line[1]) if line[0] == "add" and len(line) == 2 else None
        if role is not None:
            engine = await fleet.add(role, now=True, watch=True)
            print(f"added {engine.role} {engine.url}", flush=True)
        else:
            print(f"error unknown command {' '.join(line)!r} (expected 'add P' or 'add D')", flush=True)


async def _serve(args: argparse.Namespace) -> None:
    with open(args.token_file) as f:
        token = f.read().strip()
    kv = KvSpec(args.kv_rate, args.kv_blocks, args.kv_held) if args.kv_events else None
    pinger = Pinger(args.discovery, token, args.ping_interval, kv).start()
    fleet = Fleet(pinger)
    try:
        sizes: tuple[tuple[Role, int], ...] = (("P", args.prefills), ("D", args.decodes))
        for role, count in sizes:
            for _ in range(count):
                await fleet.add(role)
        urls = {role: ",".join(e.url for e in fleet.engines if e.role == role) for role in ("P", "D")}
        print(f"ready prefill={urls['P']} decode={urls['D']}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        commands = asyncio.create_task(_commands(fleet, stop))
        await stop.wait()
        commands.cancel()
        await asyncio.gather(commands, return_exceptions=True)
    finally:
        await fleet.close()
        pinger.close()


def main(argv: Optional[list[str]] = None) -> int:
    parser = OneLineParser(description="Serve a fleet of fake engines on loopback addresses (for bench fleet).")
    parser.add_argument("--prefills", type=int, required=True)
    parser.add_argument("--decodes", type=int, required=True)
    parser.add_argument("--discovery", required=True, help="the proxy's discovery endpoint, tcp://127.0.0.1:PORT")
    parser.add_argument("--token-file", required=True, help="the registration token (the proxy's)")
    parser.add_argument("--ping-interval", type=float, default=3.0, help="seconds between an engine's pings")
    parser.add_argument("--kv-events", action="store_true", help="every engine publishes KV events")
    parser.add_argument("--kv-rate", type=float, default=1.0, help="event batches a second per engine")
    parser.add_argument("--kv-blocks", type=int, default=4, help="blocks stored per batch")
    parser.add_argument("--kv-held", type=int, default=256, help="blocks an engine holds (older ones removed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
