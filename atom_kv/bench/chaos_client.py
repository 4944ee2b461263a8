"""The chaos soak's client: constant mixed traffic to both proxies, each answer classified against a
colocated engine's.

A request is greedy, streaming or not, a chat or a completion, on one of a few prompts and lengths, sent to
the proxies in turn. Its answer is one :class:`Outcome`:

- ``ok``: HTTP 200 and the text equals the colocated engine's;
- ``cut``: a stream that ended in an error event (clean JSON) after text that is a prefix of the colocated
  engine's;
- ``clean_error``: a 502, 503 or 504 with an OpenAI-shaped JSON error;
- ``refused``: no connection to the proxy at all (it was killed, or not yet restarted): the client never
  got a byte, so nothing wrong reached it;
- ``dropped``: the connection broke mid-answer, with text that is a prefix of the colocated engine's
  (acceptable only while the proxy it used was being killed: the report checks);
- ``wrong``: text that is not the colocated engine's (or not a prefix of it);
- ``unclean``: anything else (another status, a body that is not a JSON error, a stream without
  ``[DONE]``).

A request's deadline is ``deadline_s``: one that takes longer is ``late`` whatever its outcome (the soak's
"hung").
"""

from __future__ import annotations

import enum
import http.client
import json
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

__all__ = ["Outcome", "PROMPTS", "Request", "Traffic", "classify", "request_body", "send"]

#: prompts of a few lengths (the byte tokenizer: about one token a character)
PROMPTS = (
    "The quick brown fox jumps over the lazy dog. ",
    "In a paged KV cache, every block holds the keys and values of sixteen tokens; " * 3,
    "Disaggregated serving splits prefill and decode. " * 9,
    "Chaos engineering: faults that overlap, while traffic runs, for minutes. " * 5,
    "A short one.",
    "Prefill computes the prompt's KV cache; decode reads it and generates the tokens. " * 6,
)
MAX_TOKENS = (8, 24)


class Outcome(enum.Enum):
    """How one request ended (see the module docstring)."""

    OK = "ok"
    CUT = "cut"
    CLEAN_ERROR = "clean_error"
    REFUSED = "refused"
    DROPPED = "dropped"
    WRONG = "wrong"
    UNCLEAN = "unclean"


@dataclass(frozen=True)
class Shape:
    """What a request asks: which prompt, chat or not, streaming or not, how many tokens."""

    prompt: int
    chat: bool
    stream: bool
    max_tokens: int

    @property
    def key(self) -> tuple[int, bool, int]:
        """What its expected text depends on (streaming does not change the text)."""
        return (self.prompt, self.chat, self.max_tokens)


@dataclass
class Request:
    """One request's record: what was asked of which proxy, when, and how it ended."""

    shape: Shape
    proxy: str
    started: float
    ended: float = 0.0
    status: int = 0
    outcome: Optional[Outcome] = None
    late: bool = False
    detail: str = ""

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def request_body(shape: Shape) -> tuple[str, dict]:
    prompt = PROMPTS[shape.prompt]
    body: dict[str, Any]
    if shape.chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"prompt": prompt}
    body.update(model="atom-kv-tiny", max_tokens=shape.max_tokens, temperature=0, stream=shape.stream)
    return path, body


def _error_message(raw: bytes) -> Optional[str]:
    """The message of an OpenAI-shaped JSON error body, else None."""
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None
    return message if isinstance(message, str) and message else None


def send(base_url: str, shape: Shape, timeout: float) -> tuple[int, str, str, bool]:
    """One request: ``(status, text, error, complete)``; status 0: no connection was made. ``error`` is ''
    on success; ``complete`` says the answer ended as it should (a JSON body, or a stream's ``[DONE]``, or
    an error event)."""
    path, body = request_body(shape)
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=timeout)
    try:
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
        except OSError as exc:
            return 0, "", f"no answer: {type(exc).__name__}: {exc}", False
        if resp.status != 200:
            try:
                raw = resp.read()
            except OSError as exc:
                return resp.status, "", f"body broken: {exc}", False
            message = _error_message(raw)
            return resp.status, "", message or f"not a JSON error: {raw[:200]!r}", message is not None
        try:
            return (resp.status, *_read_answer(resp, shape))
        except (OSError, http.client.HTTPException) as exc:
            return resp.status, "", f"answer broken: {type(exc).__name__}: {exc}", False
    finally:
        conn.close()


