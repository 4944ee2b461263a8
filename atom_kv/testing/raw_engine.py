"""A raw-socket engine for tests: what a broken or hostile engine can send that a real HTTP server never would.

:class:`RawEngine` is an asyncio server on 127.0.0.1 (an OS-assigned port) with its own event loop on a
named thread, so a test can put it behind a proxy process and block on its own client calls. It answers
``GET /health`` and ``GET /v1/models`` like an engine of its role, and every request its ``script``
answers (any request, health probes included) with exactly the bytes the script gives, in the pieces
and pauses it gives. It records the requests it read and how many of its connections the client closed.
It moves no KV cache and computes nothing: it stands in for an engine's HTTP answers only.
"""

from __future__ import annotations

import asyncio
import enum
import json
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

__all__ = ["RawEngine", "RawRequest", "Then", "json_answer"]

_MAX_BODY = 1 << 20  # what a test's proxy sends an engine is far smaller; more closes the connection
_READ_TIMEOUT = 30.0  # the longest wait for a request on an open connection


class Then(enum.Enum):
    """What a script does with the connection after its last piece (the default: read the next request)."""

    CLOSE = "close"  # close it
    HOLD = "hold"  # read nothing more, keep it open until the client closes it (as an upgraded server would)


Piece = Union[bytes, float, Then]  # bytes: written and drained; a float: a pause of that many seconds


@dataclass
class RawRequest:
    """One request as the raw engine read it (the head's lines as sent; names lower-cased)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


Script = Callable[[RawRequest], Optional[Sequence[Piece]]]


def json_answer(value: Any, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    """A complete HTTP/1.1 answer with a JSON body (``extra``: more header lines, each ending in CRLF)."""
    body = json.dumps(value).encode()
    return (b"HTTP/1.1 %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b\r\n%b"
            % (status, len(body), extra, body))


class RawEngine:
    """Owns a raw-socket server, its event loop and that loop's named thread (see the module doc);
    ``script`` may be replaced between requests. Stop it with :meth:`close`."""

    def __init__(self, role: str, script: Optional[Script] = None) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', not {role!r}")
        self.role = role
        self.script: Optional[Script] = script  # None, or a None from it: the default answers
        self.requests: list[RawRequest] = []
        self.connections = 0
        self._closed_by_client = 0
        self._changed = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"test-raw-engine-{role}", daemon=True)
        self._server: Optional[asyncio.AbstractServer] = None
        self._tasks: set[asyncio.Task] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "RawEngine":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def closed_by_client(self, at_least: int, timeout: float) -> int:
        """Block until the client closed ``at_least`` connections (or ``timeout`` passed); the count."""
        with self._changed:
            self._changed.wait_for(lambda: self._closed_by_client >= at_least, timeout)
            return self._closed_by_client

    def requests_to(self, path: str) -> list[RawRequest]:
        return [r for r in list(self.requests) if r.path == path]

    # ------------------------------------------------------------------ on the engine's loop
    def _default(self, req: RawRequest) -> Sequence[Piece]:
        if req.method == "GET" and req.path == "/health":
            return [json_answer({"status": "ok", "role": self.role, "engine_id": f"raw-{self.role}", "tp_size": 1})]
        if req.method == "GET" and req.path == "/v1/models":
            return [json_answer({"object": "list", "data": [{"id": "raw-model", "max_model_len": 32768}]})]
        return [json_answer({"error": {"message": f"no script answers {req.method} {req.path}"}}, b"404 Not Found")]

    async def _read_request(self, reader: asyncio.StreamReader) -> RawRequest:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT)
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        if not 0 <= length <= _MAX_BODY:
            raise ValueError(f"a request body of {length} bytes")
        body = await asyncio.wait_for(reader.readexactly(length), _READ_TIMEOUT) if length else b""
        return RawRequest(method, path, headers, body)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # the server runs this coroutine as a task
        self._tasks.add(task)
        self.connections += 1
        by_client = False
        try:
            while True:
                try:
                    req = await self._read_request(reader)
                except asyncio.IncompleteReadError as exc:
                    by_client = not exc.partial  # closed between requests
                    return
                self.requests.append(req)
                script = self.script
                pieces = (script(req) if script is not None else None) or self._default(req)
                then = None
                for piece in pieces:
                    if isinstance(piece, Then):
                        then = piece
                        break
                    if isinstance(piece, (int, float)):
                        await asyncio.sleep(piece)
                    else:
                        writer.write(piece)
                        await writer.drain()
                if then is Then.CLOSE:
                    return
                if then is Then.HOLD:
                    while await reader.read(65536):
                        pass
                    by_client = True
                    return
        except ConnectionError:
            by_client = True
        except (asyncio.TimeoutError, asyncio.LimitOverrunError, ValueError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._tasks.discard(asyncio.current_task())
            if by_client:
                with self._changed:
                    self._closed_by_client += 1
                    self._changed.notify_all()

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def close(self) -> None:
        """Stop serving, end every connection, stop the loop and join its thread."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._loop.is_running():
            self._loop.close()