def _read_answer(resp: http.client.HTTPResponse, shape: Shape) -> tuple[str, str, bool]:
    if not shape.stream:
        raw = resp.read()
        try:
            choice = json.loads(raw)["choices"][0]
            return (choice["message"]["content"] if shape.chat else choice["text"]), "", True
        except (ValueError, KeyError, TypeError, IndexError):
            return "", f"not a completion: {raw[:200]!r}", False
    pieces: list[str] = []
    try:
        for raw_line in resp:
            line = raw_line.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return "".join(pieces), "", True
            event = json.loads(payload)
            if "error" in event:
                message = (event["error"] or {}).get("message") if isinstance(event["error"], dict) else None
                return "".join(pieces), message or f"error event without a message: {payload[:200]}", bool(message)
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content") if shape.chat else choice.get("text")
                pieces.append(piece or "")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return "".join(pieces), f"stream broken: {type(exc).__name__}: {exc}", False
    return "".join(pieces), "stream ended without [DONE]", False


def classify(status: int, text: str, error: str, complete: bool, expected: str) -> Outcome:
    """The :class:`Outcome` of one answer, against the colocated engine's ``expected`` text."""
    if status == 0:
        return Outcome.REFUSED
    if status == 200 and not error:
        return Outcome.OK if text == expected else Outcome.WRONG
    if not expected.startswith(text):
        return Outcome.WRONG
    if status in (502, 503, 504) and complete:
        return Outcome.CLEAN_ERROR
    if status == 200 and complete:  # an error event, after a prefix
        return Outcome.CUT
    if status == 200:
        return Outcome.DROPPED
    return Outcome.UNCLEAN


class Traffic:
    """Owns the client threads (on the client host) and every :class:`Request` they sent."""

    def __init__(self, submit: Callable, proxies: list[str], expected: dict[tuple[int, bool, int], str], *,
                 concurrency: int, seed: int, deadline_s: float) -> None:
        self._submit = submit  # runs a function on a thread of the client host
        self._proxies = proxies
        self._expected = expected
        self._concurrency = concurrency
        self._seed = seed
        self._deadline_s = deadline_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.requests: list[Request] = []
        self._futures: list = []

    def start(self) -> None:
        for i in range(self._concurrency):
            self._futures.append(self._submit(self._loop, i))

    def stop(self, timeout: float) -> list[Request]:
        """Stop sending; wait up to ``timeout`` for the requests in flight; returns those still running."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for fut in self._futures:
            try:
                fut.result(max(0.0, deadline - time.monotonic()))
            except Exception:  # a client thread that timed out or failed: its request shows as unfinished
                pass
        with self._lock:
            return [r for r in self.requests if r.outcome is None]

    def _loop(self, index: int) -> None:
        threading.current_thread().name = f"chaos-client-{index}"
        rng = random.Random(self._seed * 1000 + index)
        n = index
        while not self._stop.is_set():
            shape = Shape(rng.randrange(len(PROMPTS)), rng.random() < 0.5, rng.random() < 0.5,
                          rng.choice(MAX_TOKENS))
            proxy = self._proxies[n % len(self._proxies)]
            n += 1
            req = Request(shape, proxy, time.monotonic())
            with self._lock:
                self.requests.append(req)
            status, text, error, complete = send(proxy, shape, timeout=self._deadline_s)
            req.ended = time.monotonic()
            req.status = status
            req.late = req.seconds > self._deadline_s
            req.outcome = classify(status, text, error, complete, self._expected[shape.key])
            req.detail = error[:300]
            if req.outcome in (Outcome.REFUSED, Outcome.CLEAN_ERROR):
                self._stop.wait(0.25)  # as a client backs off: a fleet that answers 503 at once is not hammered
